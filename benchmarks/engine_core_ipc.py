"""What one audio chunk costs to cross the engine-core socket, against copying its bytes through shared memory.

Per chunk, as the engine core and a gateway worker handle it: msgspec-encode an ``Outputs`` message with one
``AudioChunk``, frame it, send it over a Unix socket to another process, decode the frame and the message there.
The shared-memory figure is the floor a ring would have: one copy of the PCM in and one out, with no encoding, no
syscall and no wake-up. Run: ``python benchmarks/engine_core_ipc.py --out docs/benchmarks/engine_core/ipc.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import time
from multiprocessing import shared_memory
from pathlib import Path

from omnigate.engines.base import AudioChunk
from omnigate.engines.core.framing import FrameDecoder, FrameKind, encode_frame
from omnigate.engines.remote.protocol import Outputs, decode_stream_message, encode


def _chunk(ms: int) -> bytes:
    return os.urandom(24 * ms * 2)  # 24 kHz s16le


def codec_us(pcm: bytes, n: int) -> float:
    """Encode + frame + decode, in one process, microseconds per chunk."""
    decoder = FrameDecoder()
    t0 = time.perf_counter()
    for _ in range(n):
        wire = encode_frame(FrameKind.STREAM, 1, encode(Outputs([AudioChunk(0, pcm, 24_000)], time.monotonic())))
        for frame in decoder.feed(wire):
            decode_stream_message(frame.body)
    return (time.perf_counter() - t0) / n * 1e6


def _receiver(sock: socket.socket, n: int) -> None:
    decoder = FrameDecoder()
    got = 0
    while got < n:
        for frame in decoder.feed(sock.recv(256 * 1024)):
            decode_stream_message(frame.body)
            got += 1
    sock.sendall(b"k")


def socket_us(pcm: bytes, n: int) -> float:
    """Through a Unix socket pair to another process, microseconds per chunk (sender's wall time, one chunk per
    write as the core sends them)."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = multiprocessing.get_context("fork").Process(target=_receiver, args=(right, n))
    child.start()
    t0 = time.perf_counter()
    for _ in range(n):
        left.sendall(encode_frame(FrameKind.STREAM, 1, encode(Outputs([AudioChunk(0, pcm, 24_000)], 0.0))))
    left.recv(1)
    elapsed = time.perf_counter() - t0
    child.join()
    left.close()
    right.close()
    return elapsed / n * 1e6


def shared_memory_us(pcm: bytes, n: int) -> float:
    """Copy the PCM into a shared-memory slot and out again, microseconds per chunk."""
    shm = shared_memory.SharedMemory(create=True, size=len(pcm))
    try:
        view = shm.buf
        t0 = time.perf_counter()
        for _ in range(n):
            view[: len(pcm)] = pcm
            bytes(view[: len(pcm)])
        elapsed = time.perf_counter() - t0
        del view
    finally:
        shm.close()
        shm.unlink()
    return elapsed / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = []
    for ms in (40, 80, 640):
        pcm = _chunk(ms)
        results.append(
            {
                "chunk_ms": ms,
                "chunk_bytes": len(pcm),
                "codec_us": round(codec_us(pcm, args.chunks), 2),
                "unix_socket_us": round(socket_us(pcm, args.chunks), 2),
                "shared_memory_copy_us": round(shared_memory_us(pcm, args.chunks), 2),
            }
        )
        print(json.dumps(results[-1]))
    report = {"load_average": os.getloadavg(), "chunks": args.chunks, "results": results}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
