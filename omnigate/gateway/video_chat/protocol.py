"""The wire protocol of ``WS /v1/video/chat/stream`` (the seeds' live video understanding route).

Client events: ``session.config``, ``video.frame {data}`` (base64 JPEG/PNG), ``audio.chunk {data}`` (base64 s16le
16 kHz mono), ``video.query {text, audio_data?}``, ``video.done``, ``ping``. The seeds' legacy config names
(``num_sample_frames``, ``evs_enabled``, ``evs_threshold``) are accepted. Unknown fields are ignored, as the seeds do.

Server events are written by :func:`event_json`: every ``response.*`` event also carries ``query_id``; audio deltas
are a whole WAV file each (``format: "wav"``, the seeds' way) or raw s16le (``format: "pcm"`` with
``sample_rate``) when ``session.config`` asks for ``audio_format: "pcm"``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

import msgspec

from omnigate.codecs.encoder import complete_wav, streaming_wav_header
from omnigate.gateway.errors import UNDECODABLE, describe_validation_error
from omnigate.gateway.json_budget import CODE as JSON_BUDGET_CODE
from omnigate.gateway.json_budget import json_budget_problem
from omnigate.sessions.video_chat import (
    ChatError,
    ChatEvent,
    Pong,
    ResponseAudioDelta,
    ResponseAudioDone,
    ResponseStart,
    ResponseTextDelta,
    ResponseTextDone,
    SessionDone,
    VideoChatConfig,
)


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: float | None = None
    max_tokens: int | None = None


class SessionConfigEvent(msgspec.Struct, frozen=True, tag="session.config", kw_only=True):
    model: str | None = None
    modalities: list[str] | None = None
    num_frames: int | None = None
    num_sample_frames: int | None = None
    max_frames: int | None = None
    system_prompt: str | None = None
    use_audio_in_video: bool | None = None
    enable_frame_filter: bool | None = None
    evs_enabled: bool | None = None
    frame_filter_threshold: float | None = None
    evs_threshold: float | None = None
    sampling_params_list: list[SamplingParams] | None = None
    audio_format: Literal["wav", "pcm"] | None = None
    voice: str | None = None
    history_budget_tokens: int | None = None
    max_new_tokens: int | None = None


class VideoFrameEvent(msgspec.Struct, frozen=True, tag="video.frame"):
    data: str


class AudioChunkEvent(msgspec.Struct, frozen=True, tag="audio.chunk"):
    data: str


class VideoQueryEvent(msgspec.Struct, frozen=True, tag="video.query"):
    text: str = ""
    audio_data: str | None = None


class VideoDoneEvent(msgspec.Struct, frozen=True, tag="video.done"):
    pass


class PingEvent(msgspec.Struct, frozen=True, tag="ping"):
    pass


ClientEvent = SessionConfigEvent | VideoFrameEvent | AudioChunkEvent | VideoQueryEvent | VideoDoneEvent | PingEvent
_DECODER = msgspec.json.Decoder(ClientEvent)


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def decode_client_event(text: str | bytes) -> ClientEvent:
    """One client event from its JSON text. Raises :class:`ProtocolError`."""
    problem = json_budget_problem(text)
    if problem is not None:
        raise ProtocolError(JSON_BUDGET_CODE, problem)
    try:
        event: ClientEvent = _DECODER.decode(text)
        return event
    except msgspec.ValidationError as exc:
        message, param = describe_validation_error(exc)
        if ("Invalid value" in message and "type" in message) or param == "type":
            raise ProtocolError("unknown_event", f"unknown or missing event type: {message}", "type") from None
        raise ProtocolError("invalid_event", message, param) from None
    except UNDECODABLE as exc:
        raise ProtocolError("invalid_json", f"not a JSON event: {exc}") from None


def check_base64_size(data: str, param: str, limit: int) -> None:
    """Refuse base64 text that would decode to more than ``limit`` bytes (checked before decoding)."""
    if len(data) > limit * 4 // 3 + 4:
        raise ProtocolError("input_too_large", f"{param} exceeds {limit} bytes", param)


def decode_base64(data: str, param: str, limit: int) -> bytes:
    check_base64_size(data, param, limit)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("invalid_base64", f"{param} is not valid base64", param) from None


def merged_config(current: VideoChatConfig, event: SessionConfigEvent) -> VideoChatConfig:
    """``current`` with what ``event`` sets (legacy names where the new ones are absent)."""
    changes: dict[str, Any] = {}

    def pick(name: str, *values: Any) -> None:
        for value in values:
            if value is not None:
                changes[name] = value
                return

    pick("model", event.model)
    if event.modalities is not None:
        changes["modalities"] = tuple(event.modalities)
    pick("num_frames", event.num_frames, event.num_sample_frames)
    pick("max_frames", event.max_frames)
    pick("system_prompt", event.system_prompt)
    pick("use_audio_in_video", event.use_audio_in_video)
    pick("enable_frame_filter", event.enable_frame_filter, event.evs_enabled)
    pick("frame_filter_threshold", event.frame_filter_threshold, event.evs_threshold)
    pick("audio_format", event.audio_format)
    pick("voice", event.voice)
    pick("history_budget_tokens", event.history_budget_tokens)
    sampling = event.sampling_params_list[0] if event.sampling_params_list else None
    pick("max_new_tokens", event.max_new_tokens, sampling.max_tokens if sampling else None)
    pick("temperature", sampling.temperature if sampling else None)
    return msgspec.structs.replace(current, **changes)


def event_json(event: ChatEvent, audio_format: str) -> dict[str, Any]:
    """The wire form of a session event."""
    if isinstance(event, ResponseStart):
        return {"type": "response.start", "query_id": event.query, "frames": event.frames}
    if isinstance(event, ResponseTextDelta):
        return {"type": "response.text.delta", "query_id": event.query, "delta": event.delta}
    if isinstance(event, ResponseTextDone):
        return {"type": "response.text.done", "query_id": event.query, "text": event.text, "status": event.status}
    if isinstance(event, ResponseAudioDelta):
        wav = audio_format != "pcm"
        data = complete_wav(streaming_wav_header(event.sample_rate) + event.pcm) if wav else event.pcm
        return {
            "type": "response.audio.delta",
            "query_id": event.query,
            "data": base64.b64encode(data).decode(),
            "format": audio_format,
            "sample_rate": event.sample_rate,
        }
    if isinstance(event, ResponseAudioDone):
        return {"type": "response.audio.done", "query_id": event.query, "status": event.status}
    if isinstance(event, Pong):
        return {"type": "pong"}
    if isinstance(event, SessionDone):
        return {"type": "session.done", "reason": event.reason}
    assert isinstance(event, ChatError)
    body: dict[str, Any] = {"type": "error", "code": event.code, "message": event.message}
    if event.param is not None:
        body["param"] = event.param
    if event.fatal:
        body["fatal"] = True
    return body
