"""The realtime session core with plain calls: a recording engine, scores handed in by the test, time as numbers."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest

from omnigate.engines.vad import WINDOW_MS
from omnigate.sessions.realtime.answer import ResponderPolicy
from omnigate.sessions.realtime.capabilities import RealtimeCapabilities
from omnigate.sessions.realtime.client_events import ClientEvent
from omnigate.sessions.realtime.config import RealtimeConfig, ResponseSettings
from omnigate.sessions.realtime.conversation import IdSource, Response
from omnigate.sessions.realtime.outbox import Closing, OutgoingEvent
from omnigate.sessions.realtime.requests import ScoreSpeech, SessionRequest
from omnigate.sessions.realtime.session import RealtimeLimits, RealtimeSession, UnreadableEvent
from tests.unit.test_realtime_protocol import validate_server_event

RATE = 24000
TTS = RealtimeCapabilities(
    engine="recording",
    native_duplex=False,
    speaks_text_items=True,
    create_response=False,
    client_commit=True,
    output_modalities=("audio",),
    voices=("alba",),
    default_voice="alba",
    speed=True,
    instructions=False,
)


class RecordingEngine:
    """The engine port as a list of the calls the core made; it produces nothing by itself."""

    def __init__(self, capabilities: RealtimeCapabilities = TTS) -> None:
        self.capabilities = capabilities
        self.sample_rate = RATE
        self.calls: list[tuple[str, Any]] = []
        self.released_ms = 0.0
        self.accept_audio = True

    def reconfigure(self, config: RealtimeConfig) -> None:
        self.calls.append(("reconfigure", config.voice))

    def open_speech(self, response: Response, settings: ResponseSettings) -> None:
        self.calls.append(("open", response.id))

    def add_speech(self, response: Response, text: str) -> None:
        self.calls.append(("text", text))

    def close_speech(self, response: Response) -> None:
        self.calls.append(("close", response.id))

    def cancel(self, response: Response) -> None:
        self.calls.append(("cancel", response.id))

    def push_audio(self, pcm: bytes) -> bool:
        return self.accept_audio

    def clear_input(self) -> None:
        self.calls.append(("clear_input", None))

    def released_audio(self, ms: float) -> None:
        self.released_ms += ms


class Harness:
    def __init__(self, responder: ResponderPolicy | None = None, **limits: Any) -> None:
        self.engine = RecordingEngine()
        self.requests: list[SessionRequest] = []
        self.now = 0.0
        self.session = RealtimeSession(
            self.engine,
            limits=RealtimeLimits(**limits),
            model="recording",
            served_models=frozenset({"recording"}),
            resolve_voice=lambda name: name,
            now=self.now,
            ids=IdSource("t"),
            on_request=self.requests.append,
            responder=responder,
        )
        self.session.open()

    def send(self, event: ClientEvent | UnreadableEvent) -> None:
        self.session.receive(event, self.now)

    def drain(self) -> list[dict[str, Any]]:
        """Everything queued, as the transport would take it; the events are validated against the SDK's models."""
        events = []
        while (output := self.session.take_output(self.now)) is not None:
            if isinstance(output, Closing):
                events.append({"type": "<closed>", "code": output.code, "close_code": output.close_code})
                continue
            assert isinstance(output, OutgoingEvent)
            event = json.loads(output.payload)
            validate_server_event(event)
            events.append(event)
        return events

    def speak(self, text: str = "Hello there.") -> Response:
        self.send(assistant(text))
        self.send(event("response.create"))
        active = self.session.active
        assert active is not None
        return active


def event(kind: str, **fields: Any) -> ClientEvent:
    """A client event as the adapter hands it over, decoded."""
    decoded: ClientEvent = msgspec.convert({"type": kind, **fields}, ClientEvent)
    return decoded


def assistant(text: str) -> ClientEvent:
    item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return event("conversation.item.create", item=item)


def append(pcm: bytes, event_id: str | None = None) -> ClientEvent:
    return event("input_audio_buffer.append", audio=base64.b64encode(pcm).decode(), event_id=event_id)


def pcm_ms(ms: float) -> bytes:
    return b"\x00\x00" * int(RATE * ms / 1000)


def types(events: list[dict[str, Any]]) -> list[str]:
    return [event["type"] for event in events]


def no_vad() -> ClientEvent:
    return event("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})


def test_a_response_runs_in_protocol_order_and_ends_once() -> None:
    h = Harness()
    assert types(h.drain()) == ["session.created"]
    response = h.speak("Hello there.")
    assert h.engine.calls == [("open", response.id), ("text", "Hello there."), ("close", response.id)]
    h.session.response_text(response, "Hello there.", 2)
    assert h.session.response_audio(response, pcm_ms(100), RATE)
    h.session.finish_response(response, "completed")
    h.session.finish_response(response, "failed")  # a second end is ignored
    assert not h.session.response_audio(response, pcm_ms(100), RATE)  # nothing of it after its end
    events = h.drain()
    assert types(events) == [
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_audio_transcript.delta",
        "response.output_audio.delta",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["usage"]["output_token_details"]["text_tokens"] == 2
    assert h.session.idle


def test_assistant_text_without_a_letter_or_digit_is_nothing_to_speak() -> None:
    h = Harness()
    h.send(assistant("...!!!"))
    h.drain()
    h.send(event("response.create", event_id="client_9"))
    [error] = h.drain()
    assert error["error"]["code"] == "nothing_to_speak" and error["error"]["event_id"] == "client_9"
    assert h.session.idle


def test_every_event_has_an_id_and_errors_name_the_client_event() -> None:
    h = Harness()
    h.drain()
    h.send(UnreadableEvent("unknown_event", "unknown event type 'x'", "client_7", param="type"))
    h.send(event("response.create", event_id="client_8"))  # nothing to speak
    events = h.drain()
    assert [e["error"]["code"] for e in events] == ["unknown_event", "nothing_to_speak"]
    assert [e["error"]["event_id"] for e in events] == ["client_7", "client_8"]
    assert len({e["event_id"] for e in events}) == 2


def test_truncation_is_checked_against_audio_handed_to_the_transport() -> None:
    h = Harness()
    response = h.speak()
    h.session.response_text(response, "Hello ", 1)
    h.session.response_audio(response, pcm_ms(400), RATE)
    h.session.response_text(response, "there.", 1)
    h.session.response_audio(response, pcm_ms(400), RATE)
    h.session.finish_response(response, "completed")
    assert response.item is not None
    item_id = response.item.id
    # Queued but not yet taken: none of it counts as sent.
    h.send(event("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=300, event_id="cut1"))
    h.drain()  # the transport takes everything, including the refusal
    assert response.item.sent_ms == pytest.approx(800.0)
    h.send(event("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=300, event_id="cut2"))
    events = h.drain()
    assert types(events) == ["conversation.item.truncated"]
    assert events[0]["audio_end_ms"] == 300
    assert response.item.content[0].transcript == "Hello "  # the text whose audio started after the cut is gone
    assert h.engine.released_ms == pytest.approx(800.0)


def test_the_refused_truncation_names_its_event() -> None:
    h = Harness()
    response = h.speak()
    h.session.response_audio(response, pcm_ms(400), RATE)
    assert response.item is not None
    h.drain()  # 400 ms handed over
    h.send(
        event("conversation.item.truncate", item_id=response.item.id, content_index=0, audio_end_ms=1000, event_id="c1")
    )
    (error,) = h.drain()
    assert error["error"]["code"] == "audio_end_ms_beyond_sent"
    assert error["error"]["event_id"] == "c1"


def test_cancel_stops_the_engine_and_purges_queued_audio_before_the_done() -> None:
    h = Harness()
    response = h.speak()
    h.drain()
    for _ in range(5):
        h.session.response_audio(response, pcm_ms(100), RATE)
    assert h.session.outbox.media_ms == pytest.approx(500.0)
    h.send(event("response.cancel"))
    assert ("cancel", response.id) in h.engine.calls
    assert h.engine.released_ms == pytest.approx(500.0)  # the purged audio's room goes back to the engine
    events = h.drain()
    assert "response.output_audio.delta" not in types(events)
    assert events[-1]["type"] == "response.done"
    assert events[-1]["response"]["status"] == "cancelled"
    assert events[-1]["response"]["status_details"]["reason"] == "client_cancelled"
    h.send(event("response.cancel", event_id="again"))
    (error,) = h.drain()
    assert error["error"]["code"] == "response_cancel_not_active"


def test_output_clear_names_the_last_response_even_after_it_ended() -> None:
    h = Harness()
    response = h.speak()
    h.session.finish_response(response, "completed")
    h.drain()
    h.send(event("output_audio_buffer.clear"))
    (cleared,) = h.drain()
    assert cleared == {
        "type": "output_audio_buffer.cleared",
        "event_id": cleared["event_id"],
        "response_id": response.id,
    }


def test_one_response_at_a_time() -> None:
    h = Harness()
    h.speak()
    h.send(assistant("More."))
    h.send(event("response.create", event_id="second"))
    error = h.drain()[-1]
    assert error["error"]["code"] == "conversation_already_has_active_response"


def test_voice_changes_wait_for_the_response_to_end() -> None:
    h = Harness()
    h.speak()
    h.drain()
    h.send(event("session.update", session={"type": "realtime", "audio": {"output": {"speed": 1.5}}}))
    (error,) = h.drain()
    assert error["error"]["code"] == "response_in_progress"
    assert not [call for call in h.engine.calls if call[0] == "reconfigure"]


def test_without_vad_appends_beyond_the_cap_are_refused_and_are_no_activity() -> None:
    h = Harness(input_max_bytes=4800, idle_timeout_s=10.0)
    h.send(no_vad())
    h.drain()
    h.now = 5.0
    h.send(append(pcm_ms(80), "a1"))
    assert h.drain() == []
    h.now = 8.0
    h.send(append(pcm_ms(80), "a2"))
    (error,) = h.drain()
    assert error["error"]["code"] == "input_backpressure"
    assert error["error"]["event_id"] == "a2"
    assert h.session.expire(14.0) == pytest.approx(15.0)  # the refused append at 8 s did not move the idle clock
    assert h.requests == []  # no turn detection, no scoring
    h.send(event("input_audio_buffer.commit"))
    assert types(h.drain()) == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]


def test_idle_timeout_and_maximum_duration_close_with_their_codes() -> None:
    h = Harness(idle_timeout_s=10.0, max_session_s=25.0)
    h.drain()
    assert h.session.next_deadline == pytest.approx(10.0)
    assert h.session.expire(9.0) == pytest.approx(10.0)
    h.now = 9.0
    h.send(event("input_audio_buffer.commit"))  # any client event counts, even a refused one
    h.drain()
    assert h.session.expire(10.0) == pytest.approx(19.0)
    assert h.session.expire(19.0) is None
    events = h.drain()
    assert events[0]["error"]["code"] == "idle_timeout"
    assert events[-1] == {"type": "<closed>", "code": "idle_timeout", "close_code": 4408}

    h = Harness(idle_timeout_s=10.0, max_session_s=25.0)
    for second in range(5, 26, 5):
        h.now = float(second)
        h.send(event("input_audio_buffer.commit"))
    assert h.session.expire(25.0) is None
    assert h.drain()[-1] == {"type": "<closed>", "code": "max_duration", "close_code": 1008}


def test_the_idle_timeout_covers_the_gaps_between_answers_not_an_answer_in_progress() -> None:
    h = Harness(idle_timeout_s=10.0, max_session_s=100.0)
    response = h.speak("A long answer.")
    h.session.response_text(response, "A long answer.", 3)
    assert h.session.expire(10.0) == pytest.approx(20.0)  # generating: the clock starts again
    assert h.session.response_audio(response, pcm_ms(100), RATE)
    h.session.finish_response(response, "completed")
    assert h.session.expire(20.0) == pytest.approx(30.0)  # its audio still waits for the transport
    h.drain()
    assert h.session.expire(30.0) is None
    assert h.drain()[-1] == {"type": "<closed>", "code": "idle_timeout", "close_code": 4408}


def scores(h: Harness, *probabilities: float) -> None:
    """Answer the outstanding scoring request with these window probabilities."""
    assert isinstance(h.requests[-1], ScoreSpeech)
    h.session.speech_scored(list(probabilities), h.now)


def test_server_vad_asks_for_one_scoring_at_a_time_and_commits_the_turn() -> None:
    h = Harness()
    h.drain()
    h.send(append(pcm_ms(WINDOW_MS * 4)))
    h.send(append(pcm_ms(WINDOW_MS * 4)))  # waits: a request is outstanding
    assert len(h.requests) == 1
    assert len(h.requests[0].pcm) == len(pcm_ms(WINDOW_MS * 4))
    scores(h, 0.9, 0.9, 0.9, 0.9)
    assert len(h.requests) == 2  # the audio that waited goes out at once
    assert len(h.requests[1].pcm) == len(pcm_ms(WINDOW_MS * 4))
    silence = [0.0] * (500 // int(WINDOW_MS) + 1)
    scores(h, *silence)
    events = h.drain()
    assert types(events) == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    assert events[0]["item_id"] == events[1]["item_id"] == events[2]["item_id"]
    assert len(h.requests) == 2  # nothing queued: no request


def test_barge_in_cancels_the_response_and_drops_all_queued_audio() -> None:
    h = Harness()
    response = h.speak()
    h.session.response_audio(response, pcm_ms(300), RATE)
    h.drain()
    h.session.response_audio(response, pcm_ms(300), RATE)  # queued, not yet played
    h.send(append(pcm_ms(WINDOW_MS)))
    scores(h, 0.95)
    events = h.drain()
    assert types(events)[0] == "input_audio_buffer.speech_started"
    assert "response.output_audio.delta" not in types(events)
    assert events[-1]["response"]["status"] == "cancelled"
    assert events[-1]["response"]["status_details"]["reason"] == "turn_detected"
    assert ("cancel", response.id) in h.engine.calls
    assert response.item is not None and response.item.sent_ms == pytest.approx(300.0)


def test_a_failed_scoring_goes_on_with_later_audio() -> None:
    h = Harness()
    h.send(append(pcm_ms(WINDOW_MS)))
    h.send(append(pcm_ms(WINDOW_MS)))
    h.session.scoring_failed()
    assert len(h.requests) == 2


def test_a_client_that_stops_reading_is_closed_for_backlog() -> None:
    h = Harness(outbox_events=40)
    for n in range(40):
        h.send(UnreadableEvent("invalid_json", "the message is not valid JSON", f"e{n}"))
    assert h.session.closed
    events = h.drain()
    assert events[-2]["error"]["code"] == "backlog"
    assert events[-1] == {"type": "<closed>", "code": "backlog", "close_code": 1008}


def test_disconnect_stops_the_engine_and_nothing_more_is_queued() -> None:
    h = Harness()
    response = h.speak()
    h.drain()
    h.session.disconnect()
    assert ("cancel", response.id) in h.engine.calls
    assert not h.session.response_audio(response, pcm_ms(100), RATE)
    h.session.finish_response(response, "cancelled")
    assert h.drain() == []


def test_drain_ends_the_response_then_the_session() -> None:
    h = Harness()
    h.speak()
    h.drain()
    assert h.session.end("shutting_down", "the server is shutting down")
    assert not h.session.end("shutting_down", "again")
    events = h.drain()
    assert types(events)[-3:] == ["response.done", "error", "<closed>"]
    assert events[-1]["close_code"] == 1012
