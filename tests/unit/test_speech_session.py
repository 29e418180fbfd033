"""The speech session state machine, driven by plain calls: no loop, no engine, no transport."""

from __future__ import annotations

import pytest

from omnigate.engines.base import (
    AudioChunk,
    EngineCapabilities,
    EngineInfo,
    SegmentDone,
    SegmentStarted,
    StreamDone,
    VoiceInfo,
)
from omnigate.sessions.messages import (
    AppendText,
    Cancel,
    Close,
    Configure,
    ErrorEvent,
    Flush,
    MediaChunk,
    SessionClosed,
    SessionConfig,
    UtteranceDone,
)
from omnigate.sessions.messages import SegmentDone as SessionSegmentDone
from omnigate.sessions.messages import SegmentStarted as SessionSegmentStarted
from omnigate.sessions.speech import (
    AbortStream,
    Action,
    Emit,
    EndInput,
    OpenStream,
    PurgeMedia,
    PushText,
    SessionLimits,
    SpeechSession,
)

INFO = EngineInfo(
    family="test",
    model="test-model",
    sample_rate=16000,
    voices=(VoiceInfo("a", "A"), VoiceInfo("b", "B")),
    default_voice="a",
    capabilities=EngineCapabilities(speed=True, languages=("en",)),
    max_sessions=4,
)
PCM_100MS = b"\x01\x00" * 1600


def events(actions: list[Action]) -> list[object]:
    return [a.event for a in actions if isinstance(a, Emit)]


def configured(limits: SessionLimits | None = None) -> SpeechSession:
    s = SpeechSession(INFO, limits or SessionLimits(), now_ms=0.0)
    assert s.handle(Configure(SessionConfig()), 0.0) == []
    return s


def engine_segment(index: int, text: str, chunks: int = 2) -> list[object]:
    return [SegmentStarted(index, text), *[AudioChunk(index, PCM_100MS, 16000)] * chunks, SegmentDone(index)]


def test_text_before_config_is_a_typed_error_and_the_session_survives() -> None:
    s = SpeechSession(INFO, SessionLimits(), 0.0)
    [err] = events(s.handle(AppendText("Hello."), 1.0))
    assert isinstance(err, ErrorEvent) and err.code == "no_config" and not err.fatal
    assert not s.closed
    assert s.handle(Configure(SessionConfig()), 2.0) == []


def test_unknown_voice_and_bad_speed_are_refused_and_config_is_kept() -> None:
    s = configured()
    [err] = events(s.handle(Configure(SessionConfig(voice="nobody")), 1.0))
    assert isinstance(err, ErrorEvent) and err.code == "unknown_voice"
    [err] = events(s.handle(Configure(SessionConfig(speed=9.0)), 1.0))
    assert isinstance(err, ErrorEvent) and err.code == "invalid_speed"
    assert s.params is not None and s.params.voice == "a"


def test_a_complete_sentence_opens_the_stream_before_the_flush() -> None:
    s = configured()
    actions = s.handle(AppendText("Hello there. How"), 10.0)
    assert OpenStream(0, s.params) in actions  # type: ignore[arg-type]
    assert [a for a in actions if isinstance(a, PushText)] == [PushText(0, "Hello there. ")]
    actions = s.handle(Flush(), 20.0)
    assert actions == [PushText(0, "How"), EndInput(0)]


def test_utterance_events_and_exactly_one_terminal() -> None:
    s = configured()
    s.handle(AppendText("One. Two."), 0.0)
    s.handle(Flush(), 0.0)
    out = events(s.on_engine(0, [*engine_segment(0, "One. "), *engine_segment(1, "Two.")], 5.0))
    kinds = [type(e).__name__ for e in out]
    assert kinds == [
        "SegmentStarted", "MediaChunk", "MediaChunk", "SegmentDone",
        "SegmentStarted", "MediaChunk", "MediaChunk", "SegmentDone",
    ]  # fmt: skip
    done = events(s.on_engine(0, [StreamDone()], 6.0))
    assert done == [UtteranceDone(0, 0, 2, "completed")]
    # Late outputs of a finished stream are dropped.
    assert s.on_engine(0, engine_segment(2, "late"), 7.0) == []
    seqs = [e.seq for e in out if isinstance(e, MediaChunk)]
    assert seqs == [0, 1, 2, 3]


def test_utterances_queue_in_order_and_the_next_starts_when_the_first_ends() -> None:
    s = configured()
    s.handle(AppendText("First."), 0.0)
    s.handle(Flush(), 0.0)
    actions = s.handle(AppendText("Second."), 1.0)
    assert not any(isinstance(a, OpenStream) for a in actions)
    s.handle(Flush(), 1.0)
    actions = s.on_engine(0, [*engine_segment(0, "First."), StreamDone()], 2.0)
    assert OpenStream(1, s.params) in actions  # type: ignore[arg-type]
    assert PushText(1, "Second.") in actions and EndInput(1) in actions


def test_empty_flush_completes_with_zero_sentences() -> None:
    s = configured()
    assert events(s.handle(Flush(), 0.0)) == [UtteranceDone(0, 0, 0, "completed")]


def test_text_with_nothing_to_speak_is_refused_typed_and_never_reaches_the_engine() -> None:
    s = configured()
    # The segmenter's timer releases the marks before the flush; neither release opens the engine.
    actions = s.handle(AppendText("... !!!"), 0.0) + s.poll(10_000.0) + s.handle(Flush(), 10_000.0)
    assert not any(isinstance(a, OpenStream | PushText) for a in actions)
    error, done = events(actions)
    assert isinstance(error, ErrorEvent) and error.code == "nothing_to_speak" and error.param == "text"
    assert done == UtteranceDone(0, 0, 0, "error", error.message)
    s.handle(AppendText("Words."), 10_001.0)
    assert OpenStream(1, s.params) in s.handle(Flush(), 10_001.0)  # type: ignore[arg-type]


def test_marks_alone_after_words_are_not_sent_to_the_engine() -> None:
    s = configured()
    actions = s.handle(AppendText("Hello there. "), 0.0) + s.handle(AppendText("?! "), 0.0) + s.handle(Flush(), 0.0)
    assert [a for a in actions if isinstance(a, PushText)] == [PushText(0, "Hello there. ")]


def test_cancel_fences_the_epoch_and_ends_every_pending_utterance() -> None:
    s = configured()
    s.handle(AppendText("Speaking now. "), 0.0)
    s.handle(Flush(), 0.0)
    s.handle(AppendText("Queued next."), 0.0)
    s.handle(Flush(), 0.0)
    s.on_engine(0, [SegmentStarted(0, "Speaking now. "), AudioChunk(0, PCM_100MS, 16000)], 1.0)
    actions = s.handle(Cancel(), 2.0)
    assert AbortStream(0) in actions
    assert PurgeMedia(0) in actions
    out = events(actions)
    assert out == [
        SessionSegmentDone(0, 0, 0, len(PCM_100MS), "cancelled"),
        UtteranceDone(0, 0, 1, "cancelled"),
        UtteranceDone(0, 1, 0, "cancelled"),
    ]
    assert s.epoch == 1
    # Nothing of the old epoch after its terminal event.
    assert s.on_engine(0, [AudioChunk(0, PCM_100MS, 16000)], 3.0) == []
    # The session goes on with the new epoch.
    actions = s.handle(AppendText("After cancel."), 4.0)
    s.handle(Flush(), 4.0)
    out = events(s.on_engine(2, [SegmentStarted(0, "After cancel.")], 5.0))
    assert out == [SessionSegmentStarted(1, 2, 0, "After cancel.", 16000)]


def test_config_change_is_refused_while_text_is_buffered_or_speaking() -> None:
    s = configured()
    s.handle(AppendText("no punctuation yet"), 0.0)
    [err] = events(s.handle(Configure(SessionConfig(voice="b")), 1.0))
    assert isinstance(err, ErrorEvent) and err.code == "config_while_busy"
    s.handle(Flush(), 2.0)
    [err] = events(s.handle(Configure(SessionConfig(voice="b")), 3.0))
    assert isinstance(err, ErrorEvent) and err.code == "config_while_busy"
    s.on_engine(0, [StreamDone()], 4.0)
    assert s.handle(Configure(SessionConfig(voice="b")), 5.0) == []
    assert s.params is not None and s.params.voice == "b"


def test_idle_timeout_covers_gaps_between_utterances_but_not_generation() -> None:
    s = configured(SessionLimits(idle_timeout_ms=1000.0))
    s.handle(AppendText("Hi."), 0.0)
    s.handle(Flush(), 0.0)
    assert s.poll(5000.0) == []  # the client waits on us: not idle
    s.on_engine(0, [StreamDone()], 5000.0)
    assert s.next_deadline_ms() == 6000.0
    out = events(s.poll(6000.0))
    assert isinstance(out[-2], ErrorEvent) and out[-2].code == "idle_timeout" and out[-2].fatal
    assert out[-1] == SessionClosed("idle_timeout", "idle_timeout")
    assert s.closed


def test_forced_flush_after_max_wait_reaches_the_engine() -> None:
    s = SpeechSession(INFO, SessionLimits(), 0.0)
    s.handle(Configure(SessionConfig()), 0.0)
    s.handle(AppendText("two words "), 0.0)  # fewer words than the first unit's budget
    deadline = s.next_deadline_ms()
    assert deadline is not None and deadline <= 400.0
    actions = s.poll(deadline)
    assert any(isinstance(a, OpenStream) for a in actions)
    assert any(isinstance(a, PushText) for a in actions)


def test_refused_stream_ends_the_utterance_typed_and_the_next_one_tries_again() -> None:
    s = configured()
    s.handle(AppendText("One."), 0.0)
    s.handle(Flush(), 0.0)
    s.handle(AppendText("Two."), 0.0)
    s.handle(Flush(), 0.0)
    actions = s.on_stream_refused(0, "engine_busy", "no slot")
    out = events(actions)
    assert out[0] == ErrorEvent("engine_busy", "no slot")
    assert out[1] == UtteranceDone(0, 0, 0, "error", "no slot")
    assert OpenStream(1, s.params) in actions  # type: ignore[arg-type]


def test_engine_error_is_reported_and_the_session_survives() -> None:
    s = configured()
    s.handle(AppendText("One."), 0.0)
    s.handle(Flush(), 0.0)
    out = events(s.on_engine(0, [SegmentStarted(0, "One."), StreamDone("error", "boom")], 1.0))
    assert isinstance(out[1], ErrorEvent) and out[1].code == "generation_failed"
    assert out[-1] == UtteranceDone(0, 0, 1, "error", "boom")
    assert not s.closed


def test_close_finishes_flushed_utterances_then_closes() -> None:
    s = configured()
    s.handle(AppendText("Last words."), 0.0)
    s.handle(Flush(), 0.0)
    assert events(s.handle(Close(), 1.0)) == []
    out = events(s.on_engine(0, [StreamDone()], 2.0))
    assert out == [UtteranceDone(0, 0, 0, "completed"), SessionClosed("client_closed")]


def test_close_drops_unflushed_text_that_never_reached_the_engine() -> None:
    s = configured()
    s.handle(AppendText("never flushed"), 0.0)
    out = events(s.handle(Close(), 1.0))
    assert out == [UtteranceDone(0, 0, 0, "cancelled"), SessionClosed("client_closed")]


def test_abort_all_ends_everything_once() -> None:
    s = configured()
    s.handle(AppendText("One."), 0.0)
    s.handle(Flush(), 0.0)
    actions = s.abort_all("client_disconnected")
    assert AbortStream(0) in actions
    out = events(actions)
    assert out == [UtteranceDone(0, 0, 0, "cancelled"), SessionClosed("client_disconnected", None)]
    assert s.abort_all("again") == []


@pytest.mark.parametrize("n", [1, 3])
def test_queued_utterances_are_bounded(n: int) -> None:
    s = configured(SessionLimits(max_queued_utterances=n))
    for _ in range(n):
        s.handle(AppendText("x."), 0.0)
        s.handle(Flush(), 0.0)
    [err] = events(s.handle(AppendText("one too many"), 0.0))
    assert isinstance(err, ErrorEvent) and err.code == "too_many_utterances"


def test_text_over_the_utterance_bound_is_refused_whole_and_the_utterance_goes_on() -> None:
    s = configured(SessionLimits(max_utterance_chars=20))
    actions = s.handle(AppendText("Hello there, "), 0.0)  # a clause after two words: the first unit, at once
    [err] = events(s.handle(AppendText("general Kenobi."), 1.0))
    assert isinstance(err, ErrorEvent) and err.code == "utterance_too_long" and err.param == "text"
    assert not err.fatal and not s.closed
    # Nothing of the refused text reached the utterance; what was sent is still spoken, and the next one is fresh.
    actions += s.handle(Flush(), 2.0)
    assert [a.text for a in actions if isinstance(a, PushText)] == ["Hello there, "]
    s.on_engine(0, [*engine_segment(0, "Hello there, "), StreamDone()], 3.0)
    assert not events(s.handle(AppendText("general Kenobi."), 4.0))


def test_pending_text_is_bounded_across_utterances_until_they_are_spoken() -> None:
    s = configured(SessionLimits(max_utterance_chars=10, max_pending_chars=25))
    for text in ("Ten chars.", "Ten chars."):
        assert not events(s.handle(AppendText(text), 0.0))
        s.handle(Flush(), 0.0)
    [err] = events(s.handle(AppendText("Ten chars."), 1.0))
    assert isinstance(err, ErrorEvent) and err.code == "too_much_pending_text" and not err.fatal
    assert s.pending_utterances == 2
    # Once the first utterance is spoken its text no longer counts.
    s.on_engine(0, [*engine_segment(0, "Ten chars."), StreamDone()], 2.0)
    assert not events(s.handle(AppendText("Ten chars."), 3.0))
