"""Wire events of ``WS /v1/audio/speech/stream`` (compatible with vllm-omni's streaming speech clients)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from omnigate.engines.base import EngineInfo
from omnigate.gateway.errors import UNDECODABLE
from omnigate.gateway.speech.voices import resolve_voice
from omnigate.sessions.messages import SessionConfig
from omnigate.sessions.segmenter import SegmenterConfig
from omnigate.sessions.speech import ConfigError


class SessionConfigEvent(msgspec.Struct, tag="session.config", forbid_unknown_fields=True, kw_only=True):
    """``session.config``: the fields vllm-omni's clients send, plus our own."""

    model: str | None = None
    voice: str | None = None
    speaker: str | None = None  # vllm-omni's alias of voice
    response_format: str = "wav"
    sample_rate: int | None = None
    language: str | None = None
    instructions: str | None = None
    speed: float = 1.0
    split_granularity: Literal["sentence", "clause"] = "sentence"
    stream_audio: bool = False
    task_type: str | None = None
    max_new_tokens: int | None = None
    initial_codec_chunk_frames: int | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    speaker_embedding: list[float] | None = None


class InputText(msgspec.Struct, tag="input.text", forbid_unknown_fields=True):
    text: str


class InputDone(msgspec.Struct, tag="input.done", forbid_unknown_fields=True):
    pass


class InputCancel(msgspec.Struct, tag="input.cancel", forbid_unknown_fields=True):
    pass


class SessionCloseEvent(msgspec.Struct, tag="session.close", forbid_unknown_fields=True):
    pass


ClientEvent = SessionConfigEvent | InputText | InputDone | InputCancel | SessionCloseEvent
CLIENT_EVENT_TYPES = ("session.config", "input.text", "input.done", "input.cancel", "session.close")

# A codec frame of the Qwen3-TTS family is 80 ms; vllm-omni clients bound length with max_new_tokens in frames.
MS_PER_CODEC_FRAME = 80


def decode_client_event(raw: bytes | str) -> ClientEvent:
    """Parse one client event; raises msgspec errors for bad JSON, unknown types and bad fields."""
    event: ClientEvent = msgspec.json.decode(raw, type=ClientEvent)
    return event


class _TypeEnvelope(msgspec.Struct):
    type: Any = None


def event_type_of(raw: bytes | str) -> Any:
    """The ``type`` field of a JSON object, or None, to word errors for unknown event types. Read into an envelope of
    that one field, so the rest of the message is skipped, not built."""
    try:
        return msgspec.json.decode(raw, type=_TypeEnvelope).type
    except (*UNDECODABLE, msgspec.ValidationError):
        return None


def to_session_config(
    event: SessionConfigEvent,
    info: EngineInfo,
    *,
    served_models: frozenset[str],
    max_audio_ms: int,
    segment_max_chars: int,
    segment_max_wait_ms: float,
) -> SessionConfig:
    """Check the fields the engine cannot honour and build the session config. Raises ConfigError."""
    if event.model is not None and event.model not in served_models:
        raise ConfigError("model_not_found", f"model {event.model!r} is not served", "model")
    caps = info.capabilities
    if event.task_type not in (None, "CustomVoice"):
        raise ConfigError(
            "unsupported",
            f"task_type {event.task_type!r} is not supported by the {info.family} engine",
            "task_type",
        )
    for name in ("ref_audio", "ref_text", "x_vector_only_mode", "speaker_embedding"):
        if getattr(event, name) is not None and not caps.reference_audio:
            raise ConfigError("unsupported", f"the {info.family} engine does not take {name}", name)
    if event.initial_codec_chunk_frames is not None and info.family != "talker":
        raise ConfigError(
            "unsupported",
            f"initial_codec_chunk_frames applies to codec talkers, not the {info.family} engine",
            "initial_codec_chunk_frames",
        )
    if event.sample_rate is not None and not 8000 <= event.sample_rate <= 48000:
        raise ConfigError("invalid_sample_rate", "sample_rate must be between 8000 and 48000", "sample_rate")
    if event.max_new_tokens is not None:
        if event.max_new_tokens < 1:
            raise ConfigError("invalid_value", "max_new_tokens must be at least 1", "max_new_tokens")
        max_audio_ms = min(max_audio_ms, event.max_new_tokens * MS_PER_CODEC_FRAME)
    voice = resolve_voice(info, event.voice if event.voice is not None else event.speaker)
    return SessionConfig(
        voice=voice,
        speed=event.speed,
        language=event.language,
        instructions=event.instructions,
        max_audio_ms=max_audio_ms,
        segmenter=SegmenterConfig(
            granularity=event.split_granularity,
            max_chars=segment_max_chars,
            max_wait_ms=segment_max_wait_ms,
        ),
    )
