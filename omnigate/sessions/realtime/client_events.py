"""Client events of the OpenAI Realtime protocol (GA names), as the session core takes them.

Shapes follow the ``openai`` package's models (``openai/types/realtime/``). Fields agent frameworks send whether or
not the engine acts on them (tools, temperature, transcription, noise reduction, ...) are declared, so a session keeps
and echoes them and names the ones its engine does not use (``session.unused_fields``). The beta protocol's names that
the openai SDK's beta realtime client still sends and that have a GA place (``voice``, ``modalities``,
``input_audio_format``, ``output_audio_format``) are declared too, and served there. Any other field of a
``session.update``'s session is not read: :func:`unknown_session_fields` names it, for ``session.unused_fields``.
Other events' unknown fields are ignored, as OpenAI's server ignores them. ``UNSET`` marks a field the client left out,
which ``session.update`` leaves unchanged (``null`` clears, per the protocol).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import msgspec.inspect
from msgspec import UNSET, UnsetType

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class AudioFormat(msgspec.Struct, frozen=True):
    """``{"type": "audio/pcm", "rate": 24000}``, ``{"type": "audio/pcmu"}`` or ``{"type": "audio/pcma"}``."""

    type: str = "audio/pcm"
    rate: int | None = None


class ServerVad(msgspec.Struct, frozen=True, tag="server_vad", tag_field="type"):
    threshold: float | UnsetType = UNSET
    prefix_padding_ms: NonNegative | UnsetType = UNSET
    silence_duration_ms: NonNegative | UnsetType = UNSET
    create_response: bool | UnsetType = UNSET
    interrupt_response: bool | UnsetType = UNSET
    idle_timeout_ms: int | UnsetType | None = UNSET


class SemanticVad(msgspec.Struct, frozen=True, tag="semantic_vad", tag_field="type"):
    eagerness: str | UnsetType = UNSET
    create_response: bool | UnsetType = UNSET
    interrupt_response: bool | UnsetType = UNSET


class AudioInputPatch(msgspec.Struct, frozen=True):
    format: AudioFormat | UnsetType = UNSET
    turn_detection: ServerVad | SemanticVad | UnsetType | None = UNSET
    transcription: dict[str, Any] | UnsetType | None = UNSET
    noise_reduction: dict[str, Any] | UnsetType | None = UNSET


class AudioOutputPatch(msgspec.Struct, frozen=True):
    format: AudioFormat | UnsetType = UNSET
    voice: str | dict[str, Any] | UnsetType = UNSET
    speed: float | UnsetType = UNSET


class AudioPatch(msgspec.Struct, frozen=True):
    input: AudioInputPatch | UnsetType = UNSET
    output: AudioOutputPatch | UnsetType = UNSET


class SessionPatch(msgspec.Struct, frozen=True):
    """The ``session`` of ``session.update``: only the fields present change."""

    type: str | UnsetType = UNSET
    model: str | UnsetType = UNSET
    instructions: str | UnsetType | None = UNSET
    output_modalities: list[str] | UnsetType = UNSET
    audio: AudioPatch | UnsetType = UNSET
    max_output_tokens: int | str | UnsetType | None = UNSET
    tools: list[Any] | UnsetType | None = UNSET
    tool_choice: str | dict[str, Any] | UnsetType | None = UNSET
    include: list[str] | UnsetType | None = UNSET
    prompt: dict[str, Any] | UnsetType | None = UNSET
    reasoning: dict[str, Any] | UnsetType | None = UNSET
    temperature: float | UnsetType | None = UNSET
    tracing: str | dict[str, Any] | UnsetType | None = UNSET
    truncation: str | dict[str, Any] | UnsetType | None = UNSET
    # The beta protocol's names of GA fields: audio.output.voice, output_modalities, audio.input.format and
    # audio.output.format (its formats are "pcm16", "g711_ulaw" and "g711_alaw").
    voice: str | dict[str, Any] | UnsetType = UNSET
    modalities: list[str] | UnsetType = UNSET
    input_audio_format: str | UnsetType = UNSET
    output_audio_format: str | UnsetType = UNSET


_SESSION_PATCH_TYPE = msgspec.inspect.type_info(SessionPatch)


def unknown_session_fields(session: Any) -> list[str]:
    """The fields of a ``session.update``'s ``session`` (as decoded JSON) that :class:`SessionPatch` does not read,
    as parameter paths (``session.foo``, ``session.audio.output.bar``). Free-form values (tools, transcription, ...)
    are kept whole, so nothing inside them is named."""
    unknown: list[str] = []
    _collect_unknown(session, _SESSION_PATCH_TYPE, "session", unknown)
    return unknown


def _collect_unknown(value: Any, kind: msgspec.inspect.Type, path: str, unknown: list[str]) -> None:
    if not isinstance(value, dict):
        return
    choices = kind.types if isinstance(kind, msgspec.inspect.UnionType) else (kind,)
    structs = [choice for choice in choices if isinstance(choice, msgspec.inspect.StructType)]
    if not structs:
        return
    # A tagged union (server_vad | semantic_vad) is read as the member its tag names.
    struct = next((s for s in structs if s.tag_field is not None and value.get(s.tag_field) == s.tag), structs[0])
    fields = {field.encode_name: field for field in struct.fields}
    for key, item in value.items():
        if key == struct.tag_field:
            continue
        field = fields.get(key)
        if field is None:
            unknown.append(f"{path}.{key}")
        else:
            _collect_unknown(item, field.type, f"{path}.{key}", unknown)


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None
    audio: str | None = None
    transcript: str | None = None


class ItemSpec(msgspec.Struct, frozen=True):
    """An item a client creates (``conversation.item.create``) or passes as ``response.input``."""

    type: str = "message"
    id: str | None = None
    role: str | None = None
    content: list[ContentPart] = []
    status: str | None = None
    call_id: str | None = None  # function_call and function_call_output items
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class ResponseAudioOutput(msgspec.Struct, frozen=True):
    format: AudioFormat | None = None
    voice: str | dict[str, Any] | None = None


class ResponseAudio(msgspec.Struct, frozen=True):
    output: ResponseAudioOutput | None = None


class ResponseParams(msgspec.Struct, frozen=True):
    conversation: str | None = None
    input: list[ItemSpec] | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    output_modalities: list[str] | None = None
    audio: ResponseAudio | None = None
    max_output_tokens: int | str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None


class _Client(msgspec.Struct, frozen=True, tag_field="type"):
    event_id: str | None = None


class SessionUpdate(_Client, frozen=True, tag="session.update"):
    session: SessionPatch = SessionPatch()
    unknown_fields: tuple[str, ...] = ()
    """The session's fields that :class:`SessionPatch` does not read (:func:`unknown_session_fields`): set by the
    reader of the message from its JSON; whatever a client sends under this name is replaced."""


class InputAudioBufferAppend(_Client, frozen=True, tag="input_audio_buffer.append"):
    audio: str = ""


class InputAudioBufferCommit(_Client, frozen=True, tag="input_audio_buffer.commit"):
    pass


class InputAudioBufferClear(_Client, frozen=True, tag="input_audio_buffer.clear"):
    pass


class ConversationItemCreate(_Client, frozen=True, tag="conversation.item.create"):
    item: ItemSpec = ItemSpec()
    previous_item_id: str | None = None


class ConversationItemTruncate(_Client, frozen=True, tag="conversation.item.truncate"):
    item_id: str = ""
    content_index: NonNegative = 0
    audio_end_ms: NonNegative = 0


class ConversationItemDelete(_Client, frozen=True, tag="conversation.item.delete"):
    item_id: str = ""


class ConversationItemRetrieve(_Client, frozen=True, tag="conversation.item.retrieve"):
    item_id: str = ""


class ResponseCreate(_Client, frozen=True, tag="response.create"):
    response: ResponseParams | None = None


class ResponseCancel(_Client, frozen=True, tag="response.cancel"):
    response_id: str | None = None


class OutputAudioBufferClear(_Client, frozen=True, tag="output_audio_buffer.clear"):
    pass


ClientEvent = (
    SessionUpdate
    | InputAudioBufferAppend
    | InputAudioBufferCommit
    | InputAudioBufferClear
    | ConversationItemCreate
    | ConversationItemTruncate
    | ConversationItemDelete
    | ConversationItemRetrieve
    | ResponseCreate
    | ResponseCancel
    | OutputAudioBufferClear
)

CLIENT_EVENT_TYPES: tuple[str, ...] = (
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "conversation.item.truncate",
    "conversation.item.delete",
    "conversation.item.retrieve",
    "response.create",
    "response.cancel",
    "output_audio_buffer.clear",
)

__all__ = ["UNSET", "ClientEvent", "UnsetType"]
