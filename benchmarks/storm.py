"""Abort and disconnect storms against a server in its own process, in rounds, with the footprint after each.

A leak grows with every round; allocator and cache warm-up does not. The report holds the footprint after the
warm-up and after each round, the sessions run and anything unexpected. Run from the repository root:

    .venv/bin/python benchmarks/storm.py --engine synthetic --sessions 5000 --rounds 5
    .venv/bin/python benchmarks/storm.py --engine piper --sessions 1000 --rounds 5 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from omnigate.loadtest.footprint import Footprint, settled_footprint
from omnigate.loadtest.server_process import server_process
from omnigate.loadtest.storm import run_storm


def slope_per_round(values: list[float]) -> float:
    """Least-squares slope of ``values`` against their index."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


async def main(args: argparse.Namespace) -> dict[str, Any]:
    serve_args = ["--engine", args.engine, "--log-level", "warning"]
    if args.model:
        serve_args += ["--model", args.model]
    per_round = args.sessions // args.rounds
    rounds: list[dict[str, Any]] = []
    unexpected: dict[str, int] = {}
    late_cancels = 0
    with tempfile.TemporaryDirectory() as tmp:
        async with server_process(serve_args, Path(tmp) / "server.log") as server:
            metrics = server.url + "/metrics"
            start = await settled_footprint(metrics)
            await run_storm(server.url, max(1, per_round // 2), concurrency=args.concurrency, seed=0)
            warm = await settled_footprint(metrics, limit_s=120.0)
            print(f"warm-up: {warm.describe()}", flush=True)
            for index in range(args.rounds):
                result = await run_storm(server.url, per_round, concurrency=args.concurrency, seed=index + 1)
                after = await settled_footprint(metrics, limit_s=120.0)
                late_cancels += result.late_cancels
                for key, n in result.unexpected.items():
                    unexpected[key] = unexpected.get(key, 0) + n
                rounds.append({"sessions": result.sessions, "by_pattern": result.by_pattern, "after": after})
                print(
                    f"round {index + 1}: {result.sessions} sessions, unexpected {result.unexpected}; "
                    f"{after.describe()}",
                    flush=True,
                )
    footprints: list[Footprint] = [warm] + [r["after"] for r in rounds]
    last = footprints[-1]
    return {
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
        "engine": args.engine,
        "model": args.model,
        "sessions": per_round * args.rounds,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "unexpected": unexpected,
        "late_cancels": late_cancels,
        "start": start,
        "after_warm_up": warm,
        "per_round": rounds,
        "leaked": {
            "sessions": last.sessions,
            "engine_streams": last.engine_streams,
            "tasks": last.tasks - warm.tasks,
            "open_fds": last.open_fds - warm.open_fds,
        },
        "rss_mib": {
            "after_warm_up": round(warm.rss_mib, 1),
            "after_last_round": round(last.rss_mib, 1),
            "slope_per_round": round(slope_per_round([f.rss_mib for f in footprints[1:]]), 2),
        },
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="synthetic", choices=["synthetic", "piper"])
    parser.add_argument("--model", help="engine model spec (synthetic: e.g. rtf=0.5)")
    parser.add_argument("--sessions", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    report = asyncio.run(main(arguments))
    text = msgspec.json.format(msgspec.json.encode(report), indent=2)
    print(text.decode())
    if arguments.out is not None:
        arguments.out.parent.mkdir(parents=True, exist_ok=True)
        arguments.out.write_bytes(text + b"\n")
