"""Where a realtime session's CPU goes in ``omnigate serve``, thread by thread.

Starts ``omnigate serve`` with the given engine arguments (default: the duplex ``tiny`` preset) in its own process,
opens N realtime sessions whose clients append 40 ms of microphone audio every 40 ms and read every event, and
reads the CPU time of each of the server's threads (``/proc/PID/task/*/stat``, grouped by the OS thread name the
server gives them) over the middle of the run. Optionally ``py-spy`` dumps the server's Python stacks meanwhile.

Run from the repository root (the report records the load average; this CPU is shared):

    .venv/bin/python benchmarks/realtime_threads_cpu.py --sessions 4 --out docs/benchmarks/realtime_threads_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import connect

APPEND_MS = 40
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread's name and CPU seconds so far."""
    threads: dict[int, tuple[str, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as comm, open(f"/proc/{pid}/task/{tid}/stat") as stat:
                name = comm.read().strip()
                fields = stat.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        threads[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / TICKS_PER_S)
    return threads


async def session(url: str, duration_s: float, counts: collections.Counter[str]) -> None:
    chunk = json.dumps(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x20\x00" * (24 * APPEND_MS)).decode()}
    )
    async with connect(url, max_size=None) as ws:
        loop = asyncio.get_running_loop()

        async def read() -> None:
            async for message in ws:
                counts[json.loads(message)["type"]] += 1

        reader = asyncio.create_task(read())
        start = loop.time()
        for k in range(int(duration_s * 1000 / APPEND_MS)):
            await asyncio.sleep(max(0.0, start + k * APPEND_MS / 1000 - loop.time()))  # the microphone's clock
            await ws.send(chunk)
        reader.cancel()


async def measure(port: int, pid: int, sessions: int, duration_s: float, py_spy: Path | None) -> dict[str, Any]:
    url = f"ws://127.0.0.1:{port}/v1/realtime"
    counts: collections.Counter[str] = collections.Counter()
    run = asyncio.gather(*(session(url, duration_s, counts) for _ in range(sessions)))
    await asyncio.sleep(duration_s / 4)  # past the sessions' start
    window_s = duration_s / 2
    before, wall = thread_cpu(pid), time.monotonic()
    dump = None
    if py_spy is not None:
        dump = await asyncio.to_thread(
            subprocess.run, [str(py_spy), "dump", "--pid", str(pid)], capture_output=True, text=True, check=False
        )
    await asyncio.sleep(max(0.0, window_s - (time.monotonic() - wall)))
    after, wall = thread_cpu(pid), time.monotonic() - wall
    await run
    by_name: collections.Counter[str] = collections.Counter()
    for tid, (name, cpu) in after.items():
        by_name[name] += cpu - before.get(tid, (name, 0.0))[1]
    total = sum(by_name.values())
    return {
        "sessions": sessions,
        "window_s": round(wall, 2),
        "server_cores": round(total / wall, 3),
        "cores_per_session": round(total / wall / sessions, 3),
        "cores_by_thread_name": {name: round(cpu / wall, 3) for name, cpu in by_name.most_common()},
        "threads": len(after),
        "events_received": dict(counts),
        "py_spy_dump": dump.stdout if dump is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--py-spy", type=Path, help="path of a py-spy binary: dump the server's stacks mid-run")
    parser.add_argument("serve_args", nargs="*", default=["--engine", "duplex", "--model", "preset:tiny"])
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "omnigate.gateway.cli", "serve", *args.serve_args, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not become ready")
            time.sleep(0.2)
        load_start = os.getloadavg()
        result = asyncio.run(measure(port, server.pid, args.sessions, args.duration, args.py_spy))
    finally:
        server.terminate()
        server.wait(30)
    report = {"serve_args": args.serve_args, "cores": os.cpu_count(), "load_average_start": load_start, **result}
    report["load_average_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "py_spy_dump"}, indent=2))


if __name__ == "__main__":
    main()
