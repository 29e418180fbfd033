"""Server events of the OpenAI Realtime protocol (GA names), as the gateway emits them.

Each struct encodes to JSON that the ``openai`` package's ``RealtimeServerEvent`` models validate; the tests check
every event the server sends against them. Every event carries an ``event_id``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

ItemStatus = Literal["completed", "incomplete", "in_progress"]
ResponseStatus = Literal["completed", "cancelled", "failed", "incomplete", "in_progress"]


# ---- objects ------------------------------------------------------------------------------------------------------


class WireContent(msgspec.Struct, frozen=True, omit_defaults=True):
    type: str
    text: str | None = None
    transcript: str | None = None


class WireItem(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A conversation item: a message carries ``role`` and ``content``, a function call ``call_id``, ``name`` and
    ``arguments``, a function call's output ``call_id`` and ``output``."""

    id: str
    type: str
    object: str
    status: ItemStatus
    role: str | None = None
    content: list[WireContent] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class WireAudioFormat(msgspec.Struct, frozen=True, omit_defaults=True):
    type: str
    rate: int | None = None


class WireTurnDetection(msgspec.Struct, frozen=True):
    threshold: float
    prefix_padding_ms: int
    silence_duration_ms: int
    create_response: bool
    interrupt_response: bool
    idle_timeout_ms: int | None = None
    type: str = "server_vad"


class WireAudioInput(msgspec.Struct, frozen=True):
    format: WireAudioFormat
    turn_detection: WireTurnDetection | None
    transcription: dict[str, Any] | None = None
    noise_reduction: dict[str, Any] | None = None


class WireAudioOutput(msgspec.Struct, frozen=True):
    format: WireAudioFormat
    voice: str
    speed: float


class WireSessionAudio(msgspec.Struct, frozen=True):
    input: WireAudioInput
    output: WireAudioOutput


class WireCapabilities(msgspec.Struct, frozen=True):
    """What the engine behind this session can do (an omnigate extension of the session object)."""

    engine: str
    native_duplex: bool
    speaks_text_items: bool
    server_vad: bool
    semantic_vad: bool
    interrupt_response: bool
    create_response: bool
    client_commit: bool
    audio_truncate: bool
    input_transcription: bool
    tools: bool
    voices: list[str]
    output_modalities: list[str]
    audio_formats: list[str]
    answers_turns: bool = False  # the engine answers the user's turns itself (no LLM of the client's)


class WireSession(msgspec.Struct, frozen=True):
    id: str
    model: str
    output_modalities: list[str]
    instructions: str
    audio: WireSessionAudio
    max_output_tokens: int | str
    capabilities: WireCapabilities
    # The fields set on this session that its engine does not act on (an omnigate extension), as parameter paths.
    unused_fields: list[str] = []
    tools: list[Any] = []
    tool_choice: str | dict[str, Any] = "auto"
    temperature: float | None = None
    tracing: str | dict[str, Any] | None = None
    truncation: str | dict[str, Any] = "auto"
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    type: str = "realtime"
    object: str = "realtime.session"


class WireCachedDetails(msgspec.Struct, frozen=True):
    text_tokens: int = 0
    audio_tokens: int = 0
    image_tokens: int = 0


class WireInputDetails(msgspec.Struct, frozen=True):
    text_tokens: int
    audio_tokens: int
    image_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: WireCachedDetails = WireCachedDetails()


class WireOutputDetails(msgspec.Struct, frozen=True):
    text_tokens: int
    audio_tokens: int


class WireUsage(msgspec.Struct, frozen=True):
    total_tokens: int
    input_tokens: int
    output_tokens: int
    input_token_details: WireInputDetails
    output_token_details: WireOutputDetails


class WireStatusError(msgspec.Struct, frozen=True):
    type: str
    code: str
    message: str


class WireStatusDetails(msgspec.Struct, frozen=True, omit_defaults=True):
    type: str
    reason: str | None = None
    error: WireStatusError | None = None


class WireResponseAudioOutput(msgspec.Struct, frozen=True):
    format: WireAudioFormat
    voice: str


class WireResponseAudio(msgspec.Struct, frozen=True):
    output: WireResponseAudioOutput


class WireResponse(msgspec.Struct, frozen=True):
    id: str
    status: ResponseStatus
    status_details: WireStatusDetails | None
    output: list[WireItem]
    conversation_id: str | None
    output_modalities: list[str]
    audio: WireResponseAudio
    max_output_tokens: int | str
    metadata: dict[str, str] | None
    usage: WireUsage | None
    object: str = "realtime.response"


class WirePart(msgspec.Struct, frozen=True, omit_defaults=True):
    type: str
    text: str | None = None
    transcript: str | None = None


class WireError(msgspec.Struct, frozen=True):
    type: str
    code: str
    message: str
    param: str | None = None
    event_id: str | None = None


# ---- events -------------------------------------------------------------------------------------------------------


class ServerEvent(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    event_id: str


class ErrorEvent(ServerEvent, frozen=True, tag="error"):
    error: WireError


class SessionCreated(ServerEvent, frozen=True, tag="session.created"):
    session: WireSession


class SessionUpdated(ServerEvent, frozen=True, tag="session.updated"):
    session: WireSession


class SpeechStarted(ServerEvent, frozen=True, tag="input_audio_buffer.speech_started"):
    audio_start_ms: int
    item_id: str


class SpeechStopped(ServerEvent, frozen=True, tag="input_audio_buffer.speech_stopped"):
    audio_end_ms: int
    item_id: str


class InputCommitted(ServerEvent, frozen=True, tag="input_audio_buffer.committed"):
    item_id: str
    previous_item_id: str | None


class InputCleared(ServerEvent, frozen=True, tag="input_audio_buffer.cleared"):
    pass


class ItemAdded(ServerEvent, frozen=True, tag="conversation.item.added"):
    item: WireItem
    previous_item_id: str | None


class ItemDone(ServerEvent, frozen=True, tag="conversation.item.done"):
    item: WireItem
    previous_item_id: str | None


class ItemTruncated(ServerEvent, frozen=True, tag="conversation.item.truncated"):
    item_id: str
    content_index: int
    audio_end_ms: int


class ItemDeleted(ServerEvent, frozen=True, tag="conversation.item.deleted"):
    item_id: str


class ItemRetrieved(ServerEvent, frozen=True, tag="conversation.item.retrieved"):
    item: WireItem


class ResponseCreated(ServerEvent, frozen=True, tag="response.created"):
    response: WireResponse


class ResponseDone(ServerEvent, frozen=True, tag="response.done"):
    response: WireResponse


class OutputItemAdded(ServerEvent, frozen=True, tag="response.output_item.added"):
    response_id: str
    output_index: int
    item: WireItem


class OutputItemDone(ServerEvent, frozen=True, tag="response.output_item.done"):
    response_id: str
    output_index: int
    item: WireItem


class ContentPartAdded(ServerEvent, frozen=True, tag="response.content_part.added"):
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    part: WirePart


class ContentPartDone(ServerEvent, frozen=True, tag="response.content_part.done"):
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    part: WirePart


class AudioDelta(ServerEvent, frozen=True, tag="response.output_audio.delta"):
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    delta: str


class AudioDone(ServerEvent, frozen=True, tag="response.output_audio.done"):
    response_id: str
    item_id: str
    output_index: int
    content_index: int


class TranscriptDelta(ServerEvent, frozen=True, tag="response.output_audio_transcript.delta"):
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    delta: str


class TranscriptDone(ServerEvent, frozen=True, tag="response.output_audio_transcript.done"):
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    transcript: str


class TextDelta(ServerEvent, frozen=True, tag="response.output_text.delta"):
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    delta: str


class TextDone(ServerEvent, frozen=True, tag="response.output_text.done"):
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    text: str


class OutputAudioCleared(ServerEvent, frozen=True, tag="output_audio_buffer.cleared"):
    response_id: str


class FunctionCallArgumentsDelta(ServerEvent, frozen=True, tag="response.function_call_arguments.delta"):
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    delta: str


class FunctionCallArgumentsDone(ServerEvent, frozen=True, tag="response.function_call_arguments.done"):
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    name: str
    arguments: str


class WireTranscriptionUsage(msgspec.Struct, frozen=True):
    """A transcription's usage, as the seconds of audio transcribed."""

    seconds: float
    type: str = "duration"


class TranscriptionCompleted(ServerEvent, frozen=True, tag="conversation.item.input_audio_transcription.completed"):
    item_id: str
    content_index: int
    transcript: str
    usage: WireTranscriptionUsage


class WireTranscriptionError(msgspec.Struct, frozen=True):
    type: str
    code: str
    message: str


class TranscriptionFailed(ServerEvent, frozen=True, tag="conversation.item.input_audio_transcription.failed"):
    item_id: str
    content_index: int
    error: WireTranscriptionError


AnyServerEvent = (
    ErrorEvent
    | SessionCreated
    | SessionUpdated
    | SpeechStarted
    | SpeechStopped
    | InputCommitted
    | InputCleared
    | ItemAdded
    | ItemDone
    | ItemTruncated
    | ItemDeleted
    | ItemRetrieved
    | ResponseCreated
    | ResponseDone
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | AudioDelta
    | AudioDone
    | TranscriptDelta
    | TranscriptDone
    | TextDelta
    | TextDone
    | OutputAudioCleared
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | TranscriptionCompleted
    | TranscriptionFailed
)

_ENCODER = msgspec.json.Encoder()


def encode_event(event: ServerEvent) -> bytes:
    """JSON bytes of one server event."""
    return _ENCODER.encode(event)
