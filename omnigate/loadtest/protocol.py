"""JSON events of the speech stream protocol (``WS /v1/audio/speech/stream``), as the load test sees them.

The load test is a client and ships without the gateway, so it carries its own copy of the wire shapes. Unknown
fields are ignored when decoding, so a server that sends more than this still parses.
"""

from __future__ import annotations

import msgspec

# ---- client -> server ----------------------------------------------------------------------------------------------


class SessionConfigMessage(msgspec.Struct, tag="session.config", tag_field="type", omit_defaults=True, kw_only=True):
    """Sticky session settings. ``model`` and ``voice`` are omitted when ``None`` (the server's defaults apply);
    the format fields have no default, so they are always sent."""

    response_format: str
    stream_audio: bool
    model: str | None = None
    voice: str | None = None


class InputTextMessage(msgspec.Struct, tag="input.text", tag_field="type"):
    text: str


class InputDoneMessage(msgspec.Struct, tag="input.done", tag_field="type"):
    """End of the utterance: the server flushes what it buffered and keeps the connection open."""


class InputCancelMessage(msgspec.Struct, tag="input.cancel", tag_field="type"):
    """Abort the utterance in progress; the session stays open."""


class SessionCloseMessage(msgspec.Struct, tag="session.close", tag_field="type"):
    """End the session once the flushed utterances are done."""


ClientMessage = SessionConfigMessage | InputTextMessage | InputDoneMessage | InputCancelMessage | SessionCloseMessage


# ---- server -> client ----------------------------------------------------------------------------------------------


class AudioStartEvent(msgspec.Struct, tag="audio.start", tag_field="type"):
    sentence_index: int
    sentence_text: str = ""
    utterance_index: int = 0
    format: str = "pcm"
    sample_rate: int = 24_000


class AudioDoneEvent(msgspec.Struct, tag="audio.done", tag_field="type"):
    sentence_index: int
    total_bytes: int = 0
    utterance_index: int = 0
    error: bool = False


class SessionDoneEvent(msgspec.Struct, tag="session.done", tag_field="type"):
    """The utterance's terminal event. ``status`` is ``completed`` unless something ended it early (``error``,
    ``max_duration``, ``cancelled`` ...); servers that send no status mean ``completed``."""

    total_sentences: int
    utterance_index: int = 0
    status: str = "completed"
    error: str | msgspec.UnsetType = msgspec.UNSET
    """What ended the utterance, when the server says (left out of the message otherwise)."""


class ErrorEvent(msgspec.Struct, tag="error", tag_field="type"):
    message: str = ""
    code: str | None = None


ServerEvent = AudioStartEvent | AudioDoneEvent | SessionDoneEvent | ErrorEvent

CLIENT_ENCODER = msgspec.json.Encoder()
CLIENT_DECODER: msgspec.json.Decoder[ClientMessage] = msgspec.json.Decoder(ClientMessage)
SERVER_DECODER: msgspec.json.Decoder[ServerEvent] = msgspec.json.Decoder(ServerEvent)
