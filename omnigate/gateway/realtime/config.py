"""The effective configuration of a realtime session and the rules that change it.

``session.update`` changes only the fields it names; anything the engine cannot honour refuses the whole update
with a typed error and the session keeps its previous configuration. ``response.create`` may override a few fields
for one response, under the same rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import UNSET

from omnigate.gateway.realtime.capabilities import AUDIO_FORMATS, RealtimeCapabilities
from omnigate.gateway.realtime.client_events import (
    AudioFormat,
    ResponseParams,
    SemanticVad,
    ServerVad,
    SessionPatch,
)
from omnigate.gateway.realtime.server_events import (
    WireAudioFormat,
    WireAudioInput,
    WireAudioOutput,
    WireSession,
    WireSessionAudio,
    WireTurnDetection,
)
from omnigate.sessions.realtime_turns import TurnDetectionSettings

PCM_RATE = 24000
MAX_OUTPUT_TOKENS = 4096
MAX_METADATA_KEYS = 16
MIN_SPEED = 0.25
MAX_SPEED = 1.5

VoiceResolver = Callable[[str], str]


class ConfigRefused(Exception):
    """A request the engine or the protocol cannot honour; ``code`` and ``param`` go to the client."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class TurnDetection(msgspec.Struct, frozen=True):
    """Server VAD as configured: the detector's knobs and what a detected turn does."""

    settings: TurnDetectionSettings
    create_response: bool
    interrupt_response: bool


class RealtimeConfig(msgspec.Struct, frozen=True):
    model: str
    voice: str
    turn_detection: TurnDetection | None
    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    speed: float = 1.0
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    max_output_tokens: int | None = None  # None: "inf"


class ResponseSettings(msgspec.Struct, frozen=True):
    """What one response runs with: the session's configuration and this response's overrides."""

    output_modalities: tuple[str, ...]
    voice: str
    output_format: str
    max_output_tokens: int | None
    in_conversation: bool
    metadata: dict[str, str] | None


def default_config(caps: RealtimeCapabilities, model: str) -> RealtimeConfig:
    return RealtimeConfig(
        model=model,
        voice=caps.default_voice,
        turn_detection=TurnDetection(
            settings=TurnDetectionSettings(), create_response=caps.create_response, interrupt_response=True
        ),
    )


def apply_update(
    config: RealtimeConfig,
    patch: SessionPatch,
    caps: RealtimeCapabilities,
    *,
    served_models: frozenset[str],
    resolve_voice: VoiceResolver,
    voice_locked: bool,
) -> RealtimeConfig:
    """The configuration after ``patch``, or ConfigRefused naming the first field the session cannot honour."""
    changes: dict[str, Any] = {}
    if patch.type is not UNSET and patch.type != "realtime":
        raise ConfigRefused("unsupported", f"session type {patch.type!r} is not served; use 'realtime'", "session.type")
    if patch.model is not UNSET and patch.model != config.model:
        if patch.model not in served_models:
            raise ConfigRefused("model_not_found", f"model {patch.model!r} is not served", "session.model")
        changes["model"] = patch.model
    if patch.instructions is not UNSET:
        changes["instructions"] = _instructions(patch.instructions or "", caps, "session.instructions")
    if patch.output_modalities is not UNSET:
        changes["output_modalities"] = _modalities(patch.output_modalities, caps, "session.output_modalities")
    if patch.max_output_tokens is not UNSET:
        changes["max_output_tokens"] = _max_tokens(patch.max_output_tokens, "session.max_output_tokens")
    _refuse_features(patch.tools, patch.tool_choice, "session")
    if patch.include not in (UNSET, None, []):
        raise ConfigRefused(
            "unsupported", "no input transcription is served, so nothing can be included", "session.include"
        )
    if patch.prompt not in (UNSET, None):
        raise ConfigRefused("unsupported", "stored prompts are not served", "session.prompt")
    if patch.reasoning not in (UNSET, None):
        raise ConfigRefused("unsupported", "the engine does not reason", "session.reasoning")
    if patch.audio is not UNSET:
        audio_in = patch.audio.input
        if audio_in is not UNSET:
            if audio_in.format is not UNSET:
                changes["input_format"] = _format(audio_in.format, "session.audio.input.format")
            if audio_in.transcription not in (UNSET, None):
                raise ConfigRefused(
                    "unsupported", "input audio transcription is not served", "session.audio.input.transcription"
                )
            if audio_in.noise_reduction not in (UNSET, None):
                raise ConfigRefused(
                    "unsupported", "input noise reduction is not served", "session.audio.input.noise_reduction"
                )
            if audio_in.turn_detection is not UNSET:
                changes["turn_detection"] = _turn_detection(audio_in.turn_detection, config.turn_detection, caps)
        audio_out = patch.audio.output
        if audio_out is not UNSET:
            if audio_out.format is not UNSET:
                changes["output_format"] = _format(audio_out.format, "session.audio.output.format")
            if audio_out.voice is not UNSET:
                voice = _voice(audio_out.voice, resolve_voice, "session.audio.output.voice")
                if voice != config.voice and voice_locked:
                    raise ConfigRefused(
                        "voice_locked",
                        "the voice cannot change once the session has sent audio",
                        "session.audio.output.voice",
                    )
                changes["voice"] = voice
            if audio_out.speed is not UNSET:
                changes["speed"] = _speed(audio_out.speed, caps)
    return msgspec.structs.replace(config, **changes)


def response_settings(
    config: RealtimeConfig,
    params: ResponseParams | None,
    caps: RealtimeCapabilities,
    resolve_voice: VoiceResolver,
) -> ResponseSettings:
    """The settings of one ``response.create``, or ConfigRefused."""
    settings = ResponseSettings(
        output_modalities=config.output_modalities,
        voice=config.voice,
        output_format=config.output_format,
        max_output_tokens=config.max_output_tokens,
        in_conversation=True,
        metadata=None,
    )
    if params is None:
        return settings
    changes: dict[str, Any] = {}
    if params.conversation not in (None, "auto", "none"):
        raise ConfigRefused("unsupported", "only the default conversation is served", "response.conversation")
    changes["in_conversation"] = params.conversation != "none"
    if params.instructions is not None:
        _instructions(params.instructions, caps, "response.instructions")
    if params.output_modalities is not None:
        changes["output_modalities"] = _modalities(params.output_modalities, caps, "response.output_modalities")
    if params.max_output_tokens is not None:
        changes["max_output_tokens"] = _max_tokens(params.max_output_tokens, "response.max_output_tokens")
    _refuse_features(params.tools, params.tool_choice, "response")
    if params.metadata is not None:
        if len(params.metadata) > MAX_METADATA_KEYS:
            raise ConfigRefused(
                "invalid_value", f"metadata holds at most {MAX_METADATA_KEYS} keys", "response.metadata"
            )
        changes["metadata"] = dict(params.metadata)
    output = params.audio.output if params.audio is not None else None
    if output is not None:
        if output.format is not None:
            changes["output_format"] = _format(output.format, "response.audio.output.format")
        if output.voice is not None:
            voice = _voice(output.voice, resolve_voice, "response.audio.output.voice")
            if voice != config.voice:
                raise ConfigRefused(
                    "unsupported", "a response speaks with the session's voice", "response.audio.output.voice"
                )
    return msgspec.structs.replace(settings, **changes)


def session_object(config: RealtimeConfig, session_id: str, caps: RealtimeCapabilities) -> WireSession:
    """The ``session`` of ``session.created`` and ``session.updated``: the full effective configuration."""
    td = config.turn_detection
    turn = None
    if td is not None:
        turn = WireTurnDetection(
            threshold=td.settings.threshold,
            prefix_padding_ms=td.settings.prefix_padding_ms,
            silence_duration_ms=td.settings.silence_duration_ms,
            create_response=td.create_response,
            interrupt_response=td.interrupt_response,
        )
    return WireSession(
        id=session_id,
        model=config.model,
        output_modalities=list(config.output_modalities),
        instructions=config.instructions,
        audio=WireSessionAudio(
            input=WireAudioInput(format=wire_format(config.input_format), turn_detection=turn),
            output=WireAudioOutput(format=wire_format(config.output_format), voice=config.voice, speed=config.speed),
        ),
        max_output_tokens="inf" if config.max_output_tokens is None else config.max_output_tokens,
        capabilities=caps.wire(),
    )


def wire_format(name: str) -> WireAudioFormat:
    return WireAudioFormat(type=name, rate=PCM_RATE if name == "audio/pcm" else None)


# ---- field rules --------------------------------------------------------------------------------------------------


def _instructions(text: str, caps: RealtimeCapabilities, param: str) -> str:
    if text and not caps.instructions:
        raise ConfigRefused(
            "unsupported",
            f"the {caps.engine} engine takes no instructions; send none (or an empty string)",
            param,
        )
    return text


def _modalities(modalities: list[str], caps: RealtimeCapabilities, param: str) -> tuple[str, ...]:
    if len(modalities) != 1 or modalities[0] not in caps.output_modalities:
        raise ConfigRefused(
            "unsupported",
            f"output_modalities must be one of {[[m] for m in caps.output_modalities]} for the {caps.engine} engine",
            param,
        )
    return (modalities[0],)


def _max_tokens(value: int | str | None, param: str) -> int | None:
    if value is None or value == "inf":
        return None
    if isinstance(value, int) and 1 <= value <= MAX_OUTPUT_TOKENS:
        return value
    raise ConfigRefused("invalid_value", f"max_output_tokens must be 1..{MAX_OUTPUT_TOKENS} or 'inf'", param)


def _refuse_features(tools: Any, tool_choice: Any, scope: str) -> None:
    if tools not in (UNSET, None, []):
        raise ConfigRefused("unsupported", "the engine calls no tools", f"{scope}.tools")
    if tool_choice not in (UNSET, None, "auto", "none"):
        raise ConfigRefused("unsupported", "the engine calls no tools", f"{scope}.tool_choice")


def _format(fmt: AudioFormat, param: str) -> str:
    if fmt.type not in AUDIO_FORMATS:
        raise ConfigRefused("unsupported_format", f"audio format must be one of {list(AUDIO_FORMATS)}", param)
    if fmt.type == "audio/pcm" and fmt.rate not in (None, PCM_RATE):
        raise ConfigRefused("unsupported_format", f"audio/pcm is served at {PCM_RATE} Hz only", param)
    if fmt.type != "audio/pcm" and fmt.rate not in (None, 8000):
        raise ConfigRefused("unsupported_format", f"{fmt.type} is 8000 Hz G.711", param)
    return fmt.type


def _voice(voice: str | dict[str, Any], resolve_voice: VoiceResolver, param: str) -> str:
    name = voice.get("id") if isinstance(voice, dict) else voice
    if not isinstance(name, str) or not name:
        raise ConfigRefused("invalid_value", "voice must be a voice name", param)
    return resolve_voice(name)


def _speed(speed: float, caps: RealtimeCapabilities) -> float:
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise ConfigRefused(
            "invalid_value", f"speed must be within {MIN_SPEED}..{MAX_SPEED}", "session.audio.output.speed"
        )
    if speed != 1.0 and not caps.speed:
        raise ConfigRefused(
            "unsupported", f"the {caps.engine} engine cannot change speed", "session.audio.output.speed"
        )
    return speed


def _turn_detection(
    requested: ServerVad | SemanticVad | None, current: TurnDetection | None, caps: RealtimeCapabilities
) -> TurnDetection | None:
    param = "session.audio.input.turn_detection"
    if requested is None:
        return None
    if isinstance(requested, SemanticVad):
        raise ConfigRefused("unsupported", "semantic_vad is not served; use server_vad", f"{param}.type")
    base = current or TurnDetection(TurnDetectionSettings(), caps.create_response, True)
    settings = base.settings
    knobs: dict[str, Any] = {}
    if requested.threshold is not UNSET:
        if not 0.0 <= requested.threshold <= 1.0:
            raise ConfigRefused("invalid_value", "threshold must be within 0..1", f"{param}.threshold")
        knobs["threshold"] = requested.threshold
    if requested.prefix_padding_ms is not UNSET:
        knobs["prefix_padding_ms"] = requested.prefix_padding_ms
    if requested.silence_duration_ms is not UNSET:
        knobs["silence_duration_ms"] = requested.silence_duration_ms
    create = base.create_response if requested.create_response is UNSET else requested.create_response
    if create != caps.create_response:
        reason = (
            "the duplex model decides itself when to reply"
            if caps.native_duplex
            else f"the {caps.engine} engine composes no replies: it speaks the assistant items you create"
        )
        raise ConfigRefused(
            "unsupported", f"create_response={str(create).lower()} is not served: {reason}", f"{param}.create_response"
        )
    if requested.idle_timeout_ms not in (UNSET, None):
        raise ConfigRefused(
            "unsupported", "idle_timeout_ms needs a model that composes replies on its own", f"{param}.idle_timeout_ms"
        )
    interrupt = base.interrupt_response if requested.interrupt_response is UNSET else requested.interrupt_response
    return TurnDetection(msgspec.structs.replace(settings, **knobs), create, interrupt)
