"""The duplex engine's ``tiny`` preset on this CPU: sessions per machine at real-time ticks, and barge-in reaction.

1. Engine: N sessions on the real lockstep clock, in process, each consuming its frames as they come (a client that
   reads in real time); a level holds when no tick was missed (the clock never fell a frame behind). Sessions per
   machine is the largest N that holds.
2. End to end, duplex: ``omnigate serve --engine duplex --model preset:tiny`` in its own process and the load-test
   ``realtime`` target's clients (real-time microphone appends of a recorded user turn, ``response.cancel`` after
   ``--barge-in-ms`` of reply audio): barge-in reaction time (cancel sent to the last audio delta of that response
   received), cancel to ``response.done``, and player underruns. With random weights the model talks nearly all the
   time (the heaviest case for the server) and when it answers is noise, so its voice-to-voice time means nothing.
3. End to end, text-to-speech: ``omnigate serve --engine piper`` and the same clients as a voice agent drives them
   (server VAD ends the user's turn, then the agent's text is spoken): voice-to-voice latency and underruns.

Run from the
repository root (results depend on what else the machine runs; the report records the load average):

    .venv/bin/python benchmarks/duplex_cpu.py --out docs/benchmarks/realtime.json
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

import torch

from omnigate.engines.duplex.engine import DuplexEngine
from omnigate.engines.duplex.session import DuplexFrame, DuplexSession
from omnigate.loadtest.report import TargetSpec
from omnigate.loadtest.server_process import server_process
from omnigate.loadtest.stats import distribution
from omnigate.loadtest.targets.base import SessionSettings
from omnigate.loadtest.targets.realtime import RealtimeTarget
from omnigate.loadtest.traces import SessionTrace


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--levels", default="1,2,4,8,12,16,24,32", help="engine levels: concurrent sessions")
    parser.add_argument("--seconds", type=float, default=10.0, help="clock time per engine level")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--sessions", type=int, default=4, help="end-to-end concurrent client sessions")
    parser.add_argument("--turns", type=int, default=5, help="user turns (each with a barge-in) per client session")
    parser.add_argument("--barge-in-ms", type=float, default=600.0)
    parser.add_argument("--append-ms", type=int, default=40)
    parser.add_argument("--jitter-ms", type=float, default=100.0, help="the simulated player's buffer")
    return parser.parse_args(argv)


async def engine_level(engine: DuplexEngine, sessions: int, seconds: float) -> dict[str, Any]:
    """Run ``sessions`` on the clock for ``seconds``; every frame is taken at once and its credit returned."""
    opened: list[DuplexSession] = []
    received = [0] * sessions
    for index in range(sessions):

        def sink(frame: DuplexFrame, index: int = index) -> None:
            received[index] += 1
            engine.grant(opened[index], 1)

        opened.append(engine.open_session(sink, max_input_bytes=1 << 20, initial_credit_frames=4))
    before = _clock(engine)
    await asyncio.sleep(seconds)  # the clock runs on its own thread; this is the measured span, not a sync
    after = _clock(engine)
    for session in opened:
        engine.close_session(session)
    ticks = after["ticks"] - before["ticks"]
    step_s = after["step_seconds_total"] - before["step_seconds_total"]
    return {
        "sessions": sessions,
        "ticks": ticks,
        "late_ticks": after["late_ticks"] - before["late_ticks"],
        "missed_ticks": after["missed_ticks"] - before["missed_ticks"],
        "step_ms_mean": step_s * 1000.0 / ticks if ticks else None,
        "frames_per_session_per_s": sum(received) / sessions / seconds,
    }


def _clock(engine: DuplexEngine) -> dict[str, float]:
    stats = engine.stats
    return {
        "ticks": stats.ticks,
        "late_ticks": stats.late_ticks,
        "missed_ticks": stats.missed_ticks,
        "step_seconds_total": stats.step_seconds_total,
    }


async def engine_capacity(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    levels = sorted({int(n) for n in args.levels.split(",")})
    engine = DuplexEngine.load("preset:tiny", max_sessions=max(levels))
    results = []
    try:
        for sessions in levels:
            result = await engine_level(engine, sessions, args.seconds)
            results.append(result)
            print(
                f"engine {sessions:3d} sessions: {result['ticks']} ticks, {result['missed_ticks']} missed, "
                f"{result['late_ticks']} late, step {result['step_ms_mean']:.1f} ms",
                flush=True,
            )
            if result["missed_ticks"] > 0 and sessions > 1 and results[-2]["missed_ticks"] > 0:
                break  # two failing levels in a row: larger ones only fail harder
    finally:
        engine.shutdown()
    holding = [r["sessions"] for r in results if r["missed_ticks"] == 0]
    return {"levels": results, "sessions_per_machine": max(holding, default=0), "torch_threads": args.threads}


async def end_to_end(
    args: argparse.Namespace, serve_args: list[str], fragment: str, texts: list[str]
) -> dict[str, Any]:
    """Client sessions of the ``realtime`` target against ``omnigate serve SERVE_ARGS`` in its own process."""
    with tempfile.TemporaryDirectory() as tmp:
        async with server_process([*serve_args, "--log-level", "warning"], Path(tmp) / "server.log") as server:
            spec = TargetSpec(label="realtime", target="realtime", url=f"{server.url}/v1/realtime#{fragment}")
            target = RealtimeTarget(spec, SessionSettings(utterance_timeout_s=30.0))
            traces = [SessionTrace(i, time.perf_counter()) for i in range(args.sessions)]
            await asyncio.gather(*(target.run_session(texts, trace) for trace in traces))
            for trace in traces:
                trace.end(time.perf_counter())
    utterances = [u for trace in traces for u in trace.utterances]
    voice_to_voice = [ms for u in utterances if (ms := u.ttfa_ms()) is not None]
    players = [u.play(args.jitter_ms) for u in utterances if u.arrivals]
    errors: dict[str, int] = {}
    for trace in traces:
        for code, count in trace.errors.items():
            errors[code] = errors.get(code, 0) + count
    return {
        "server": " ".join(serve_args),
        "client": fragment,
        "sessions": args.sessions,
        "turns": len(utterances),
        "barge_in_reaction_ms": msgspec_to_dict(distribution(target.barge_in_ms)),
        "cancel_to_response_done_ms": msgspec_to_dict(distribution(target.cancel_to_done_ms)),
        "voice_to_voice_ms": msgspec_to_dict(distribution(voice_to_voice)),
        "underruns": sum(p.underruns for p in players),
        "turns_with_underruns": sum(1 for p in players if p.underruns),
        "errors": errors,
        "jitter_ms": args.jitter_ms,
    }


def msgspec_to_dict(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__struct_fields__}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    engine = await engine_capacity(args)
    duplex = await end_to_end(
        args,
        ["--engine", "duplex", "--model", "preset:tiny", "-E", f"max_sessions={args.sessions}"],
        f"append_ms={args.append_ms}&barge_in_ms={args.barge_in_ms:g}",
        ["(the duplex model answers on its own)"] * args.turns,
    )
    print("duplex:", json.dumps(duplex, indent=2), flush=True)
    tts = await end_to_end(
        args,
        ["--engine", "piper"],
        f"append_ms={args.append_ms}",
        ["Sure, I have booked a table for two at eight tonight."] * args.turns,
    )
    print("piper:", json.dumps(tts, indent=2), flush=True)
    return {
        "benchmark": "duplex_cpu",
        "preset": "tiny",
        "engine": engine,
        "duplex_end_to_end": duplex,
        "tts_end_to_end": tts,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }


if __name__ == "__main__":
    arguments = parse_args()
    report = asyncio.run(main(arguments))
    arguments.out.write_text(json.dumps(report, indent=2) + "\n")
