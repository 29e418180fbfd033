"""The realtime session core answering with an LLM, with plain calls: the test plays the LLM, the transcription
service and the TTS engine by answering the session's requests."""

from __future__ import annotations

from typing import Any

from omnigate.engines.openai_compat.messages import ChatFinish, TextDelta, ToolCallDelta, Usage
from omnigate.engines.vad import WINDOW_MS
from omnigate.sessions.realtime.answer import ResponderPolicy
from omnigate.sessions.realtime.conversation import Response
from omnigate.sessions.realtime.requests import CancelChat, ServiceFailed, StartChat, Transcribe, TurnMeasured
from omnigate.sessions.realtime.turn_audio import TurnAudio
from tests.unit.test_realtime_session import RATE, Harness, append, event, pcm_ms, types

ASKING = ResponderPolicy(model="small-llm", max_tokens=256, history_max_chars=2000, transcription=True)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def user_text(text: str) -> Any:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return event("conversation.item.create", item=item)


def last(h: Harness, kind: type[Any]) -> Any:
    found = [request for request in h.requests if isinstance(request, kind)]
    assert found, f"no {kind.__name__} request"
    return found[-1]


def chat_messages(request: StartChat) -> list[dict[str, Any]]:
    return [
        {key: value for key, value in (("role", m.role), ("content", m.content)) if value is not None}
        for m in request.request.messages
    ]


def active(h: Harness) -> Response:
    response = h.session.active
    assert response is not None
    return response


def test_a_text_turn_is_answered_by_the_llm_and_spoken_as_it_streams() -> None:
    h = Harness(ASKING)
    h.send(event("session.update", session={"type": "realtime", "instructions": "Be brief."}))
    h.send(user_text("What time is it?"))
    h.now = 1.0
    h.send(event("response.create"))
    chat = last(h, StartChat)
    assert chat_messages(chat) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What time is it?"},
    ]
    assert chat.request.model == "small-llm"
    response = active(h)
    h.now = 1.2
    h.session.chat_delta(response.id, TextDelta("It is noon."), h.now)
    assert h.engine.calls[-2:] == [("open", response.id), ("text", "It is noon.")]  # spoken before the reply ends
    h.session.chat_delta(response.id, TextDelta(" Enjoy"), h.now)
    h.session.chat_delta(response.id, ChatFinish("stop", Usage(12, 5, 17)), h.now)
    assert h.engine.calls[-2:] == [("text", " Enjoy"), ("close", response.id)]
    # The TTS speaks it and ends the response, as a backend does.
    h.session.response_text(response, "It is noon.", 3)
    h.session.response_audio(response, pcm_ms(200), RATE, now=1.5, engine_ms=100.0)
    h.now = 1.6
    assert h.drain()[-1]["type"] == "response.output_audio.delta"  # the transport takes the first audio
    h.session.finish_response(response, "completed")
    events = h.drain()
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["usage"]["input_token_details"]["text_tokens"] == 12
    assert done["usage"]["output_token_details"]["text_tokens"] == 5
    assert done["metadata"] == {
        "omnigate_first_token_ms": "200.0",
        "omnigate_llm_ms": "400.0",  # to the first segment's text, which the engine got at once
        "omnigate_first_audio_ms": "600.0",
        "omnigate_tts_ms": "100.0",  # the engine's own time
        "omnigate_overhead_ms": "100.0",  # the first audio waiting for the writer
    }
    assert isinstance(h.requests[-1], TurnMeasured)
    assert not any(isinstance(request, CancelChat) for request in h.requests)


def speak_a_turn(h: Harness, speech_ms: float = WINDOW_MS * 10) -> None:
    """The user says something and pauses: the detector's scores say so."""
    windows = int(speech_ms / WINDOW_MS)
    h.send(append(pcm_ms(WINDOW_MS * 20)))  # silence before
    h.session.speech_scored([0.0] * 20, h.now)
    h.send(append(pcm_ms(WINDOW_MS * (windows + 20))))
    h.session.speech_scored([0.9] * windows + [0.0] * 20, h.now)


def test_a_spoken_turn_is_transcribed_and_answered_once_the_transcript_is_in() -> None:
    h = Harness(ASKING)
    h.drain()
    h.now = 2.0
    speak_a_turn(h, speech_ms=WINDOW_MS * 10)
    transcribe = last(h, Transcribe)
    # The turn's audio: the prefix padding, the speech and the closing silence up to the detected end.
    expected_ms = 300 + WINDOW_MS * 10 + 500
    assert abs(len(transcribe.pcm) / 48 - expected_ms) <= WINDOW_MS * 2
    response = active(h)  # the response starts at once (create_response) ...
    assert not any(isinstance(request, StartChat) for request in h.requests)  # ... and asks once the words are in
    h.now = 2.15
    h.session.transcribed(transcribe.item_id, "Tell me a joke.", h.now)
    chat = last(h, StartChat)
    assert chat.response_id == response.id
    assert chat_messages(chat)[-1] == {"role": "user", "content": "Tell me a joke."}
    events = h.drain()
    kinds = types(events)
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    completed = events[kinds.index("conversation.item.input_audio_transcription.completed")]
    assert completed["item_id"] == transcribe.item_id
    assert completed["transcript"] == "Tell me a joke."
    h.session.chat_delta(response.id, TextDelta("Knock knock."), 2.35)
    h.session.chat_delta(response.id, ChatFinish("stop"), 2.4)
    h.session.response_audio(response, pcm_ms(100), RATE, now=2.6, engine_ms=150.0)
    h.now = 2.7
    h.drain()
    h.session.finish_response(response, "completed")
    metadata = h.drain()[-1]["response"]["metadata"]
    assert metadata["omnigate_transcript_ms"] == "150.0"
    assert metadata["omnigate_asr_ms"] == "150.0"
    assert metadata["omnigate_first_token_ms"] == "350.0"
    assert metadata["omnigate_first_audio_ms"] == "700.0"
    assert metadata["omnigate_tts_ms"] == "150.0"
    assert metadata["omnigate_llm_ms"] == "300.0"
    assert metadata["omnigate_overhead_ms"] == "100.0"


def test_tool_calls_become_function_call_items_and_their_outputs_go_back_to_the_llm() -> None:
    h = Harness(ASKING)
    h.send(event("session.update", session={"type": "realtime", "tools": [WEATHER]}))
    h.send(user_text("What is the weather in Oslo?"))
    h.send(event("response.create"))
    assert last(h, StartChat).request.tools[0].function.name == "get_weather"
    response = active(h)
    h.drain()
    h.session.chat_delta(response.id, ToolCallDelta(0, id="call_9", name="get_weather", arguments='{"ci'), 0.1)
    h.session.chat_delta(response.id, ToolCallDelta(0, arguments='ty": "Oslo"}'), 0.1)
    h.session.chat_delta(response.id, ChatFinish("tool_calls"), 0.2)
    events = h.drain()
    assert types(events) == [
        "response.output_item.added",
        "conversation.item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    arguments_done = events[4]
    assert arguments_done["call_id"] == "call_9"
    assert arguments_done["output_index"] == 1
    assert arguments_done["arguments"] == '{"city": "Oslo"}'
    outputs = events[-1]["response"]["output"]
    assert [item["type"] for item in outputs] == ["message", "function_call"]
    assert events[-1]["response"]["status"] == "completed"
    assert ("open", response.id) not in h.engine.calls  # nothing to say: no speech at all
    # The client runs the tool and asks again.
    output = {"type": "function_call_output", "call_id": "call_9", "output": '{"sky": "clear"}'}
    h.send(event("conversation.item.create", item=output))
    h.send(event("response.create"))
    messages = last(h, StartChat).request.messages
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[1].tool_calls[0].function.arguments == '{"city": "Oslo"}'  # type: ignore[index]
    assert messages[2].content == '{"sky": "clear"}'


def test_barge_in_cancels_the_llm_request_and_keeps_what_the_user_heard() -> None:
    h = Harness(ASKING)
    h.send(user_text("Tell me a long story."))
    h.send(event("response.create"))
    response = active(h)
    h.session.chat_delta(response.id, TextDelta("Once upon a time. "), 0.1)
    h.session.response_text(response, "Once upon a time. ", 4)
    h.session.response_audio(response, pcm_ms(600), RATE, now=0.2)
    h.session.chat_delta(response.id, TextDelta("There was a dragon."), 0.3)
    h.session.response_text(response, "There was a dragon.", 4)
    h.session.response_audio(response, pcm_ms(300), RATE, now=0.4)
    while True:  # the transport takes the first sentence's audio only
        output = h.session.take_output()
        assert output is not None
        if getattr(output, "audio_ms", 0):
            break
    h.send(append(pcm_ms(WINDOW_MS)))
    h.session.speech_scored([0.95], 0.5)
    assert last(h, CancelChat).response_id == response.id
    assert ("cancel", response.id) in h.engine.calls
    assert response.item is not None
    assert response.item.transcript() == "Once upon a time. "
    done = h.drain()[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["output"][0]["content"][0]["transcript"] == "Once upon a time. "
    h.session.chat_delta(response.id, TextDelta(" more"), 0.6)  # a late delta of the cancelled request
    assert h.engine.calls[-1] == ("cancel", response.id)


def test_a_failing_llm_fails_the_response_typed_and_the_next_turn_works() -> None:
    h = Harness(ASKING)
    h.send(user_text("Hello?"))
    h.send(event("response.create"))
    response = active(h)
    h.session.chat_delta(response.id, TextDelta("Hi"), 0.1)
    h.session.response_text(response, "Hi", 1)
    h.session.response_audio(response, pcm_ms(100), RATE, now=0.2)
    h.session.chat_failed(response.id, "llm_timeout", "no token within 10 s")
    assert response.item is not None and response.item.transcript() == ""  # none of it was heard
    events = h.drain()
    assert "response.output_audio.delta" not in types(events)  # nothing of a failed response is left to send
    errors = [e for e in events if e["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["llm_timeout"]
    done = events[-1]["response"]
    assert done["status"] == "failed"
    assert done["status_details"]["error"]["code"] == "llm_timeout"
    assert last(h, ServiceFailed).code == "llm_timeout"
    assert h.session.idle and not h.session.closed
    h.send(user_text("Hello again?"))
    h.send(event("response.create"))
    assert last(h, StartChat).response_id == active(h).id


def test_garbage_tool_calls_fail_the_response_as_a_bad_response() -> None:
    h = Harness(ASKING)
    h.send(event("session.update", session={"type": "realtime", "tools": [WEATHER]}))
    h.send(user_text("Weather?"))
    h.send(event("response.create"))
    response = active(h)
    h.session.chat_delta(response.id, ToolCallDelta(0, id="c", name="get_weather", arguments="{not json"), 0.1)
    h.session.chat_delta(response.id, ChatFinish("tool_calls"), 0.2)
    events = h.drain()
    assert [e["error"]["code"] for e in events if e["type"] == "error"] == ["llm_bad_response"]
    assert events[-1]["response"]["status"] == "failed"
    incomplete = next(e for e in events if e["type"] == "response.output_item.done")
    assert incomplete["item"]["status"] == "incomplete"


def test_a_failing_transcription_fails_the_waiting_response_and_says_which_item() -> None:
    h = Harness(ASKING)
    speak_a_turn(h)
    transcribe = last(h, Transcribe)
    h.session.transcription_failed(transcribe.item_id, "asr_unavailable", "connection refused")
    events = h.drain()
    failed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.failed")
    assert failed["item_id"] == transcribe.item_id
    assert failed["error"]["code"] == "asr_unavailable"
    # One error event and one failure for the metrics, not one for the turn and one more for the response.
    assert [e["error"]["code"] for e in events if e["type"] == "error"] == ["asr_unavailable"]
    assert [r.code for r in h.requests if isinstance(r, ServiceFailed)] == ["asr_unavailable"]
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["status_details"]["error"]["code"] == "asr_unavailable"
    assert not any(isinstance(request, StartChat) for request in h.requests)
    assert h.session.idle


def test_without_transcription_an_audio_turn_starts_no_response() -> None:
    h = Harness(ResponderPolicy(transcription=False))
    speak_a_turn(h)
    assert h.session.active is None
    assert not any(isinstance(request, Transcribe) for request in h.requests)


def test_transcriptions_waiting_are_bounded() -> None:
    h = Harness(ResponderPolicy(transcription=True, max_pending_transcriptions=1))
    h.send(event("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}))
    for _ in range(2):
        h.send(append(pcm_ms(100)))
        h.send(event("input_audio_buffer.commit"))
    assert len([r for r in h.requests if isinstance(r, Transcribe)]) == 1
    failed = [e for e in h.drain() if e["type"] == "conversation.item.input_audio_transcription.failed"]
    assert [e["error"]["code"] for e in failed] == ["asr_backlog"]


def test_turn_audio_keeps_the_newest_within_its_bound() -> None:
    audio = TurnAudio(max_bytes=48 * 100)
    audio.add(bytes(range(256)) * 30)  # 7680 bytes: 160 ms, beyond the 100 ms bound
    assert len(audio) == 4800
    audio.keep_from(100.0)  # positions count the dropped audio: 60 ms were dropped, 40 ms more go
    assert len(audio) == 48 * 60
    assert len(audio.take_until(130.0)) == 48 * 30
    assert len(audio.take_all()) == 48 * 30
    audio.add(b"\x01\x00" * 24)
    audio.restart()
    assert len(audio) == 0


def test_the_session_advertises_what_it_answers_with() -> None:
    h = Harness(ASKING)
    created = h.drain()[0]["session"]
    assert created["capabilities"]["tools"] is True
    assert created["capabilities"]["input_transcription"] is True
    assert created["audio"]["input"]["turn_detection"]["create_response"] is True


def test_a_text_only_response_streams_the_llm_text_without_speech() -> None:
    h = Harness(ASKING)
    h.send(user_text("Spell cat."))
    h.send(event("response.create", response={"output_modalities": ["text"]}))
    response = active(h)
    h.drain()
    h.session.chat_delta(response.id, TextDelta("C-A"), 0.1)
    h.session.chat_delta(response.id, TextDelta("-T."), 0.2)
    h.session.chat_delta(response.id, ChatFinish("stop", Usage(4, 3, 7)), 0.3)
    events = h.drain()
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["C-A", "-T."]
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "C-A-T."
    assert done["usage"]["output_token_details"]["text_tokens"] == 3
    assert not any(call[0] == "open" for call in h.engine.calls)
