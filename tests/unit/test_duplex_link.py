"""The core side of duplex sessions on the real tiny engine, without a socket: one message per tick for all of a
connection's sessions, input counts, refusals, and a dropped connection freeing its slots."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest

from omnigate.engines.core.duplex_protocol import (
    ENCODER,
    DuplexEnded,
    DuplexGrant,
    DuplexInfo,
    DuplexOpen,
    DuplexTick,
)
from omnigate.engines.core.duplex_server import DuplexLink
from omnigate.engines.core.framing import Frame, FrameDecoder, FrameError, FrameKind
from omnigate.engines.duplex.engine import DuplexEngine
from tests.unit.duplex_engines import tiny_duplex_engine

FRAME_BYTES = 2 * 1920


@pytest.fixture(scope="module")
def engine() -> Iterator[DuplexEngine]:
    with tiny_duplex_engine() as duplex:
        yield duplex


class Gateway:
    """The connection's far end: every frame the link wrote, and a wake-up per write."""

    def __init__(self, engine: DuplexEngine) -> None:
        self.decoder = FrameDecoder()
        self.frames: asyncio.Queue[Frame] = asyncio.Queue(maxsize=1000)
        self.link = DuplexLink(engine, self._write, lambda: 0)

    def _write(self, data: bytes) -> None:
        for frame in self.decoder.feed(data):
            self.frames.put_nowait(frame)

    def send(self, kind: FrameKind, call: int, body: msgspec.Struct | bytes = b"") -> None:
        encoded = body if isinstance(body, bytes) else ENCODER.encode(body)
        self.link.handle(Frame(kind, call, encoded))

    async def next(self, kind: FrameKind) -> Frame:
        """The next frame of ``kind`` (stats may come between)."""
        async with asyncio.timeout(30):
            while (frame := await self.frames.get()).kind is not kind:
                pass
        return frame


async def ticks(gateway: Gateway) -> list[tuple[int, int, float]]:
    """The next tick message: (session, input done, input ms) of each frame, by session."""
    tick = msgspec.msgpack.decode((await gateway.next(FrameKind.DUPLEX_TICK)).body, type=DuplexTick)
    assert all(len(f.frame.pcm) == FRAME_BYTES for f in tick.frames)
    return sorted((f.session, f.input_done, f.frame.input_ms) for f in tick.frames)


async def test_one_message_per_tick_carries_every_session_and_counts_their_input(engine: DuplexEngine) -> None:
    gateway = Gateway(engine)
    try:
        gateway.send(FrameKind.DUPLEX_HELLO, 0)
        info = msgspec.msgpack.decode((await gateway.next(FrameKind.DUPLEX_INFO)).body, type=DuplexInfo)
        assert info.info.max_sessions == 2 and info.frame_s == pytest.approx(0.08) and info.retry_after_s == 3
        # No credit until the audio is in: the clock would otherwise take the first tick with silence.
        gateway.send(FrameKind.DUPLEX_OPEN, 7, DuplexOpen(10 * FRAME_BYTES, 0, seed=1))
        gateway.send(FrameKind.DUPLEX_OPEN, 8, DuplexOpen(10 * FRAME_BYTES, 0, seed=2))
        gateway.send(FrameKind.DUPLEX_AUDIO, 7, bytes(2 * FRAME_BYTES))
        gateway.send(FrameKind.DUPLEX_GRANT, 7, DuplexGrant(1))
        assert await ticks(gateway) == [(7, FRAME_BYTES, 80.0)]  # made of its input: one frame of it done
        # A clear counts the bytes it dropped as done; the next frame (silence) says so.
        gateway.send(FrameKind.DUPLEX_CLEAR, 7)
        gateway.send(FrameKind.DUPLEX_GRANT, 7, DuplexGrant(1))
        assert await ticks(gateway) == [(7, 2 * FRAME_BYTES, 0.0)]
        # With credit for both, each tick is one message carrying both sessions' frames.
        gateway.send(FrameKind.DUPLEX_GRANT, 7, DuplexGrant(100))
        gateway.send(FrameKind.DUPLEX_GRANT, 8, DuplexGrant(100))
        while len(await ticks(gateway)) < 2:  # the clock may take one tick between the two grants
            pass
        for _ in range(2):
            assert [(s, done) for s, done, _ in await ticks(gateway)] == [(7, 2 * FRAME_BYTES), (8, 0)]
        # Both slots are taken: a third session is refused, typed, with the engine's retry hint.
        gateway.send(FrameKind.DUPLEX_OPEN, 9, DuplexOpen(FRAME_BYTES, 1))
        ended = msgspec.msgpack.decode((await gateway.next(FrameKind.DUPLEX_ENDED)).body, type=DuplexEnded)
        assert ended.code == "resource_exhausted" and ended.retry_after_s == 3
        gateway.send(FrameKind.DUPLEX_GRANT, 9, DuplexGrant(1))  # a refused session's messages are ignored
        gateway.send(FrameKind.DUPLEX_CLOSE, 8)
        assert engine.active_sessions == 1
        with pytest.raises(FrameError):
            gateway.send(FrameKind.DUPLEX_OPEN, 7, DuplexOpen(FRAME_BYTES, 1))  # already open
        with pytest.raises(FrameError):
            gateway.send(FrameKind.DUPLEX_GRANT, 7, b"\xc1")  # not msgpack
        with pytest.raises(FrameError):
            gateway.send(FrameKind.DUPLEX_INFO, 7)  # the core's own kind
    finally:
        gateway.link.close()
    # The connection is gone: its sessions are closed and their slots free.
    assert engine.active_sessions == 0
