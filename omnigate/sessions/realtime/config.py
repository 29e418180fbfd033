"""The effective configuration of a realtime session and the rules that change it.

``session.update`` changes only the fields it names. Agent frameworks send a full session (instructions, tools,
temperature, transcription, semantic VAD, ...) whatever the model behind it: what the engine does not act on is
accepted, kept, echoed in ``session.updated`` and named in ``session.unused_fields``, and so is every field the server
does not read at all (``session.foo``). The beta protocol's names of GA fields (``voice``, ``modalities``,
``input_audio_format``, ``output_audio_format``), which the openai SDK's beta realtime client still sends, are served
as those GA fields; beside the GA field itself they are unused. Only what would change what the client hears in a way
the engine cannot honour (an unknown voice, an output format or rate, a speed, text-only output from a speech engine)
refuses the whole update with a typed error, and the session keeps its previous configuration.
``response.create`` may override a few fields for one response, under the same rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from omnigate.engines.base import unknown_voice_message
from omnigate.sessions.realtime.capabilities import AUDIO_FORMATS, RealtimeCapabilities
from omnigate.sessions.realtime.client_events import (
    AudioFormat,
    AudioInputPatch,
    AudioOutputPatch,
    AudioPatch,
    ResponseParams,
    SemanticVad,
    ServerVad,
    SessionPatch,
)
from omnigate.sessions.realtime.server_events import (
    WireAudioFormat,
    WireAudioInput,
    WireAudioOutput,
    WireSession,
    WireSessionAudio,
    WireTurnDetection,
)
from omnigate.sessions.realtime.turns import TurnDetectionSettings

PCM_RATE = 24000
MAX_OUTPUT_TOKENS = 4096
MAX_METADATA_KEYS = 16
MIN_SPEED = 0.25
MAX_SPEED = 1.5
MAX_IGNORED_FIELDS = 64
"""Unread fields a session remembers for ``session.unused_fields``: a bound on what a client's updates can grow."""
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}

VoiceResolver = Callable[[str], str]


class ConfigRefused(Exception):
    """A request the engine or the protocol cannot honour; ``code`` and ``param`` go to the client."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class TurnDetection(msgspec.Struct, frozen=True):
    """Server VAD as configured: the detector's knobs and what a detected turn does.

    ``unused`` names what the client asked for that the engine serves otherwise (semantic VAD is served by the
    server VAD; a ``create_response`` the engine cannot follow keeps the engine's own behaviour).
    """

    settings: TurnDetectionSettings
    create_response: bool
    interrupt_response: bool
    unused: tuple[str, ...] = ()


class Passthrough(msgspec.Struct, frozen=True):
    """Session fields kept as the client sent them and echoed back; the engine behind the session may not use them."""

    tools: tuple[Any, ...] = ()
    tool_choice: str | dict[str, Any] = "auto"
    temperature: float | None = None
    include: tuple[str, ...] | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    tracing: str | dict[str, Any] | None = None
    truncation: str | dict[str, Any] = "auto"
    transcription: dict[str, Any] | None = None
    noise_reduction: dict[str, Any] | None = None


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
    passthrough: Passthrough = Passthrough()
    ignored: tuple[str, ...] = ()
    """Fields the client set that the server does not read (or a beta name beside its GA field), as parameter paths."""


class ResponseSettings(msgspec.Struct, frozen=True):
    """What one response runs with: the session's configuration and this response's overrides."""

    output_modalities: tuple[str, ...]
    voice: str
    output_format: str
    max_output_tokens: int | None
    in_conversation: bool
    metadata: dict[str, str] | None


def server_response_settings(config: RealtimeConfig) -> ResponseSettings:
    """A response the server starts itself (a detected turn, a duplex model speaking) runs with the session's
    settings."""
    return ResponseSettings(
        output_modalities=config.output_modalities,
        voice=config.voice,
        output_format=config.output_format,
        max_output_tokens=config.max_output_tokens,
        in_conversation=True,
        metadata=None,
    )


def default_config(caps: RealtimeCapabilities, model: str) -> RealtimeConfig:
    """A new session's configuration: server VAD on a turn-based engine; none on a natively duplex model, which
    listens while it speaks and takes its own turns (server VAD there would cancel the model's replies whenever the
    user talks over them, and score every session's audio for nothing). A duplex client that wants the speech
    events or server barge-in enables ``server_vad`` with ``session.update``."""
    turn_detection = None
    if not caps.native_duplex:
        turn_detection = TurnDetection(
            settings=TurnDetectionSettings(), create_response=caps.create_response, interrupt_response=True
        )
    return RealtimeConfig(model=model, voice=caps.default_voice, turn_detection=turn_detection)


def apply_update(
    config: RealtimeConfig,
    patch: SessionPatch,
    caps: RealtimeCapabilities,
    *,
    served_models: frozenset[str],
    resolve_voice: VoiceResolver,
    voice_locked: bool,
    unknown: tuple[str, ...] = (),
) -> RealtimeConfig:
    """The configuration after ``patch``, or ConfigRefused naming the first field the session cannot honour.
    ``unknown`` names the fields of the update that ``patch`` could not read."""
    changes: dict[str, Any] = {}
    ignored = list(unknown)
    audio = patch.audio if patch.audio is not UNSET else AudioPatch()
    audio_in = audio.input if audio.input is not UNSET else AudioInputPatch()
    audio_out = audio.output if audio.output is not UNSET else AudioOutputPatch()
    modalities, modalities_param = _ga_or_beta(
        patch.output_modalities,
        "session.output_modalities",
        _beta_modalities(patch.modalities),
        "session.modalities",
        ignored,
    )
    input_format, input_format_param = _ga_or_beta(
        audio_in.format,
        "session.audio.input.format",
        _beta_format(patch.input_audio_format, "session.input_audio_format"),
        "session.input_audio_format",
        ignored,
    )
    output_format, output_format_param = _ga_or_beta(
        audio_out.format,
        "session.audio.output.format",
        _beta_format(patch.output_audio_format, "session.output_audio_format"),
        "session.output_audio_format",
        ignored,
    )
    voice_value, voice_param = _ga_or_beta(
        audio_out.voice, "session.audio.output.voice", patch.voice, "session.voice", ignored
    )
    if patch.type is not UNSET and patch.type != "realtime":
        raise ConfigRefused("unsupported", f"session type {patch.type!r} is not served; use 'realtime'", "session.type")
    if patch.model is not UNSET and patch.model != config.model:
        if patch.model not in served_models:
            raise ConfigRefused("model_not_found", f"model {patch.model!r} is not served", "session.model")
        changes["model"] = patch.model
    if patch.instructions is not UNSET:
        changes["instructions"] = patch.instructions or ""
    if modalities is not UNSET:
        changes["output_modalities"] = _modalities(modalities, caps, modalities_param)
    if patch.max_output_tokens is not UNSET:
        changes["max_output_tokens"] = _max_tokens(patch.max_output_tokens, "session.max_output_tokens")
    kept: dict[str, Any] = {}
    if patch.tools is not UNSET:
        kept["tools"] = tuple(patch.tools or ())
    if patch.tool_choice is not UNSET:
        kept["tool_choice"] = patch.tool_choice if patch.tool_choice is not None else "auto"
    if patch.temperature is not UNSET:
        kept["temperature"] = patch.temperature
    if patch.include is not UNSET:
        kept["include"] = tuple(patch.include) if patch.include is not None else None
    for name in ("prompt", "reasoning", "tracing"):
        value = getattr(patch, name)
        if value is not UNSET:
            kept[name] = value
    if patch.truncation is not UNSET:
        kept["truncation"] = patch.truncation if patch.truncation is not None else "auto"
    if input_format is not UNSET:
        changes["input_format"] = _format(input_format, input_format_param)
    if audio_in.transcription is not UNSET:
        kept["transcription"] = audio_in.transcription
    if audio_in.noise_reduction is not UNSET:
        kept["noise_reduction"] = audio_in.noise_reduction
    if audio_in.turn_detection is not UNSET:
        changes["turn_detection"] = _turn_detection(audio_in.turn_detection, config.turn_detection, caps)
    if output_format is not UNSET:
        changes["output_format"] = _format(output_format, output_format_param)
    if voice_value is not UNSET:
        voice = _voice(voice_value, resolve_voice, caps, voice_param)
        if voice != config.voice and voice_locked:
            raise ConfigRefused("voice_locked", "the voice cannot change once the session has sent audio", voice_param)
        changes["voice"] = voice
    if audio_out.speed is not UNSET:
        changes["speed"] = _speed(audio_out.speed, caps)
    if kept:
        changes["passthrough"] = msgspec.structs.replace(config.passthrough, **kept)
    if ignored:
        changes["ignored"] = tuple(dict.fromkeys([*config.ignored, *ignored]))[:MAX_IGNORED_FIELDS]
    return msgspec.structs.replace(config, **changes)


def unused_fields(config: RealtimeConfig, caps: RealtimeCapabilities) -> list[str]:
    """The session fields the client set that the engine behind the session does not act on, as parameter paths."""
    kept = config.passthrough
    unused: list[str] = []
    if config.instructions and not caps.instructions:
        unused.append("session.instructions")
    if not caps.tools:
        if kept.tools:
            unused.append("session.tools")
        if kept.tool_choice not in ("auto", "none"):
            unused.append("session.tool_choice")
    if kept.temperature is not None and not caps.temperature:
        unused.append("session.temperature")
    if not caps.input_transcription:
        if kept.include:
            unused.append("session.include")
        if kept.transcription is not None:
            unused.append("session.audio.input.transcription")
    for name in ("prompt", "reasoning", "tracing"):
        if getattr(kept, name) is not None:
            unused.append(f"session.{name}")
    if kept.truncation != "auto":
        unused.append("session.truncation")
    if kept.noise_reduction is not None:
        unused.append("session.audio.input.noise_reduction")
    if config.turn_detection is not None:
        unused.extend(config.turn_detection.unused)
    unused.extend(config.ignored)
    return unused


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
    # response.instructions, tools, tool_choice and temperature are accepted like the session's: a response speaks
    # its input items, which these do not change on an engine that composes no text of its own.
    if params.output_modalities is not None:
        changes["output_modalities"] = _modalities(params.output_modalities, caps, "response.output_modalities")
    if params.max_output_tokens is not None:
        changes["max_output_tokens"] = _max_tokens(params.max_output_tokens, "response.max_output_tokens")
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
            voice = _voice(output.voice, resolve_voice, caps, "response.audio.output.voice")
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
    kept = config.passthrough
    return WireSession(
        id=session_id,
        model=config.model,
        output_modalities=list(config.output_modalities),
        instructions=config.instructions,
        audio=WireSessionAudio(
            input=WireAudioInput(
                format=wire_format(config.input_format),
                turn_detection=turn,
                transcription=kept.transcription,
                noise_reduction=kept.noise_reduction,
            ),
            output=WireAudioOutput(format=wire_format(config.output_format), voice=config.voice, speed=config.speed),
        ),
        max_output_tokens="inf" if config.max_output_tokens is None else config.max_output_tokens,
        capabilities=caps.wire(),
        unused_fields=unused_fields(config, caps),
        tools=list(kept.tools),
        tool_choice=kept.tool_choice,
        temperature=kept.temperature,
        include=list(kept.include) if kept.include is not None else None,
        prompt=kept.prompt,
        reasoning=kept.reasoning,
        tracing=kept.tracing,
        truncation=kept.truncation,
    )


def wire_format(name: str) -> WireAudioFormat:
    return WireAudioFormat(type=name, rate=PCM_RATE if name == "audio/pcm" else None)


# ---- field rules --------------------------------------------------------------------------------------------------


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


def _format(fmt: AudioFormat, param: str) -> str:
    if fmt.type not in AUDIO_FORMATS:
        raise ConfigRefused("unsupported_format", f"audio format must be one of {list(AUDIO_FORMATS)}", param)
    if fmt.type == "audio/pcm" and fmt.rate not in (None, PCM_RATE):
        raise ConfigRefused("unsupported_format", f"audio/pcm is served at {PCM_RATE} Hz only", param)
    if fmt.type != "audio/pcm" and fmt.rate not in (None, 8000):
        raise ConfigRefused("unsupported_format", f"{fmt.type} is 8000 Hz G.711", param)
    return fmt.type


def _voice(voice: str | dict[str, Any], resolve_voice: VoiceResolver, caps: RealtimeCapabilities, param: str) -> str:
    name = voice.get("id") if isinstance(voice, dict) else voice
    if not isinstance(name, str) or not name:
        raise ConfigRefused("invalid_value", "voice must be a voice name", param)
    resolved = resolve_voice(name)
    if resolved not in caps.voices:
        raise ConfigRefused("unknown_voice", unknown_voice_message(name, caps.voices, caps.voice_aliases), param)
    return resolved


def _ga_or_beta(ga: Any, ga_param: str, beta: Any, beta_param: str, ignored: list[str]) -> tuple[Any, str]:
    """The GA field's value and name when the client set it, else its beta-shaped equivalent's; a beta field sent
    beside its GA field is not used."""
    if beta is UNSET:
        return ga, ga_param
    if ga is not UNSET:
        ignored.append(beta_param)
        return ga, ga_param
    return beta, beta_param


def _beta_modalities(modalities: list[str] | UnsetType) -> list[str] | UnsetType:
    """Beta ``["text", "audio"]`` is GA's ``["audio"]`` (audio comes with its transcript); ``["text"]`` is text."""
    if modalities is UNSET or "audio" not in modalities or not set(modalities) <= {"audio", "text"}:
        return modalities
    return ["audio"]


def _beta_format(name: str | UnsetType, param: str) -> AudioFormat | UnsetType:
    if name is UNSET:
        return UNSET
    if name not in BETA_FORMATS:
        raise ConfigRefused("unsupported_format", f"audio format must be one of {list(BETA_FORMATS)}", param)
    return AudioFormat(type=BETA_FORMATS[name])


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
    base = current or TurnDetection(TurnDetectionSettings(), caps.create_response, True)
    unused: list[str] = []
    interrupt = base.interrupt_response if requested.interrupt_response is UNSET else requested.interrupt_response
    create = base.create_response if requested.create_response is UNSET else requested.create_response
    if create != caps.create_response:
        if caps.native_duplex:
            # A duplex model replies when it decides to: the client would hear replies it asked not to get.
            raise ConfigRefused(
                "unsupported",
                "create_response=false is not served: the duplex model decides itself when to reply",
                f"{param}.create_response",
            )
        unused.append(f"{param}.create_response")  # the engine speaks the assistant items the client creates
    if isinstance(requested, SemanticVad):
        # Served by the server VAD with its current knobs: the turn ends on silence rather than on meaning.
        unused.append(f"{param}.type")
        if requested.eagerness is not UNSET:
            unused.append(f"{param}.eagerness")
        return TurnDetection(base.settings, caps.create_response, interrupt, tuple(unused))
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
    if requested.idle_timeout_ms not in (UNSET, None):
        unused.append(f"{param}.idle_timeout_ms")  # needs a model that composes replies on its own
    return TurnDetection(msgspec.structs.replace(settings, **knobs), caps.create_response, interrupt, tuple(unused))
