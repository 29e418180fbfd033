"""The duplex engine's clock: lockstep frames per session, silence when no audio came, credit, caps, isolation."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest

from omnigate.engines.base import EngineError, SynthesisParams
from omnigate.engines.duplex.engine import DuplexEngine
from omnigate.engines.duplex.session import DuplexFrame, DuplexFull
from tests.unit.duplex_engines import tiny_duplex_engine

FRAME_BYTES = 2 * 1920


@pytest.fixture(scope="module")
def engine() -> Iterator[DuplexEngine]:
    with tiny_duplex_engine() as duplex:
        yield duplex


class Frames:
    """A session's frames as the event loop receives them."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[DuplexFrame] = asyncio.Queue(maxsize=1000)

    def __call__(self, frame: DuplexFrame) -> None:
        self.queue.put_nowait(frame)

    async def take(self, count: int) -> list[DuplexFrame]:
        async with asyncio.timeout(30):
            return [await self.queue.get() for _ in range(count)]


async def test_every_tick_yields_a_frame_and_silence_keeps_the_clock(engine: DuplexEngine) -> None:
    frames = Frames()
    # No credit until the audio is queued: the tick thread would otherwise take tick 0 before it arrives.
    session = engine.open_session(frames, max_input_bytes=10 * FRAME_BYTES, initial_credit_frames=0)
    try:
        assert engine.push_audio(session, b"\x10\x00" * 1920 * 2)  # two frames of audio, then nothing
        engine.grant(session, 100)
        got = await frames.take(5)
    finally:
        engine.close_session(session)
    assert [f.tick for f in got] == [0, 1, 2, 3, 4]
    assert [f.input_ms for f in got] == [80.0, 80.0, 0.0, 0.0, 0.0]
    assert all(len(f.pcm) == FRAME_BYTES and f.sample_rate == 24000 for f in got)
    assert engine.pending_input_bytes(session) == 0


@pytest.mark.parametrize("masked_rows", [False, True], ids=["exact-rows", "bucket-rows"])
async def test_a_session_without_credit_sits_out(engine: DuplexEngine, masked_rows: bool) -> None:
    # bucket-rows: ticks planned as with CUDA graphs (slots 0..B-1, a session without credit as a masked row).
    engine.frames.masked_rows = masked_rows
    before = dataclasses.replace(engine.stats)
    frames, other = Frames(), Frames()
    paused = engine.open_session(frames, max_input_bytes=FRAME_BYTES, initial_credit_frames=2)
    running = engine.open_session(other, max_input_bytes=FRAME_BYTES, initial_credit_frames=100)
    try:
        assert engine.stats.sessions == 2
        await frames.take(2)
        await other.take(6)  # the other session keeps ticking meanwhile
        assert frames.queue.empty()
        engine.grant(paused, 1)
        (frame,) = await frames.take(1)
        assert frame.tick == 2
    finally:
        engine.close_session(paused)
        engine.close_session(running)
        engine.frames.masked_rows = False
    after = engine.stats
    assert after.sessions == 0
    assert after.sat_out - before.sat_out >= 3  # the paused session sat out at least 3 of the other's ticks
    ticks = after.ticks - before.ticks
    assert after.eager_ticks - before.eager_ticks == ticks and after.graph_ticks == after.graph_captures == 0
    assert after.frames - before.frames >= 9
    masked = (after.rows - before.rows) - (after.frames - before.frames)
    if masked_rows:
        assert masked >= 3  # the paused session's row was computed, masked, on the ticks it sat out
    else:
        assert masked == 0
    assert sum(after.step_counts) == after.ticks and after.step_seconds_total > 0


async def test_caps_refusals_and_the_text_contract(engine: DuplexEngine) -> None:
    sessions = [engine.open_session(Frames(), max_input_bytes=FRAME_BYTES, initial_credit_frames=0) for _ in range(2)]
    with pytest.raises(DuplexFull) as full:
        engine.open_session(Frames(), max_input_bytes=FRAME_BYTES, initial_credit_frames=0)
    assert full.value.retry_after_s == 3.0 and full.value.max_sessions == 2
    assert not engine.push_audio(sessions[0], bytes(FRAME_BYTES + 2))  # over the input cap: refused whole
    assert engine.pending_input_bytes(sessions[0]) == 0
    assert engine.push_audio(sessions[0], bytes(FRAME_BYTES))
    assert engine.clear_input(sessions[0]) == FRAME_BYTES
    engine.close_session(sessions[0])
    engine.close_session(sessions[0])  # idempotent
    replacement = engine.open_session(Frames(), max_input_bytes=FRAME_BYTES, initial_credit_frames=0)
    assert replacement.slot == sessions[0].slot  # the freed slot is reused (and reset before its first step)
    for session in (replacement, sessions[1]):
        engine.close_session(session)
    assert engine.active_sessions == 0
    with pytest.raises(EngineError) as refused:
        engine.open(SynthesisParams(voice="moshi"))
    assert refused.value.code == "unsupported"
    assert engine.info.capabilities.duplex and engine.info.synthetic


async def test_a_new_session_in_a_reused_slot_starts_fresh(engine: DuplexEngine) -> None:
    async def run(seed: int) -> list[int]:
        frames = Frames()
        session = engine.open_session(frames, max_input_bytes=FRAME_BYTES, initial_credit_frames=4, seed=seed)
        try:
            return [f.text_token for f in await frames.take(4)]
        finally:
            engine.close_session(session)

    first = await run(11)
    await run(12)  # another session in between, in the same slot
    assert await run(11) == first


def test_codec_graphs_can_be_turned_off_from_the_command_line() -> None:
    duplex = DuplexEngine.load("preset:tiny", max_sessions=1, codec_graphs="false")
    try:
        assert duplex.frames.codec_graphs is False and duplex.options.codec_graphs is False
    finally:
        duplex.shutdown()
    with pytest.raises(ValueError, match="invalid duplex option"):
        DuplexEngine.load("preset:tiny", codec_graphs="sometimes")
