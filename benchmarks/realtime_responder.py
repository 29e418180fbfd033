"""``/v1/realtime`` answering the user through an LLM: voice to voice, per-turn timings and omnigate's own overhead.

Three processes on this machine: the OpenAI-compatible stand-ins (``omnigate-loadtest standins``: transcription
after ``--asr-ms``, the LLM's first token after ``--first-token-ms``, then ``--tokens-per-s``), ``omnigate serve``
(the piper voice, ``--llm-url``/``--asr-url`` pointing at the stand-ins) and the load-test ``realtime`` target's
clients in talk mode: each conversation speaks a recorded user turn (the piper voice: "Could you book a table for
two at eight tonight?") in real time over ``input_audio_buffer.append`` with silence between turns, the server's
VAD ends the turn, the server transcribes, asks the LLM and speaks; the client waits for the reply and plays it
through the load test's jitter-buffer player. Clients run at websockets' defaults (compression offered).

Reported per level (``--levels``: 1 conversation, then 20 at once):

- voice to voice: from the last append of the user's speech to the first reply audio received (this includes
  the VAD's silence before it ends the turn: ``silence_duration_ms``, 500 by default);
- the server's per-turn timings from ``response.done``'s metadata (end of speech to transcript, first token, first
  audio out; the services' own times; omnigate's overhead: first audio minus ASR, LLM and TTS time);
- omnigate's overhead measured from outside: from the client receiving ``speech_stopped`` to the first reply audio
  received, minus the stand-ins' own times (the transcription's; the chat request's to its first token, plus the
  tokens until the text segmenter releases the reply's first unit, at the configured rate), minus piper's own time
  to synthesize that first unit (measured in this process on the idle machine before the server starts). What is
  left is omnigate's: both HTTP calls, the event loop, the session, the engine pool's queueing (and, under load,
  CPU contention), the encoder and both WebSocket hops;
- underruns of the player, and every response not completed as a failure.

The same measurement with the load-test CLI (one level, the summary table instead of the per-turn split)::

    omnigate-loadtest standins --port 8090 &
    omnigate serve --llm-url http://127.0.0.1:8090/v1 --asr-url http://127.0.0.1:8090/v1 &
    omnigate-loadtest run 'http://127.0.0.1:8000#talk=1' --target realtime --sessions 20 --duration 30

Run from the repository root (the report records the load average)::

    .venv/bin/python benchmarks/realtime_responder.py --out docs/benchmarks/realtime_responder.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from omnigate.engines.piper import PiperEngine
from omnigate.gateway.settings import Settings
from omnigate.loadtest.openai_standins import standins_process
from omnigate.loadtest.report import TargetSpec
from omnigate.loadtest.server_process import server_process
from omnigate.loadtest.stats import distribution
from omnigate.loadtest.targets.base import SessionSettings
from omnigate.loadtest.targets.realtime import RealtimeTarget
from omnigate.loadtest.traces import SessionTrace
from omnigate.sessions.segmenter import SegmenterConfig, TextSegmenter

STEPS = ("transcript", "asr", "first_token", "llm", "first_audio", "tts", "overhead")
CLIENT_STEPS = ("client_voice_to_voice", "client_turn_to_audio")
REPLY = "Sure, I can book a table for two at eight tonight. Would you like a table by the window, or is anywhere fine?"


def first_unit(reply: str, tokens_per_s: float) -> tuple[str, float]:
    """The reply's first unit for the TTS, as the server's segmenter (at its default settings) cuts the reply
    arriving token by token as the stand-in streams it, and when its last token arrives after the first (ms)."""
    defaults = Settings()
    segmenter = TextSegmenter(
        SegmenterConfig(max_chars=defaults.segment_max_chars, max_wait_ms=defaults.segment_max_wait_ms)
    )
    for index, token in enumerate(re.findall(r"\s*\S+", reply)):
        at_ms = index * 1000.0 / tokens_per_s
        units = segmenter.poll(at_ms) + segmenter.push(token, at_ms)
        if units:
            return units[0], at_ms
    return reply, 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--levels", default="1,20", help="simultaneous conversations, one level each")
    parser.add_argument(
        "--tts",
        default="piper",
        choices=["piper", "synthetic"],
        help="the server's voice: piper, or the synthetic test engine (--synthetic-model), which isolates what the "
        "responder and the gateway cost from the voice's own capacity",
    )
    parser.add_argument("--synthetic-model", default="rtf=0.05,first_chunk_delay_ms=50")
    parser.add_argument("--turns", type=int, default=3, help="user turns per conversation")
    parser.add_argument("--asr-ms", type=float, default=150.0)
    parser.add_argument("--first-token-ms", type=float, default=200.0)
    parser.add_argument("--tokens-per-s", type=float, default=30.0)
    parser.add_argument("--append-ms", type=int, default=40)
    parser.add_argument("--jitter-ms", type=float, default=100.0, help="the simulated player's buffer")
    parser.add_argument("--ramp-s", type=float, default=2.0, help="conversation starts spread over this long")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra omnigate serve argument")
    return parser.parse_args(argv)


def as_dict(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__struct_fields__}


class PiperSampler:
    """Piper's own time to synthesize the reply's first unit, sampled while a level runs, in a process of its own
    (as the server's engine has its own threads, away from this client's event loop): one synthesis every
    ``interval_s``."""

    def __init__(self, text: str, interval_s: float = 1.5) -> None:
        self.text = text
        self.interval_s = interval_s

    async def sample(self, samples: list[float]) -> None:
        """Until cancelled, append each synthesis time (ms) the sampler process reports to ``samples``."""
        process = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--sample-piper", self.text, "--interval", str(self.interval_s),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert process.stdout is not None
        try:
            while line := await process.stdout.readline():
                samples.append(float(line))
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


def sample_piper(text: str, interval_s: float) -> None:
    """The sampler process: print piper's time to synthesize ``text`` (ms), one line every ``interval_s``."""
    engine = PiperEngine.load(None, workers=1)
    engine.synthesize(text, speaker_id=None, speed=1.0)  # onnxruntime's first run is slow
    while True:
        started = time.perf_counter()
        engine.synthesize(text, speaker_id=None, speed=1.0)
        print(f"{(time.perf_counter() - started) * 1000.0:.2f}", flush=True)
        time.sleep(interval_s)


async def service_times(base: str, client: httpx.AsyncClient) -> dict[str, Any]:
    stats = (await client.get(base.removesuffix("/v1") + "/_standin/stats")).json()
    return {
        "llm_requests": stats["llm_requests"],
        "llm_disconnects": stats["llm_disconnects"],
        "asr_requests": stats["asr_requests"],
        "asr_service_ms": stats["asr_service_ms"],
        "llm_first_token_service_ms": stats["llm_first_token_service_ms"],
        "asr_audio_s": stats["asr_audio_s"],
    }


async def conversations(
    url: str, services: str, count: int, piper: PiperSampler | None, unit_ms: float, args: argparse.Namespace
) -> dict[str, Any]:
    """``count`` talk-mode conversations of ``turns`` turns each, started over ``--ramp-s``."""
    spec = TargetSpec(label="talk", target="realtime", url=f"{url}/v1/realtime#talk=1&append_ms={args.append_ms}")
    target = RealtimeTarget(spec, SessionSettings(utterance_timeout_s=30.0))
    turns = args.turns
    texts = ["(the user's recorded turn)"] * turns
    traces = [SessionTrace(i, time.perf_counter()) for i in range(count)]

    async def one(index: int, trace: SessionTrace) -> None:
        await asyncio.sleep(args.ramp_s * index / max(1, count))  # a spread-out start, not a synchronisation
        await target.run_session(texts, trace)
        trace.end(time.perf_counter())

    async with httpx.AsyncClient(trust_env=False) as client:
        seen_before = await service_times(services, client)
        load_before = os.getloadavg()
        tts_samples: list[float] = []
        sampler = asyncio.create_task(piper.sample(tts_samples)) if piper is not None else None
        try:
            await asyncio.gather(*(one(i, trace) for i, trace in enumerate(traces)))
        finally:
            if sampler is not None:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
        if piper is None:  # the synthetic engine's first audio takes its configured delay
            spec = dict(item.split("=", 1) for item in args.synthetic_model.split(","))
            tts_samples = [float(spec.get("first_chunk_delay_ms", 0.0))]
        seen_after = await service_times(services, client)
    asr_ms = seen_after["asr_service_ms"][len(seen_before["asr_service_ms"]) :]
    llm_ms = seen_after["llm_first_token_service_ms"][len(seen_before["llm_first_token_service_ms"]) :]
    asr_p50, llm_p50, tts_p50 = (distribution(x).p50 for x in (asr_ms, llm_ms, tts_samples))
    external = [
        t["client_turn_to_audio"] - asr_p50 - (llm_p50 + unit_ms) - tts_p50
        for t in target.turn_timings
        if "client_turn_to_audio" in t and None not in (asr_p50, llm_p50, tts_p50)
    ]
    utterances = [u for trace in traces for u in trace.utterances]
    voice_to_voice = [ms for u in utterances if u.status == "completed" and (ms := u.ttfa_ms()) is not None]
    players = [u.play(args.jitter_ms) for u in utterances if u.arrivals]
    errors: dict[str, int] = {}
    error_details: dict[str, str] = {}
    for trace in traces:
        for code, n in trace.errors.items():
            errors[code] = errors.get(code, 0) + n
        for code, detail in trace.error_details.items():
            error_details.setdefault(code, detail[:300])
    timings = {
        step: as_dict(distribution([t[step] for t in target.turn_timings if step in t]))
        for step in (*STEPS, *CLIENT_STEPS)
    }
    return {
        "conversations": count,
        "turns_planned": count * turns,
        "turns": len(utterances),
        "turns_completed": sum(1 for u in utterances if u.status == "completed"),
        "failures": sum(1 for u in utterances if u.status != "completed") + (count * turns - len(utterances)),
        "voice_to_voice_ms": as_dict(distribution(voice_to_voice)),
        "server_turn_timings_ms": timings,
        "turns_with_timings": len(target.turn_timings),
        "standins_service_ms": {
            "asr": as_dict(distribution(asr_ms)),
            "llm_first_token": as_dict(distribution(llm_ms)),
        },
        "tts_first_unit_ms": as_dict(distribution(tts_samples)),
        "llm_requests": seen_after["llm_requests"] - seen_before["llm_requests"],
        "llm_disconnects": seen_after["llm_disconnects"] - seen_before["llm_disconnects"],
        "asr_requests": seen_after["asr_requests"] - seen_before["asr_requests"],
        "overhead_measured_outside_ms": as_dict(distribution(external)),
        "reply_audio_ms": as_dict(distribution([u.audio_ms for u in utterances if u.status == "completed"])),
        "underruns": sum(p.underruns for p in players),
        "turns_with_underruns": sum(1 for p in players if p.underruns),
        "errors": errors,
        "error_details": error_details,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def summary(level: dict[str, Any]) -> str:
    v2v = level["voice_to_voice_ms"]
    overhead = level["overhead_measured_outside_ms"]
    tts = level["tts_first_unit_ms"]
    return (
        f"{level['conversations']:3d} conversations: {level['turns_completed']}/{level['turns_planned']} turns, "
        f"voice to voice p50 {_ms(v2v['p50'])} p95 {_ms(v2v['p95'])}, overhead p50 {_ms(overhead['p50'])} "
        f"(the TTS's own p50 {_ms(tts['p50'])}; the server's split: "
        f"{_ms(level['server_turn_timings_ms']['overhead']['p50'])}), "
        f"underruns {level['underruns']}, errors {level['errors']}"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


async def main(args: argparse.Namespace) -> dict[str, Any]:
    load_idle = os.getloadavg()
    unit, unit_ms = first_unit(REPLY, args.tokens_per_s)
    piper = PiperSampler(unit) if args.tts == "piper" else None
    print(f"the reply's first unit: {unit!r}, complete {unit_ms:.0f} ms after the first token", flush=True)
    standin_options = [
        "--asr-delay-ms", f"{args.asr_ms:g}",
        "--llm-first-token-ms", f"{args.first_token_ms:g}",
        "--llm-tokens-per-s", f"{args.tokens_per_s:g}",
        "--default-reply", REPLY,
    ]  # fmt: skip
    levels: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        async with standins_process(standin_options, Path(tmp) / "standins.log") as services:
            voice = (
                ["--engine", "piper"]
                if args.tts == "piper"
                else ["--engine", "synthetic", "--model", args.synthetic_model]
            )
            serve_args = [*voice, "--llm-url", services, "--asr-url", services, *args.serve_arg]
            async with server_process([*serve_args, "--log-level", "warning"], Path(tmp) / "server.log") as server:
                for count in (int(n) for n in args.levels.split(",")):
                    level = await conversations(server.url, services, count, piper, unit_ms, args)
                    print(summary(level), flush=True)
                    levels.append(level)
    return {
        "benchmark": "realtime_responder",
        "server": "omnigate serve " + " ".join([*voice, "--llm-url", "STANDINS", "--asr-url", "STANDINS"]),
        "standins": {
            "asr_delay_ms": args.asr_ms,
            "llm_first_token_ms": args.first_token_ms,
            "llm_tokens_per_s": args.tokens_per_s,
            "reply": REPLY,
        },
        "first_unit": {"text": unit, "after_first_token_ms": unit_ms},
        "client": {"append_ms": args.append_ms, "jitter_ms": args.jitter_ms, "compression": "offered"},
        "levels": levels,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_at_start": [round(x, 2) for x in load_idle],
        },
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sample-piper"]:
        sample_piper(sys.argv[2], float(sys.argv[4]))
        sys.exit(0)
    arguments = parse_args()
    report = asyncio.run(main(arguments))
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(report, indent=2) + "\n")
