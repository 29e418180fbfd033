"""HTTP TTS throughput and server CPU per audio chunk, for one uvicorn HTTP parser (httptools or h11).

The server (synthetic engine, no generation cost, so the HTTP path itself is what is measured) runs in its own
process; its CPU time comes from /proc, its chunk count from its own chunk-gap histogram. Two loads:

- ``short``: many short requests (one sentence each) from concurrent clients: requests/s;
- ``long``: a few long streamed responses: CPU per body chunk sent (the chunked-transfer hot path).

Run from the repository root, once per parser, and compare:

    .venv/bin/python -m benchmarks.http_tts --http httptools --out docs/benchmarks/http_tts_httptools.json
    .venv/bin/python -m benchmarks.http_tts --http h11 --out docs/benchmarks/http_tts_h11.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from omnigate.loadtest.server_process import free_port

SHORT_TEXT = "The quick brown fox jumps over the lazy dog."
LONG_TEXT = "A long answer streams in many small chunks over one response. " * 12
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
GAP_COUNT = re.compile(r'^omnigate_chunk_gap_seconds_count\{transport="http"\} (\S+)$', re.M)


def _serve(args: argparse.Namespace) -> None:
    """The child: the gateway configured as ``omnigate serve`` configures it, with the given HTTP parser."""
    import uvicorn

    from omnigate.gateway.app import create_app
    from omnigate.gateway.server_config import uvicorn_config
    from omnigate.gateway.settings import Settings
    from omnigate.gateway.sockets import bind_listener

    settings = Settings(engine="synthetic", model="ms_per_char=60", port=args.port)
    sock = bind_listener("127.0.0.1", args.port, settings.socket_send_buffer_bytes)
    config = uvicorn_config(create_app(settings), settings, http=args.http, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


async def _chunks_sent(client: httpx.AsyncClient) -> float:
    match = GAP_COUNT.search((await client.get("/metrics")).text)
    return float(match.group(1)) if match else 0.0


async def _request(client: httpx.AsyncClient, text: str, fmt: str) -> int:
    body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": fmt}
    size = 0
    async with client.stream("POST", "/v1/audio/speech", json=body) as response:
        response.raise_for_status()
        async for data in response.aiter_raw():
            size += len(data)
    return size


async def _load(
    client: httpx.AsyncClient, pid: int, text: str, fmt: str, clients: int, requests: int
) -> dict[str, Any]:
    queue = iter(range(requests))

    async def worker() -> None:
        for _ in queue:
            await _request(client, text, fmt)

    chunks0, cpu0, start = await _chunks_sent(client), _cpu_s(pid), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed, cpu1 = time.perf_counter() - start, _cpu_s(pid)
    # Each response's chunks are its gaps plus one.
    chunks = await _chunks_sent(client) - chunks0 + requests
    cpu = cpu1 - cpu0
    return {
        "format": fmt,
        "clients": clients,
        "requests": requests,
        "seconds": round(elapsed, 2),
        "requests_per_s": round(requests / elapsed, 1),
        "chunks": int(chunks),
        "server_cpu_s": round(cpu, 2),
        "server_cpu_us_per_chunk": round(cpu / chunks * 1e6, 1),
        "server_cpu_ms_per_request": round(cpu / requests * 1e3, 2),
    }


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.http_tts", "--serve", "--http", args.http, "--port", str(port)
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60.0, trust_env=False) as client:
            async with asyncio.timeout(60):
                while True:
                    try:
                        if (await client.get("/ready")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.1)
            await _load(client, child.pid, SHORT_TEXT, "pcm", 4, 20)  # warm-up
            loads = [
                await _load(client, child.pid, SHORT_TEXT, "pcm", args.clients, args.requests),
                await _load(client, child.pid, SHORT_TEXT, "mp3", args.clients, args.requests),
                await _load(client, child.pid, LONG_TEXT, "pcm", 4, args.long_requests),
            ]
    finally:
        child.terminate()
        await child.wait()
    return {
        "http": args.http,
        "engine": "synthetic ms_per_char=60 (no generation cost)",
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "loads": loads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--http", choices=("httptools", "h11"), default="httptools")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--long-requests", type=int, default=16)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args)
        return
    report = asyncio.run(_measure(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
