"""Do slow and stalled clients cost normal clients anything? The load-test CLI measures N normal sessions alone, then
beside K clients that never read and K that read at half real time; the server runs in its own process.

Reports TTFA and underruns of the normal sessions in both runs, and the server's resident memory with and without
the slow clients (what each one costs the server, to compare with the outbox cap). Run from the repository root:

    .venv/bin/python benchmarks/slow_clients.py --engine synthetic --model rtf=0.5 --sessions 16 --slow 8
    .venv/bin/python benchmarks/slow_clients.py --engine piper --sessions 2 --slow 4 --duration 40
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection, connect

from omnigate.gateway.settings import Settings
from omnigate.loadtest.footprint import Footprint, read_footprint
from omnigate.loadtest.server_process import server_process

LOADTEST = str(Path(sys.executable).with_name("omnigate-loadtest"))
LONG_TEXT = "A slow listener should cost the other sessions nothing at all. " * 200


async def _long_utterance(url: str, host: str, port: int) -> ClientConnection:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that stops reading is felt at once
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    ws = await connect(url, sock=sock, max_queue=1)
    await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "stream_audio": True}))
    await ws.send(json.dumps({"type": "input.text", "text": LONG_TEXT}))
    await ws.send(json.dumps({"type": "input.done"}))
    return ws


async def _half_speed(ws: ClientConnection, sample_rate: int) -> None:
    async for message in ws:
        if isinstance(message, bytes):
            await asyncio.sleep(2 * len(message) / 2 / sample_rate)


async def _loadtest(url: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    command = [
        LOADTEST,
        "run",
        url,
        "--sessions",
        str(args.sessions),
        "--duration",
        str(args.duration),
        "--warmup",
        str(args.warmup),
        "--no-metrics",
        "--quiet",
        "--out",
        str(out),
    ]
    process = await asyncio.create_subprocess_exec(*command)
    await process.wait()
    level = json.loads(await asyncio.to_thread(out.read_text))["levels"][0]
    return {
        "sessions": level["sessions"],
        "utterances": level["utterances"],
        "ttfa_ms": level["ttfa_ms"],
        "gap_ms": level["gap_ms"],
        "underruns": level["underruns"],
        "errors": level["errors"],
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    serve_args = ["--engine", args.engine, "--log-level", "warning", "--stall-timeout", "3600"]
    serve_args += ["--max-utterance-audio", "900"]
    if args.model:
        serve_args += ["--model", args.model]
    with tempfile.TemporaryDirectory() as tmp:
        async with server_process(serve_args, Path(tmp) / "server.log") as server:
            metrics = server.url + "/metrics"
            stream_url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
            alone = await _loadtest(server.url, args, Path(tmp) / "alone.json")
            before: Footprint = await read_footprint(metrics)
            stalled = [await _long_utterance(stream_url, server.host, server.port) for _ in range(args.slow)]
            slow = [await _long_utterance(stream_url, server.host, server.port) for _ in range(args.slow)]
            readers = [asyncio.create_task(_half_speed(ws, args.sample_rate)) for ws in slow]
            beside = await _loadtest(server.url, args, Path(tmp) / "beside.json")
            during: Footprint = await read_footprint(metrics)
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            for ws in stalled + slow:
                ws.transport.abort()
    per_slow_client_mib = (during.rss_mib - before.rss_mib) / (2 * args.slow) if args.slow else 0.0
    return {
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "engine": args.engine,
        "model": args.model,
        "normal_sessions": args.sessions,
        "stalled_clients": args.slow,
        "half_speed_clients": args.slow,
        "duration_s": args.duration,
        "alone": alone,
        "beside_slow_clients": beside,
        "server_rss_mib": {
            "before_slow_clients": round(before.rss_mib, 1),
            "with_slow_clients": round(during.rss_mib, 1),
        },
        "server_rss_per_slow_client_mib": round(per_slow_client_mib, 2),
        "outbox_cap_per_session_mib": round(Settings().outbox_bytes / (1024 * 1024), 2),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="synthetic", choices=["synthetic", "piper"])
    parser.add_argument("--model", help="engine model spec (synthetic: e.g. rtf=0.5)")
    parser.add_argument("--sessions", type=int, default=16, help="normal sessions (closed loop)")
    parser.add_argument("--slow", type=int, default=8, help="stalled clients, and as many half-speed readers")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--sample-rate", type=int, default=24_000, help="the engine's rate (piper: 22050)")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    report = asyncio.run(main(arguments))
    text = msgspec.json.format(msgspec.json.encode(report), indent=2)
    print(text.decode())
    if arguments.out is not None:
        arguments.out.parent.mkdir(parents=True, exist_ok=True)
        arguments.out.write_bytes(text + b"\n")
