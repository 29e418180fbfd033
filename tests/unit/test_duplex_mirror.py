"""The gateway's mirror of duplex sessions on an engine core, sans I/O: admission, input caps, frames, loss."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from omnigate.engines.base import EngineCapabilities, EngineInfo, VoiceInfo
from omnigate.engines.core.duplex_mirror import DuplexMirror
from omnigate.engines.core.duplex_protocol import (
    ENCODER,
    DuplexEnded,
    DuplexGrant,
    DuplexInfo,
    DuplexOpen,
    DuplexTick,
    SessionFrame,
)
from omnigate.engines.core.framing import Frame, FrameDecoder, FrameError, FrameKind
from omnigate.engines.duplex.session import DuplexClosed, DuplexFrame, DuplexFull, DuplexUnavailable
from omnigate.engines.duplex.stats import ClockStats

FRAME_BYTES = 3840  # 80 ms of 24 kHz s16le
VOICE = VoiceInfo(id="moshi", name="moshi")
INFO = EngineInfo(
    family="duplex",
    model="preset:tiny",
    sample_rate=24000,
    voices=(VOICE,),
    default_voice="moshi",
    capabilities=EngineCapabilities(duplex=True),
    max_sessions=2,
)


class Core:
    """What the mirror sent, as frames, and a way to answer it. While ``answering``, each open is answered as the
    core would, at once: admitted, or refused with ``refusal``."""

    def __init__(self) -> None:
        self.decoder = FrameDecoder()
        self.sent: list[Frame] = []
        self.answering = True
        self.refusal: DuplexEnded | None = None
        self.mirror = DuplexMirror(
            DuplexInfo(info=INFO, sample_rate=24000, frame_s=0.08, retry_after_s=3.0, stats=ClockStats(ticks=7)),
            self._receive,
        )

    def _receive(self, data: bytes) -> None:
        frames = self.decoder.feed(data)
        self.sent.extend(frames)
        for frame in frames:
            if frame.kind is FrameKind.DUPLEX_OPEN and self.answering:
                if self.refusal is None:
                    self.mirror.receive(Frame(FrameKind.DUPLEX_OPENED, frame.call, b""))
                else:
                    self.mirror.receive(Frame(FrameKind.DUPLEX_ENDED, frame.call, ENCODER.encode(self.refusal)))

    def kinds(self) -> list[tuple[FrameKind, int]]:
        sent, self.sent = self.sent, []
        return [(frame.kind, frame.call) for frame in sent]

    def tick(self, *frames: tuple[int, int, float]) -> None:
        """Frames of (session, input_done, input_ms)."""
        made = [SessionFrame(s, _frame(input_ms), done) for s, done, input_ms in frames]
        self.mirror.receive(Frame(FrameKind.DUPLEX_TICK, 0, ENCODER.encode(DuplexTick(made))))


def _frame(input_ms: float) -> DuplexFrame:
    return DuplexFrame(0, bytes(FRAME_BYTES), 24000, 3, "", True, input_ms)


class Sink:
    def __init__(self) -> None:
        self.frames: list[DuplexFrame] = []
        self.ended: list[tuple[str, str]] = []

    def frame(self, frame: DuplexFrame) -> None:
        self.frames.append(frame)

    def end(self, code: str, message: str) -> None:
        self.ended.append((code, message))


async def test_the_core_admits_a_session_no_matter_what_this_gateway_holds() -> None:
    core, sink = Core(), Sink()
    core.refusal = DuplexEnded("resource_exhausted", "all 2 duplex sessions are in use", 5.0)  # another gateway's
    with pytest.raises(DuplexFull) as full:
        await core.mirror.admit(sink.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4)
    assert full.value.retry_after_s == 5.0
    assert core.kinds() == [(FrameKind.DUPLEX_OPEN, 1)] and core.mirror.active_sessions == 0
    assert core.mirror.stats.sessions == 0
    core.refusal = DuplexEnded("shutting_down", "the engine core is shutting down")
    with pytest.raises(DuplexClosed):
        await core.mirror.admit(sink.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4)
    core.refusal = None
    session = await core.mirror.admit(sink.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4)
    assert core.mirror.active_sessions == 1 and not session.closed


async def test_an_open_the_core_has_not_answered_yet() -> None:
    core, sink = Core(), Sink()
    core.answering = False
    opening = core.mirror.admit(sink.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4)
    opening.send(None)  # runs until it waits for the core's answer
    (sent,) = core.sent
    core.kinds()
    core.mirror.receive(Frame(FrameKind.DUPLEX_OPENED, sent.call, b""))
    # A frame the core made before the opener resumed: nobody could hear it, its credit goes back.
    core.tick((sent.call, 0, 0.0))
    assert sink.frames == [] and core.kinds() == [(FrameKind.DUPLEX_GRANT, sent.call)]
    with pytest.raises(StopIteration) as opened:
        opening.send(None)
    session = opened.value.value
    core.tick((session.id, 0, 0.0))
    assert len(sink.frames) == 1
    # The connection drops while an open waits: its opener is refused typed, no end handler runs.
    waiting = core.mirror.admit(sink.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4, on_end=sink.end)
    waiting.send(None)
    core.mirror.lost("the engine core closed the connection")
    with pytest.raises(DuplexUnavailable):
        waiting.send(None)
    assert sink.ended == [] and core.mirror.active_sessions == 0
    # An opener cancelled while it waits tells the core to close what it may have opened.
    core.mirror.attached(DuplexInfo(info=INFO, sample_rate=24000, frame_s=0.08, retry_after_s=3.0, stats=ClockStats()))
    core.kinds()
    cancelled = core.mirror.admit(sink.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4)
    cancelled.send(None)
    with pytest.raises(asyncio.CancelledError):
        cancelled.throw(asyncio.CancelledError())
    ((_, opened_id), close) = core.kinds()
    assert close == (FrameKind.DUPLEX_CLOSE, opened_id) and core.mirror.active_sessions == 0


async def test_admission_is_exact_and_a_close_reaches_the_core_before_the_next_open() -> None:
    core, sink = Core(), Sink()
    first = await core.mirror.admit(sink.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4, seed=9)
    second = await core.mirror.admit(sink.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4)
    with pytest.raises(DuplexFull) as full:
        await core.mirror.admit(sink.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4)
    assert full.value.retry_after_s == 3.0 and full.value.max_sessions == 2
    opened = core.sent[0]
    assert msgspec.msgpack.decode(opened.body, type=DuplexOpen) == DuplexOpen(FRAME_BYTES, 4, 9)
    assert core.kinds() == [(FrameKind.DUPLEX_OPEN, first.id), (FrameKind.DUPLEX_OPEN, second.id)]
    assert core.mirror.stats.sessions == 2 and core.mirror.stats.ticks == 7
    core.mirror.close_session(first)
    core.mirror.close_session(first)  # idempotent: one close goes out
    third = await core.mirror.admit(sink.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4)
    assert core.kinds() == [(FrameKind.DUPLEX_CLOSE, first.id), (FrameKind.DUPLEX_OPEN, third.id)]
    assert third.id not in (first.id, second.id)
    core.mirror.grant(third, 2)
    grant = core.sent[0]
    assert grant.kind is FrameKind.DUPLEX_GRANT and msgspec.msgpack.decode(grant.body, type=DuplexGrant).frames == 2
    core.mirror.shutdown()
    with pytest.raises(DuplexClosed):
        await core.mirror.admit(sink.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4)


async def test_input_is_refused_past_the_cap_until_the_core_says_it_was_consumed() -> None:
    core, sink = Core(), Sink()
    session = await core.mirror.admit(sink.frame, max_input_bytes=3 * FRAME_BYTES, initial_credit_frames=4)
    core.kinds()
    assert core.mirror.push_audio(session, bytes(2 * FRAME_BYTES))
    assert core.mirror.push_audio(session, bytes(FRAME_BYTES))
    assert not core.mirror.push_audio(session, b"\x00\x00")  # nothing more fits, nothing is sent
    assert [kind for kind, _ in core.kinds()] == [FrameKind.DUPLEX_AUDIO, FrameKind.DUPLEX_AUDIO]
    core.tick((session.id, FRAME_BYTES, 80.0))  # one frame of input consumed
    assert core.mirror.pending_input_bytes(session) == 2 * FRAME_BYTES
    assert core.mirror.push_audio(session, bytes(FRAME_BYTES))
    assert not core.mirror.push_audio(session, b"\x00\x00")
    # A clear drops everything at once; frames the core made before it (lower counts) do not bring it back.
    assert core.mirror.clear_input(session) == 3 * FRAME_BYTES
    assert core.kinds()[-1] == (FrameKind.DUPLEX_CLEAR, session.id)
    assert core.mirror.push_audio(session, bytes(3 * FRAME_BYTES))
    core.tick((session.id, 2 * FRAME_BYTES, 80.0))
    assert core.mirror.pending_input_bytes(session) == 3 * FRAME_BYTES
    assert not core.mirror.push_audio(session, b"\x00\x00")
    # The core handled the clear (4 frames sent before it are done) and consumed one more frame since.
    core.tick((session.id, 5 * FRAME_BYTES, 80.0))
    assert core.mirror.pending_input_bytes(session) == 2 * FRAME_BYTES
    assert len(sink.frames) == 3 and session.ticks == 3


async def test_frames_reach_their_sessions_and_stats_are_copied_in_place() -> None:
    core, one, two = Core(), Sink(), Sink()
    first = await core.mirror.admit(one.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4)
    second = await core.mirror.admit(two.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4)
    stats = core.mirror.stats
    core.tick((first.id, 0, 0.0), (second.id, 0, 0.0), (999, 0, 0.0))  # an unknown session's frame is dropped
    assert len(one.frames) == len(two.frames) == 1
    core.mirror.close_session(first)
    core.tick((first.id, 0, 0.0), (second.id, 0, 0.0))  # made before the close reached the core
    assert len(one.frames) == 1 and len(two.frames) == 2
    counters = ClockStats(ticks=40, frames=70, sessions=5, step_counts=[1] * 12)
    core.mirror.receive(Frame(FrameKind.DUPLEX_STATS, 0, ENCODER.encode(counters)))
    assert core.mirror.stats is stats and stats.ticks == 40 and stats.frames == 70
    assert stats.step_counts == [1] * 12
    assert stats.sessions == 1  # this gateway's sessions, not the core's count


async def test_a_lost_core_ends_every_session_typed_and_refuses_new_ones_until_it_is_back() -> None:
    core, one, two = Core(), Sink(), Sink()
    first = await core.mirror.admit(one.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4, on_end=one.end)
    await core.mirror.admit(two.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4, on_end=two.end)
    core.kinds()
    core.mirror.lost("the engine core closed the connection")
    assert (
        one.ended
        == two.ended
        == [("engine_unavailable", "the duplex engine stopped: the engine core closed the connection")]
    )
    with pytest.raises(DuplexUnavailable) as unavailable:
        await core.mirror.admit(one.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4)
    assert unavailable.value.retry_after_s == 3.0
    assert core.mirror.push_audio(first, bytes(10 * FRAME_BYTES))  # an ended session's input goes nowhere
    core.mirror.close_session(first)
    assert core.kinds() == [] and core.mirror.active_sessions == 0
    core.mirror.attached(DuplexInfo(info=INFO, sample_rate=24000, frame_s=0.08, retry_after_s=3.0, stats=ClockStats()))
    back = await core.mirror.admit(one.frame, max_input_bytes=FRAME_BYTES, initial_credit_frames=4, on_end=one.end)
    assert core.kinds() == [(FrameKind.DUPLEX_OPEN, back.id)]
    # The core ends a session itself (a refusal, or a failed step): it hears the core's code once.
    core.mirror.receive(Frame(FrameKind.DUPLEX_ENDED, back.id, ENCODER.encode(DuplexEnded("engine_error", "failed"))))
    assert one.ended[-1] == ("engine_error", "failed") and core.mirror.active_sessions == 0
    with pytest.raises(FrameError):
        core.mirror.receive(Frame(FrameKind.REPLY, 0, b""))
