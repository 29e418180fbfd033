from __future__ import annotations

import pytest

from omnigate.sessions.messages import ErrorEvent, MediaChunk, UtteranceDone
from omnigate.sessions.outbox import Outbox, OutboxOverflow


def chunk(epoch: int, ms: int, seq: int = 0) -> MediaChunk:
    return MediaChunk(epoch, 0, 0, seq, b"\x00\x00" * (16 * ms), 16000)


def test_bounded_in_media_time_and_accounts_on_pop() -> None:
    box = Outbox(max_media_ms=200, max_bytes=1 << 20)
    box.push(chunk(0, 100))
    box.push(chunk(0, 100))
    assert box.media_ms == pytest.approx(200)
    with pytest.raises(OutboxOverflow):
        box.push(chunk(0, 150))
    assert box.pop() is not None
    assert box.media_ms == pytest.approx(100)
    assert box.free_media_ms == pytest.approx(100)


def test_bounded_in_bytes() -> None:
    box = Outbox(max_media_ms=10_000, max_bytes=4000)
    box.push(chunk(0, 100))  # 3200 bytes
    with pytest.raises(OutboxOverflow):
        box.push(chunk(0, 100))


def test_control_events_use_the_reserve_when_media_fills_the_count() -> None:
    box = Outbox(max_media_ms=10_000, max_bytes=1 << 20, max_events=4, reserve=2)
    box.push(chunk(0, 10))
    box.push(chunk(0, 10))
    with pytest.raises(OutboxOverflow):
        box.push(chunk(0, 10))
    box.push(UtteranceDone(0, 0, 1))
    box.push(ErrorEvent("x", "y"))
    with pytest.raises(OutboxOverflow):
        box.push(ErrorEvent("x", "y"))


def test_purge_drops_old_epoch_media_and_keeps_control_events_in_order() -> None:
    box = Outbox(max_media_ms=1000, max_bytes=1 << 20)
    box.push(chunk(0, 100, 0))
    box.push(UtteranceDone(0, 0, 1, "cancelled"))
    box.push(chunk(1, 100, 1))
    assert box.purge_media(0) == pytest.approx(100)
    assert box.media_ms == pytest.approx(100)
    first = box.pop()
    assert isinstance(first, UtteranceDone)
    second = box.pop()
    assert isinstance(second, MediaChunk) and second.epoch == 1
    assert box.pop() is None
