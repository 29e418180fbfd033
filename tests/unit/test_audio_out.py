"""An encoder closed by a disconnect while a worker thread is inside its encode: the close waits for the encode
(PyAV's container is not thread-safe, and a thread running an encode cannot be cancelled)."""

from __future__ import annotations

import asyncio
import gc

import av
import numpy as np
import pytest

from omnigate.gateway.speech.audio_out import AudioOut

RATE = 24_000
ROUNDS = 1000
# 40 ms of a tone, the size of a synthetic engine chunk
CHUNK = (np.sin(np.arange(960) * 2 * np.pi * 440 / RATE) * 8000).astype("<i2").tobytes()


def live_containers() -> int:
    gc.collect()
    return sum(isinstance(o, av.container.OutputContainer) for o in gc.get_objects())


async def disconnect_mid_encode(fmt: str) -> bytes:
    """Start an encode on a worker thread; close the stream, as a disconnect's ``finally`` does, once the worker
    is inside the codec; then collect what the encode returned."""
    out = await AudioOut.open(fmt, RATE, RATE)
    await out.encode(CHUNK)  # the codec is primed: the next encode emits packets
    loop = asyncio.get_running_loop()
    inside = loop.create_future()
    backend = out.encoder._backend  # the codec and container, past the encoder's own checks
    encode = backend.encode

    def encode_and_announce(pcm: bytes) -> bytes:
        loop.call_soon_threadsafe(inside.set_result, None)
        return encode(pcm)

    backend.encode = encode_and_announce  # type: ignore[method-assign]
    task = asyncio.create_task(out.encode(CHUNK * 4))
    await inside
    out.close()
    data = await task
    assert out.encoder.finished
    return data


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
async def test_a_thousand_disconnects_mid_encode_neither_crash_nor_leak(fmt: str) -> None:
    before = live_containers()
    for _ in range(ROUNDS):
        await disconnect_mid_encode(fmt)
    # Joining the worker threads (none may be stuck in a codec) also drops the last work item each one holds.
    await asyncio.get_running_loop().shutdown_default_executor()
    assert live_containers() == before


async def test_a_closed_stream_encodes_and_finishes_to_nothing() -> None:
    out = await AudioOut.open("mp3", RATE, RATE)
    out.close()
    assert await out.encode(CHUNK) == b""
    assert await out.finish() == b""
    out.close()  # twice is harmless
