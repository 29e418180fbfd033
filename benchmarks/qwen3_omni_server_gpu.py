"""Qwen3-Omni through the server: ``omnigate serve --engine qwen3-omni`` driven by the load-test CLI's ``realtime``
target (spoken turns answered by the model; microphone audio appended in real time, answers played through the
jitter-buffer player, clients at their defaults otherwise).

- ``vad``: one conversation whose turns the server's VAD ends: voice to voice (end of the speech sent to the first
  answer audio received) and, from the turn steps, ``speech_stopped`` received to the first answer audio received.
- ``commit`` at each level of ``--levels``: every client ends its turns itself (``input_audio_buffer.commit`` and
  ``response.create`` right after its speech), so each turn's TTFA is from the end of the user's turn to the
  answer's first audio; judged at first-audio p99 <= ``--slo-ms`` with no underrun. The capacity is the largest
  passing level; while time allows, levels between the largest passing and the smallest failing one are tried
  (halving the gap down to ``--resolution``).

Each level is its own load-test run (its JSON beside the summary); a level that would start past ``--deadline-s``
is skipped and said so. Answers are capped at ``--max-output-tokens`` (random weights never end an answer).

    python -m benchmarks.qwen3_omni_server_gpu --model preset:qwen3-omni-30b-a3b --device cuda --dtype bfloat16 \\
        --max-sessions 128 --levels 1,16,64,128 --out OUT
CPU dry run: ``--model preset:tiny --device cpu --dtype float32 --max-sessions 2 --levels 1,2 --duration 3``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from omnigate.loadtest.report import LevelReport, LoadTestReport
from omnigate.loadtest.server_process import server_process
from omnigate.loadtest.stats import Distribution


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:qwen3-omni-30b-a3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-sessions", type=int, default=128, help="the engine's slots")
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--levels", default="1,16,64,128", help="concurrent conversations, commit mode")
    parser.add_argument("--no-vad", action="store_true", help="skip the one-conversation server-VAD run")
    parser.add_argument("--max-output-tokens", type=int, default=8, help="each answer's text cap (8: 64 frames)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a level begins turns")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--drain", type=float, default=12.0)
    parser.add_argument("--slo-ms", type=float, default=600.0, help="first-audio p99 limit of a passing level")
    parser.add_argument("--resolution", type=int, default=16, help="the capacity search stops at this gap")
    parser.add_argument("--deadline-s", type=float, default=1e9, help="start no level after this many seconds")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def dist(d: Distribution | None) -> dict[str, float | None]:
    if d is None:
        return {}
    return {"count": d.count, "p50": d.p50, "p90": d.p90, "p99": d.p99, "max": d.max}


def level_row(mode: str, sessions: int, level: LevelReport, path: Path) -> dict[str, Any]:
    return {
        "mode": mode,
        "sessions": sessions,
        "passed": level.slo.passed,
        "reasons": list(level.slo.reasons),
        "utterances": msgspec.to_builtins(level.utterances),
        "errors": dict(level.errors),
        "error_examples": dict(level.error_examples),
        "ttfa_ms": dist(level.ttfa_ms),
        "turn_steps_ms": {step: dist(d) for step, d in level.turn_steps_ms.items()},
        "rtf": dist(level.rtf),
        "gap_ms": dist(level.gap_ms),
        "underruns": level.underruns,
        "stalled_ms": level.stalled_ms,
        "audio_s": level.audio_s,
        "report": path.name,
        # The engine's input encoder over the level (scraped from /metrics): forwards, and turns each carried.
        "encoder": {
            m.name: {"delta": m.delta, "last": m.last}
            for m in level.server_metrics
            if m.name.startswith("omnigate_qwen3_omni_encoder")
        },
    }


async def run_level(args: argparse.Namespace, url: str, pid: int, mode: str, sessions: int) -> dict[str, Any]:
    out = args.out / f"{mode}_{sessions}.json"
    fragment = f"max_output_tokens={args.max_output_tokens}" + ("&commit=1" if mode == "commit" else "")
    command = [sys.executable, "-m", "omnigate.loadtest.cli", "run", f"{url}#{fragment}", "--target", "realtime"]
    command += ["--sessions", str(sessions), "--duration", str(args.duration), "--warmup", str(args.warmup)]
    command += ["--drain", str(args.drain), "--utterances-per-session", "100", "--utterance-timeout", "60"]
    command += ["--slo-ttfa-ms", str(args.slo_ms), "--server-pid", str(pid), "--quiet", "--out", str(out)]
    log = (args.out / f"{mode}_{sessions}.log").open("wb")
    with log:
        process = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=asyncio.subprocess.STDOUT)
        await process.wait()
    if not out.exists():
        return {"mode": mode, "sessions": sessions, "failed": f"no report (exit {process.returncode})"}
    report = msgspec.json.decode(out.read_bytes(), type=LoadTestReport)
    return level_row(mode, sessions, report.levels[0], out)


async def main(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    options = {
        "device": args.device,
        "dtype": args.dtype,
        "max_sessions": args.max_sessions,
        "max_context": args.max_context,
    }
    serve = ["--engine", "qwen3-omni", "--model", args.model, "--log-level", "warning"]
    for key, value in options.items():
        serve += ["-E", f"{key}={value}"]
    summary: dict[str, Any] = {"command": [sys.argv[0], *sys.argv[1:]], "serve": serve, "slo_ms": args.slo_ms}
    rows: list[dict[str, Any]] = []
    async with server_process(serve, args.out / "server.log", ready_limit_s=600.0) as server:
        summary["ready_s"] = round(time.monotonic() - started, 1)
        print(f"server ready after {summary['ready_s']} s", flush=True)
        plan = ([] if args.no_vad else [("vad", 1)]) + [("commit", int(n)) for n in args.levels.split(",")]
        for mode, sessions in plan:
            elapsed = time.monotonic() - started
            if elapsed > args.deadline_s:
                rows.append({"mode": mode, "sessions": sessions, "skipped": f"deadline ({elapsed:.0f} s)"})
                continue
            row = await run_level(args, server.url, server.pid, mode, sessions)
            rows.append(row)
            print(brief(row), flush=True)
        # Then halve the gap between the largest passing level and the smallest failing one, while time allows.
        while time.monotonic() - started <= args.deadline_s:
            done = [r for r in rows if r["mode"] == "commit" and "passed" in r]
            low = max((r["sessions"] for r in done if r["passed"]), default=0)
            high = min((r["sessions"] for r in done if not r["passed"] and r["sessions"] > low), default=None)
            if high is None or high - low <= args.resolution:
                break
            row = await run_level(args, server.url, server.pid, "commit", (low + high) // 2)
            rows.append(row)
            print(brief(row), flush=True)
    passed = [r["sessions"] for r in rows if r["mode"] == "commit" and r.get("passed")]
    summary["levels"] = rows
    summary["capacity_passed_max"] = max(passed, default=None)
    summary["wall_s"] = round(time.monotonic() - started, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


def brief(row: dict[str, Any]) -> str:
    if "ttfa_ms" not in row:
        return f"{row['mode']} {row['sessions']}: {row.get('failed') or row.get('skipped')}"
    t, r = row["ttfa_ms"], row["rtf"]
    turn = row["turn_steps_ms"].get("turn_to_audio") or {}
    return (
        f"{row['mode']} {row['sessions']}: pass={row['passed']} turns={row['utterances']} ttfa p50={t.get('p50')} "
        f"p99={t.get('p99')} turn_to_audio p50={turn.get('p50')} p99={turn.get('p99')} rtf p50={r.get('p50')} "
        f"p99={r.get('p99')} underruns={row['underruns']} errors={row['errors']} reasons={row['reasons']}"
    )


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
