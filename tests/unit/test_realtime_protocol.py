"""The wire shapes: every server event validates against the ``openai`` package's own models, and every client
event the SDK builds parses."""

from __future__ import annotations

import json
import typing
from typing import Any

import msgspec
import pytest
from openai._models import BaseModel as OpenAIModel
from openai.types.realtime import RealtimeClientEvent, RealtimeServerEvent

from omnigate.gateway.realtime.protocol import decode_client_event, peek
from omnigate.sessions.realtime import server_events as se
from omnigate.sessions.realtime.capabilities import RealtimeCapabilities
from omnigate.sessions.realtime.client_events import (
    CLIENT_EVENT_TYPES,
    ConversationItemCreate,
    ResponseCreate,
    ServerVad,
    SessionUpdate,
)
from omnigate.sessions.realtime.config import default_config, session_object

_UNION = typing.get_args(typing.get_args(RealtimeServerEvent)[0])
SERVER_MODELS: dict[str, type[OpenAIModel]] = {
    typing.get_args(model.model_fields["type"].annotation)[0]: model for model in _UNION
}
CLIENT_MODELS: dict[str, type[OpenAIModel]] = {
    typing.get_args(model.model_fields["type"].annotation)[0]: model
    for model in typing.get_args(typing.get_args(RealtimeClientEvent)[0])
}
# Fields omnigate adds on purpose (the SDK models allow extra fields; these are the only ones we send).
EXTENSIONS = {"session.created": {"session"}, "session.updated": {"session"}}


def validate_server_event(event: dict[str, Any]) -> OpenAIModel:
    """Validate one server event as the SDK's model for its type; raise on anything that does not fit."""
    kind = event.get("type")
    assert isinstance(kind, str) and kind in SERVER_MODELS, f"not an OpenAI realtime server event: {kind!r}"
    model = SERVER_MODELS[kind]
    unknown = set(event) - set(model.model_fields)
    assert not unknown, f"{kind} carries fields the SDK does not define: {unknown}"
    assert isinstance(event.get("event_id"), str) and event["event_id"], f"{kind} has no event_id"
    parsed = model.model_validate(event)
    extra = set((parsed.model_extra or {}).keys())
    assert not extra, f"{kind} has extra fields {extra}"
    if kind in ("session.created", "session.updated"):
        session_extra = set((parsed.session.model_extra or {}).keys())  # type: ignore[attr-defined]
        # capabilities and unused_fields are omnigate's; temperature echoes what beta-era clients still send.
        assert session_extra <= {"capabilities", "id", "object", "unused_fields", "temperature"}, session_extra
    return parsed


CAPS = RealtimeCapabilities(
    engine="synthetic",
    native_duplex=False,
    speaks_text_items=True,
    create_response=False,
    client_commit=True,
    output_modalities=("audio",),
    voices=("tone",),
    default_voice="tone",
    speed=False,
    instructions=False,
)


def _item() -> se.WireItem:
    return se.WireItem(
        id="item_1",
        type="message",
        object="realtime.item",
        role="assistant",
        status="in_progress",
        content=[se.WireContent(type="output_audio", transcript="")],
    )


def _call_item(kind: str) -> se.WireItem:
    if kind == "function_call":
        fields = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    else:
        fields = {"output": '{"sky": "clear"}'}
    return se.WireItem(id="item_3", type=kind, object="realtime.item", status="completed", call_id="call_1", **fields)


def _response(status: se.ResponseStatus) -> se.WireResponse:
    usage = se.WireUsage(
        total_tokens=3,
        input_tokens=1,
        output_tokens=2,
        input_token_details=se.WireInputDetails(text_tokens=1, audio_tokens=0),
        output_token_details=se.WireOutputDetails(text_tokens=1, audio_tokens=1),
    )
    return se.WireResponse(
        id="resp_1",
        status=status,
        status_details=se.WireStatusDetails(type="cancelled", reason="turn_detected")
        if status == "cancelled"
        else None,
        output=[_item()],
        conversation_id="conv_default",
        output_modalities=["audio"],
        audio=se.WireResponseAudio(
            output=se.WireResponseAudioOutput(format=se.WireAudioFormat(type="audio/pcm", rate=24000), voice="tone")
        ),
        max_output_tokens="inf",
        metadata={"client_event_id": "c1"},
        usage=usage if status != "in_progress" else None,
    )


def every_server_event() -> list[se.ServerEvent]:
    session = session_object(default_config(CAPS, "synthetic"), "sess_1", CAPS)
    ids = {"response_id": "resp_1", "item_id": "item_1", "output_index": 0, "content_index": 0}
    part = se.WirePart(type="audio", transcript="hi")
    return [
        se.ErrorEvent(
            event_id="e", error=se.WireError(type="invalid_request_error", code="x", message="m", event_id="c")
        ),
        se.SessionCreated(event_id="e", session=session),
        se.SessionUpdated(event_id="e", session=session),
        se.SpeechStarted(event_id="e", audio_start_ms=0, item_id="item_2"),
        se.SpeechStopped(event_id="e", audio_end_ms=900, item_id="item_2"),
        se.InputCommitted(event_id="e", item_id="item_2", previous_item_id=None),
        se.InputCleared(event_id="e"),
        se.ItemAdded(event_id="e", item=_item(), previous_item_id="item_0"),
        se.ItemDone(event_id="e", item=_item(), previous_item_id=None),
        se.ItemTruncated(event_id="e", item_id="item_1", content_index=0, audio_end_ms=120),
        se.ItemDeleted(event_id="e", item_id="item_1"),
        se.ItemRetrieved(event_id="e", item=_item()),
        se.ResponseCreated(event_id="e", response=_response("in_progress")),
        se.ResponseDone(event_id="e", response=_response("cancelled")),
        se.ResponseDone(event_id="e", response=_response("completed")),
        se.OutputItemAdded(event_id="e", response_id="resp_1", output_index=0, item=_item()),
        se.OutputItemDone(event_id="e", response_id="resp_1", output_index=0, item=_item()),
        se.ContentPartAdded(event_id="e", part=part, **ids),  # type: ignore[arg-type]
        se.ContentPartDone(event_id="e", part=part, **ids),  # type: ignore[arg-type]
        se.AudioDelta(event_id="e", delta="AAAA", **ids),  # type: ignore[arg-type]
        se.AudioDone(event_id="e", **ids),  # type: ignore[arg-type]
        se.TranscriptDelta(event_id="e", delta="hi", **ids),  # type: ignore[arg-type]
        se.TranscriptDone(event_id="e", transcript="hi", **ids),  # type: ignore[arg-type]
        se.TextDelta(event_id="e", delta="hi", **ids),  # type: ignore[arg-type]
        se.TextDone(event_id="e", text="hi", **ids),  # type: ignore[arg-type]
        se.OutputAudioCleared(event_id="e", response_id="resp_1"),
        se.OutputItemAdded(event_id="e", response_id="resp_1", output_index=1, item=_call_item("function_call")),
        se.ItemDone(event_id="e", item=_call_item("function_call_output"), previous_item_id="item_2"),
        se.FunctionCallArgumentsDelta(
            event_id="e", response_id="resp_1", item_id="item_3", output_index=1, call_id="call_1", delta="{"
        ),
        se.FunctionCallArgumentsDone(
            event_id="e",
            response_id="resp_1",
            item_id="item_3",
            output_index=1,
            call_id="call_1",
            name="get_weather",
            arguments='{"city": "Oslo"}',
        ),
        se.TranscriptionCompleted(
            event_id="e",
            item_id="item_2",
            content_index=0,
            transcript="hello",
            usage=se.WireTranscriptionUsage(seconds=1.5),
        ),
        se.TranscriptionFailed(
            event_id="e",
            item_id="item_2",
            content_index=0,
            error=se.WireTranscriptionError(type="server_error", code="asr_timeout", message="m"),
        ),
    ]


def test_every_server_event_struct_validates_against_the_sdk_models() -> None:
    events = every_server_event()
    kinds = {type(event) for event in events}
    assert kinds == set(typing.get_args(se.AnyServerEvent))  # each struct the server can send is covered
    for event in events:
        validate_server_event(json.loads(se.encode_event(event)))


def test_the_validator_rejects_a_malformed_event() -> None:
    bad = json.loads(
        se.encode_event(se.AudioDone(event_id="e", response_id="r", item_id="i", output_index=0, content_index=0))
    )
    del bad["item_id"]
    with pytest.raises(ValueError, match="item_id"):
        validate_server_event(bad)
    with pytest.raises(AssertionError, match="fields the SDK does not define"):
        validate_server_event({**bad, "item_id": "i", "epoch": 3})


def _sdk_json(kind: str, **fields: Any) -> str:
    model = CLIENT_MODELS[kind]
    return model.model_validate({"type": kind, **fields}).to_json(use_api_names=True, exclude_unset=True)


SDK_CLIENT_EVENTS: dict[str, dict[str, Any]] = {
    "session.update": {
        "session": {
            "type": "realtime",
            "instructions": "",
            "output_modalities": ["audio"],
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": 24000},
                    "turn_detection": {"type": "server_vad", "threshold": 0.6, "interrupt_response": True},
                },
                "output": {"format": {"type": "audio/pcmu"}, "voice": "marin"},
            },
        }
    },
    "input_audio_buffer.append": {"audio": "AAAA", "event_id": "c1"},
    "input_audio_buffer.commit": {},
    "input_audio_buffer.clear": {},
    "conversation.item.create": {
        "item": {
            "type": "message",
            "role": "assistant",
            "id": "mine",
            "content": [{"type": "output_text", "text": "Hi."}],
        },
        "previous_item_id": "root",
    },
    "conversation.item.truncate": {"item_id": "i", "content_index": 0, "audio_end_ms": 1500},
    "conversation.item.delete": {"item_id": "i"},
    "conversation.item.retrieve": {"item_id": "i"},
    "response.create": {"response": {"metadata": {"client_event_id": "x"}, "output_modalities": ["audio"]}},
    "response.cancel": {"response_id": "resp_1"},
    "output_audio_buffer.clear": {},
}


@pytest.mark.parametrize("kind", sorted(SDK_CLIENT_EVENTS))
def test_every_client_event_the_sdk_builds_parses(kind: str) -> None:
    event = decode_client_event(_sdk_json(kind, **SDK_CLIENT_EVENTS[kind]))
    assert event.__struct_config__.tag == kind
    assert set(SDK_CLIENT_EVENTS) == set(CLIENT_EVENT_TYPES)


def test_parsed_client_events_keep_what_the_client_asked() -> None:
    update = decode_client_event(_sdk_json("session.update", **SDK_CLIENT_EVENTS["session.update"]))
    assert isinstance(update, SessionUpdate)
    assert not isinstance(update.session.audio, msgspec.UnsetType)
    audio_in = update.session.audio.input
    assert not isinstance(audio_in, msgspec.UnsetType)
    assert isinstance(audio_in.turn_detection, ServerVad) and audio_in.turn_detection.threshold == 0.6
    assert audio_in.turn_detection.silence_duration_ms is msgspec.UNSET  # absent: left unchanged
    create = decode_client_event(_sdk_json("conversation.item.create", **SDK_CLIENT_EVENTS["conversation.item.create"]))
    assert isinstance(create, ConversationItemCreate) and create.item.id == "mine" and create.previous_item_id == "root"
    response = decode_client_event(_sdk_json("response.create", **SDK_CLIENT_EVENTS["response.create"]))
    assert isinstance(response, ResponseCreate) and response.response is not None
    assert response.response.metadata == {"client_event_id": "x"}


def test_unparseable_messages_are_named_for_their_errors() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_client_event('{"type": "response.audio.delta"}')
    with pytest.raises(msgspec.ValidationError):
        decode_client_event('{"type": "conversation.item.truncate", "item_id": "i", "audio_end_ms": -5}')
    assert peek('{"type": "nope", "event_id": "c9"}') == ("nope", "c9")
    assert peek("not json") == (None, None)


def test_a_session_update_names_the_fields_it_does_not_read() -> None:
    message = {
        "type": "session.update",
        "unknown_fields": ["session.forged"],  # the reader's own field: replaced, never taken from the client
        "session": {
            "type": "realtime",
            "foo": 1,
            "voice": "alloy",  # a beta name, read (served at audio.output.voice)
            "tools": [{"type": "function", "name": "f", "anything": {"goes": True}}],  # free-form: kept whole
            "audio": {
                "input": {
                    "turn_detection": {"type": "semantic_vad", "eagerness": "low", "threshold": 0.5},
                    "transcription": {"model": "m", "prompt": "p"},
                },
                "output": {"voice": "marin", "pitch": 2},
                "video": {},
            },
        },
    }
    update = decode_client_event(json.dumps(message))
    assert isinstance(update, SessionUpdate)
    assert update.unknown_fields == (
        "session.foo",
        "session.audio.input.turn_detection.threshold",  # server_vad's knob, not semantic_vad's
        "session.audio.output.pitch",
        "session.audio.video",
    )
    plain = decode_client_event(_sdk_json("session.update", **SDK_CLIENT_EVENTS["session.update"]))
    assert isinstance(plain, SessionUpdate) and plain.unknown_fields == ()
