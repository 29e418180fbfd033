"""``/v1/realtime`` answering the user through an LLM: voice to voice, per-turn timings and omnigate's own overhead.

Three processes on this machine: the OpenAI-compatible stand-ins (``omnigate-loadtest standins``: transcription
after ``--asr-ms``, the LLM's first token after ``--first-token-ms``, then ``--tokens-per-s``), ``omnigate serve``
(the piper voice, ``--llm-url``/``--asr-url`` pointing at the stand-ins) and the load-test ``realtime`` target's
clients in talk mode: each conversation speaks a recorded user turn (the piper voice: "Could you book a table for
two at eight tonight?") in real time over ``input_audio_buffer.append`` with silence between turns, the server's
VAD ends the turn, the server transcribes, asks the LLM and speaks; the client waits for the reply and plays it
through the load test's jitter-buffer player. Clients run at websockets' defaults (compression offered).

Reported per level (1 conversation, then ``--conversations`` at once):

- voice to voice: from the last append of the user's speech to the first reply audio received (this includes
  the VAD's silence before it ends the turn: ``silence_duration_ms``, 500 by default);
- the server's per-turn timings from ``response.done``'s metadata (end of speech to transcript, first token, first
  audio out; the services' own times; omnigate's overhead: first audio minus ASR, LLM and TTS time);
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
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from omnigate.loadtest.openai_standins import standins_process
from omnigate.loadtest.report import TargetSpec
from omnigate.loadtest.server_process import server_process
from omnigate.loadtest.stats import distribution
from omnigate.loadtest.targets.base import SessionSettings
from omnigate.loadtest.targets.realtime import RealtimeTarget
from omnigate.loadtest.traces import SessionTrace

STEPS = ("transcript", "asr", "first_token", "llm", "first_audio", "tts", "overhead")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--conversations", type=int, default=20, help="simultaneous conversations of the big level")
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


async def conversations(url: str, count: int, turns: int, args: argparse.Namespace) -> dict[str, Any]:
    """``count`` talk-mode conversations of ``turns`` turns each, started over ``--ramp-s``."""
    spec = TargetSpec(label="talk", target="realtime", url=f"{url}/v1/realtime#talk=1&append_ms={args.append_ms}")
    target = RealtimeTarget(spec, SessionSettings(utterance_timeout_s=30.0))
    texts = ["(the user's recorded turn)"] * turns
    traces = [SessionTrace(i, time.perf_counter()) for i in range(count)]

    async def one(index: int, trace: SessionTrace) -> None:
        await asyncio.sleep(args.ramp_s * index / max(1, count))  # a spread-out start, not a synchronisation
        await target.run_session(texts, trace)
        trace.end(time.perf_counter())

    load_before = os.getloadavg()
    await asyncio.gather(*(one(i, trace) for i, trace in enumerate(traces)))
    utterances = [u for trace in traces for u in trace.utterances]
    voice_to_voice = [ms for u in utterances if u.status == "completed" and (ms := u.ttfa_ms()) is not None]
    players = [u.play(args.jitter_ms) for u in utterances if u.arrivals]
    errors: dict[str, int] = {}
    for trace in traces:
        for code, n in trace.errors.items():
            errors[code] = errors.get(code, 0) + n
    timings = {step: as_dict(distribution([t[step] for t in target.turn_timings if step in t])) for step in STEPS}
    return {
        "conversations": count,
        "turns_planned": count * turns,
        "turns": len(utterances),
        "turns_completed": sum(1 for u in utterances if u.status == "completed"),
        "failures": sum(1 for u in utterances if u.status != "completed") + (count * turns - len(utterances)),
        "voice_to_voice_ms": as_dict(distribution(voice_to_voice)),
        "server_turn_timings_ms": timings,
        "turns_with_timings": len(target.turn_timings),
        "reply_audio_ms": as_dict(distribution([u.audio_ms for u in utterances if u.status == "completed"])),
        "underruns": sum(p.underruns for p in players),
        "turns_with_underruns": sum(1 for p in players if p.underruns),
        "errors": errors,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def summary(level: dict[str, Any]) -> str:
    v2v = level["voice_to_voice_ms"]
    overhead = level["server_turn_timings_ms"]["overhead"]
    return (
        f"{level['conversations']:3d} conversations: {level['turns_completed']}/{level['turns_planned']} turns, "
        f"voice to voice p50 {v2v['p50']} p95 {v2v['p95']} ms, overhead p50 {overhead['p50']} ms, "
        f"underruns {level['underruns']}, errors {level['errors']}"
    )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    standin_options = [
        "--asr-delay-ms", f"{args.asr_ms:g}",
        "--llm-first-token-ms", f"{args.first_token_ms:g}",
        "--llm-tokens-per-s", f"{args.tokens_per_s:g}",
    ]  # fmt: skip
    levels: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        async with standins_process(standin_options, Path(tmp) / "standins.log") as services:
            serve_args = ["--engine", "piper", "--llm-url", services, "--asr-url", services, *args.serve_arg]
            async with server_process([*serve_args, "--log-level", "warning"], Path(tmp) / "server.log") as server:
                for count in (1, args.conversations):
                    level = await conversations(server.url, count, args.turns, args)
                    print(summary(level), flush=True)
                    levels.append(level)
            async with httpx.AsyncClient(trust_env=False) as client:
                standins_seen = (await client.get(services.removesuffix("/v1") + "/_standin/stats")).json()
    standins_seen.pop("last_chat_request", None)
    standins_seen.pop("last_authorization", None)
    standins_seen["asr_audio_s"] = as_dict(distribution(standins_seen["asr_audio_s"]))
    return {
        "benchmark": "realtime_responder",
        "server": "omnigate serve " + " ".join(["--engine", "piper", "--llm-url", "STANDINS", "--asr-url", "STANDINS"]),
        "standins": {
            "asr_delay_ms": args.asr_ms,
            "llm_first_token_ms": args.first_token_ms,
            "llm_tokens_per_s": args.tokens_per_s,
            "seen": standins_seen,
        },
        "client": {"append_ms": args.append_ms, "jitter_ms": args.jitter_ms, "compression": "offered"},
        "levels": levels,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


if __name__ == "__main__":
    arguments = parse_args()
    report = asyncio.run(main(arguments))
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(report, indent=2) + "\n")
