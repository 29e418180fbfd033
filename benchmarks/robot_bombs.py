"""``/health`` latency while robots send msgpack bombs in a closed loop, against a server in its own process.

Each bomber connects to ``WS /v1/realtime/robot/openpi``, sends a bomb of the corpus
(:mod:`omnigate.loadtest.msgpack_bombs`; by default 1.9 MB holding 1.8 M empty maps), waits for its answer and sends
it again. ``/health`` is polled every 20 ms first with no bomber, then with them: a bomb decoded on the event loop
shows as ``/health`` waiting for it. The bombers run in a process of their own, so their own work (masking 2 MB
frames) does not delay the poller. Run from the repository root:

    .venv/bin/python benchmarks/robot_bombs.py --bombers 3 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import connect

from omnigate.loadtest.msgpack_bombs import corpus
from omnigate.loadtest.server_process import server_process
from omnigate.loadtest.targets.robot import ROBOT_PATH

POLL_EVERY_S = 0.02


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": ordered[-1]}


async def poll_health(url: str, seconds: float) -> list[float]:
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            started = time.perf_counter()
            (await client.get(url + "/health")).raise_for_status()
            latencies.append((time.perf_counter() - started) * 1000.0)
            await asyncio.sleep(POLL_EVERY_S)
    return latencies


async def bomber(ws_url: str, payload: bytes, seconds: float, answers: Counter[str]) -> None:
    # Connected as openpi-client connects (compression=None, max_size=None): what real robots offer.
    async with connect(ws_url, max_size=None, compression=None) as ws:
        await ws.recv()  # the metadata
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            await ws.send(payload)
            answer = await ws.recv()
            answers[json.loads(answer)["code"] if isinstance(answer, str) else "actions"] += 1


def bombers(ws_url: str, payload: bytes, count: int, seconds: float, out: Any) -> None:
    """The bombers' process: ``count`` bombers for ``seconds``; their answers go to ``out`` (a queue)."""
    answers: Counter[str] = Counter()

    async def run() -> None:
        await asyncio.gather(*(bomber(ws_url, payload, seconds, answers) for _ in range(count)))

    asyncio.run(run())
    out.put(dict(answers))


async def main(args: argparse.Namespace) -> dict[str, Any]:
    payload = next(bomb.payload for bomb in corpus() if bomb.name == args.bomb)
    serve_args = ["--engine", "synthetic", "--robot-model", "preset:tiny", "--robot-option", "threads=1"]
    with tempfile.TemporaryDirectory() as tmp:
        async with server_process([*serve_args, "--log-level", "warning"], Path(tmp) / "server.log") as server:
            idle = await poll_health(server.url, args.seconds)
            ws_url = server.url.replace("http://", "ws://") + ROBOT_PATH
            out: Any = multiprocessing.Queue()
            process = multiprocessing.Process(target=bombers, args=(ws_url, payload, args.bombers, args.seconds, out))
            process.start()
            loaded = await poll_health(server.url, args.seconds)
            answers = await asyncio.to_thread(out.get)
            await asyncio.to_thread(process.join)
    return {
        "bomb": args.bomb,
        "bomb_bytes": len(payload),
        "bombers": args.bombers,
        "health_idle": percentiles(idle),
        "health_under_bombs": percentiles(loaded),
        "answers": answers,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bombers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--bomb", default="empty_maps", choices=[bomb.name for bomb in corpus()])
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
