"""The video-chat session core with plain calls: frames, audio, queries, cancellation, budgets, terminals."""

from __future__ import annotations

import numpy as np

from omnigate.engines.omni.request import FrameInput, TextDelta, ThinkDone
from omnigate.sessions.messages import MediaChunk, UtteranceDone
from omnigate.sessions.video_chat import (
    Action,
    CancelSpeech,
    CancelThink,
    ChatError,
    CloseSession,
    DecodedFrame,
    Emit,
    FinishSpeech,
    ResponseAudioDelta,
    ResponseAudioDone,
    ResponseStart,
    ResponseTextDelta,
    ResponseTextDone,
    SessionDone,
    SpeakText,
    StartThink,
    VideoChatConfig,
    VideoChatLimits,
    VideoChatSession,
    frame_similarity,
    sample_evenly,
)


class CharPrompt:
    """One token per character; turns written as ``role: text``."""

    def count(self, text: str) -> int:
        return len(text)

    def chat_prefix(self, system: str) -> str:
        return f"[{system}]"

    def turn(self, role: str, text: str) -> str:
        return f"{role}:{text};"


def frame(value: int) -> DecodedFrame:
    pixels = np.full((4, 4, 3), value, dtype=np.uint8)
    return DecodedFrame(FrameInput(bytes([value]), pixels), bytes([value]) * 16)


def events(actions: list[Action]) -> list[object]:
    return [a.event for a in actions if isinstance(a, Emit)]


def session(**config: object) -> VideoChatSession:
    s = VideoChatSession(CharPrompt(), VideoChatLimits(max_audio_bytes=8, max_decoding_frames=2))
    assert s.configure(VideoChatConfig(**config)) == []  # type: ignore[arg-type]
    return s


def add_frames(s: VideoChatSession, *values: int) -> None:
    for v in values:
        admitted, actions = s.frame_arrived()
        assert admitted and not actions
        s.on_frame(frame(v))


def start(s: VideoChatSession, text: str = "what?", audio: bytes | None = None) -> StartThink:
    actions = s.query(text, audio)
    starts = [a for a in actions if isinstance(a, StartThink)]
    assert len(starts) == 1
    return starts[0]


def test_sampling_spreads_over_the_ring_and_keeps_the_newest() -> None:
    assert sample_evenly(3, 4) == [0, 1, 2]
    assert sample_evenly(10, 4) == [0, 3, 6, 9]
    assert sample_evenly(10, 1) == [9]


def test_query_samples_num_frames_from_a_ring_of_max_frames() -> None:
    s = session(num_frames=2, max_frames=3, enable_frame_filter=False)
    add_frames(s, 10, 20, 30, 40, 50)
    think = start(s)
    assert [f.digest for f in think.frames] == [bytes([30]), bytes([50])]


def test_the_filter_skips_frames_like_the_last_one_kept() -> None:
    s = session(enable_frame_filter=True, frame_filter_threshold=0.95)
    add_frames(s, 100, 101, 102, 200)
    assert [f.frame.digest for f in s.ring] == [bytes([100]), bytes([200])]
    assert s.frames_filtered == 2
    assert frame_similarity(b"\x00\x00", b"\xff\xff") == 0.0


def test_frames_beyond_the_decoding_bound_are_refused_typed() -> None:
    s = session()
    assert s.frame_arrived()[0] and s.frame_arrived()[0]
    admitted, actions = s.frame_arrived()
    assert not admitted
    [error] = events(actions)
    assert isinstance(error, ChatError) and error.code == "input_backpressure"


def test_a_query_waits_for_the_frames_sent_before_it() -> None:
    s = session(enable_frame_filter=False)
    assert s.frame_arrived()[0]
    assert s.query("now?") == []
    actions = s.on_frame(frame(7))
    [think] = [a for a in actions if isinstance(a, StartThink)]
    assert [f.digest for f in think.frames] == [bytes([7])]


def test_a_query_waiting_for_frames_and_replaced_gets_its_terminals() -> None:
    s = session(enable_frame_filter=False)
    assert s.frame_arrived()[0]
    assert s.query("first?") == []
    replaced = events(s.query("second?"))
    assert replaced == [ResponseStart(0, 0), ResponseTextDone(0, "", "cancelled"), ResponseAudioDone(0, "cancelled")]
    [think] = [a for a in s.on_frame(frame(7)) if isinstance(a, StartThink)]
    assert think.query == 1 and think.question == "second?"


def test_a_query_waiting_for_frames_gets_its_terminals_when_the_session_fails() -> None:
    s = session(modalities=("text",))
    assert s.frame_arrived()[0]
    assert s.query("first?") == []
    failed = events(s.fail("internal_error", "the frame decoder stopped"))
    assert failed[:2] == [ResponseStart(0, 0), ResponseTextDone(0, "", "cancelled")]
    assert isinstance(failed[2], ChatError) and failed[2].fatal


def test_the_servers_bound_on_frames_decoding_refuses_typed() -> None:
    s = session()
    admitted, actions = s.frame_arrived(server_full=True)
    assert not admitted and s.decoding == 0
    [error] = events(actions)
    assert isinstance(error, ChatError) and error.code == "input_backpressure" and error.param == "video.frame"


def test_audio_beyond_the_buffer_is_refused_and_the_buffer_kept() -> None:
    s = session()
    assert s.on_audio(b"\x01\x00" * 3) == []
    [error] = events(s.on_audio(b"\x02\x00" * 2))
    assert isinstance(error, ChatError) and error.code == "input_backpressure"
    assert bytes(s.audio) == b"\x01\x00" * 3
    think = start(s, "")
    assert think.audio == b"\x01\x00" * 3  # use_audio_in_video: the microphone audio is the question's
    assert not s.audio


def test_text_and_speech_of_one_query_end_with_one_audio_terminal() -> None:
    s = session()
    think = start(s)
    actions = s.on_think(think.query, [TextDelta("Hello. "), TextDelta("World")])
    assert [type(e) for e in events(actions)] == [ResponseTextDelta, ResponseTextDelta]
    assert [a.text for a in actions if isinstance(a, SpeakText)] == ["Hello. ", "World"]
    actions = s.on_think(think.query, [ThinkDone("completed", "Hello. World", 3)])
    [done] = events(actions)
    assert isinstance(done, ResponseTextDone) and done.status == "completed"
    assert any(isinstance(a, FinishSpeech) for a in actions)
    [delta] = events(s.on_speech(MediaChunk(0, 0, 0, 0, b"\x00\x00", 24000)))
    assert isinstance(delta, ResponseAudioDelta) and delta.query == think.query
    [terminal] = events(s.on_speech(UtteranceDone(0, 0, 1, "completed")))
    assert terminal == ResponseAudioDone(think.query, "completed")
    assert not s.answering


def test_a_new_query_cancels_the_one_in_flight_behind_the_fence() -> None:
    s = session()
    first = start(s)
    s.on_think(first.query, [TextDelta("Partial")])
    actions = s.query("another?")
    kinds = [type(a) for a in actions]
    assert CancelThink in kinds and CancelSpeech in kinds
    emitted = events(actions)
    assert emitted[0] == ResponseTextDone(first.query, "Partial", "cancelled")
    assert isinstance(emitted[1], ResponseStart)
    second = next(a for a in actions if isinstance(a, StartThink))
    # Late output of the cancelled query is dropped; its speech stream's terminal maps to it, once.
    assert s.on_think(first.query, [TextDelta("late"), ThinkDone("cancelled", "", 1)]) == []
    assert events(s.on_speech(UtteranceDone(0, 0, 0, "cancelled"))) == [ResponseAudioDone(first.query, "cancelled")]
    assert s.on_speech(UtteranceDone(0, 0, 0, "cancelled")) == []
    s.on_think(second.query, [TextDelta("B")])
    [delta] = events(s.on_speech(MediaChunk(1, 1, 0, 0, b"\x00\x00", 24000)))
    assert isinstance(delta, ResponseAudioDelta) and delta.query == second.query


def test_a_query_cancelled_before_any_text_gets_its_audio_terminal_at_once() -> None:
    s = session()
    first = start(s)
    emitted = events(s.query("again"))
    assert emitted[:2] == [
        ResponseTextDone(first.query, "", "cancelled"),
        ResponseAudioDone(first.query, "cancelled"),
    ]


def test_text_only_queries_end_with_the_text_terminal() -> None:
    s = session(modalities=("text",))
    think = start(s)
    actions = s.on_think(think.query, [TextDelta("hi"), ThinkDone("max_tokens", "hi", 1)])
    assert not any(isinstance(a, (SpeakText, FinishSpeech)) for a in actions)
    assert events(actions)[-1] == ResponseTextDone(think.query, "hi", "max_tokens")


def test_history_keeps_the_newest_whole_turns_within_the_budget() -> None:
    s = session(history_budget_tokens=60, modalities=("text",))
    for i in range(5):
        think = start(s, f"q{i}")
        s.on_think(think.query, [TextDelta("x"), ThinkDone("completed", "x", 1)])
    assert s.history[-2:] == [("user", "q4"), ("assistant", "x")]
    assert sum(len(CharPrompt().turn(r, t)) for r, t in s.history) <= 60
    think = start(s, "last")
    s.on_think(think.query, [TextDelta("answer-" * 3), ThinkDone("completed", "", 3)])
    total = sum(len(CharPrompt().turn(r, t)) for r, t in s.history)
    assert total <= 60
    assert s.history == [("user", "last"), ("assistant", "answer-answer-answer-")]  # 42 characters
    next_think = start(s, "next")
    assert next_think.context.startswith("[") and "answer-answer-answer-" in next_think.context


def test_video_done_waits_for_the_answer_then_ends_the_session() -> None:
    s = session(modalities=("text",))
    think = start(s)
    assert s.done() == []
    actions = s.on_think(think.query, [ThinkDone("completed", "", 0)])
    assert SessionDone("client_done") in events(actions)
    assert any(isinstance(a, CloseSession) for a in actions)
    [refused] = events(s.query("late"))
    assert isinstance(refused, ChatError) and refused.code == "session_closing"


def test_invalid_config_is_refused_typed_and_the_old_one_kept() -> None:
    s = session(num_frames=2)
    [error] = events(s.configure(VideoChatConfig(num_frames=300)))
    assert isinstance(error, ChatError) and error.param == "num_frames"
    assert s.config is not None and s.config.num_frames == 2


def test_a_refused_query_ends_with_its_terminals() -> None:
    s = session()
    think = start(s)
    emitted = events(s.on_think_refused(think.query, "engine_busy", "busy"))
    assert emitted == [
        ChatError("engine_busy", "busy"),
        ResponseTextDone(think.query, "", "error"),
        ResponseAudioDone(think.query, "error"),
    ]


def test_an_answer_that_fails_mid_speech_ends_its_audio_as_an_error() -> None:
    s = session()
    think = start(s)
    s.on_think(think.query, [TextDelta("Hello. ")])
    actions = s.on_think(think.query, [ThinkDone("error", "Hello. ", 2, "boom")])
    assert any(isinstance(a, CancelSpeech) for a in actions)
    assert ChatError("generation_failed", "boom") in events(actions)
    assert events(s.on_speech(UtteranceDone(0, 0, 1, "cancelled"))) == [ResponseAudioDone(think.query, "error")]


def test_speech_refused_mid_answer_ends_the_audio_once_and_the_text_goes_on() -> None:
    s = session()
    think = start(s)
    s.on_think(think.query, [TextDelta("Hello. ")])
    refused = s.on_speech(UtteranceDone(0, 0, 0, "error", "no free engine slot"))
    assert events(refused) == [ResponseAudioDone(think.query, "error")]
    actions = s.on_think(think.query, [TextDelta("World. "), TextDelta("Again.")])
    assert [type(e) for e in events(actions)] == [ResponseTextDelta, ResponseTextDelta]
    assert not any(isinstance(a, SpeakText) for a in actions)  # no new utterance to be refused again
    actions = s.on_think(think.query, [ThinkDone("completed", "Hello. World. Again.", 4)])
    assert events(actions) == [ResponseTextDone(think.query, "Hello. World. Again.", "completed")]
    assert not any(isinstance(a, FinishSpeech | CancelSpeech) for a in actions)
    assert not s.answering


def test_a_prompt_too_long_for_the_thinker_is_reported_with_its_code() -> None:
    s = session(modalities=("text",))
    think = start(s)
    done = ThinkDone("error", "", 0, "the prompt exceeds the context", "context_length_exceeded")
    assert events(s.on_think(think.query, [done])) == [
        ChatError("context_length_exceeded", "the prompt exceeds the context"),
        ResponseTextDone(think.query, "", "error"),
    ]


def test_an_answer_that_fills_the_context_ends_with_max_context() -> None:
    s = session(modalities=("text",))
    think = start(s)
    actions = s.on_think(think.query, [TextDelta("hi"), ThinkDone("max_context", "hi", 1)])
    assert events(actions)[-1] == ResponseTextDone(think.query, "hi", "max_context")
