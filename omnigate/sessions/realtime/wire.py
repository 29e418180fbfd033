"""Conversation state rendered as the protocol's objects: items, responses and their usage.

Usage counts what a response consumed and produced in the units the engines work in: an audio token is one 80 ms
frame (a Mimi frame for the duplex engine, the same span of audio for TTS engines) and a text token is one model
text token (duplex) or one whitespace-separated word (TTS). Nothing is cached, so cached counts are zero.
"""

from __future__ import annotations

import math

from omnigate.sessions.realtime.config import wire_format
from omnigate.sessions.realtime.conversation import Item, Response
from omnigate.sessions.realtime.server_events import (
    WireContent,
    WireInputDetails,
    WireItem,
    WireOutputDetails,
    WireResponse,
    WireResponseAudio,
    WireResponseAudioOutput,
    WireStatusDetails,
    WireStatusError,
    WireUsage,
)

CONVERSATION_ID = "conv_default"
AUDIO_TOKEN_MS = 80.0


def audio_tokens(ms: float) -> int:
    """Audio tokens in ``ms`` of audio: started 80 ms frames."""
    return math.ceil(ms / AUDIO_TOKEN_MS - 1e-9) if ms > 0 else 0


def wire_item(item: Item) -> WireItem:
    if item.type == "function_call":
        return WireItem(
            id=item.id,
            type=item.type,
            object="realtime.item",
            status=item.status,
            call_id=item.call_id,
            name=item.name,
            arguments=item.arguments,
        )
    if item.type == "function_call_output":
        return WireItem(
            id=item.id,
            type=item.type,
            object="realtime.item",
            status=item.status,
            call_id=item.call_id,
            output=item.output,
        )
    return WireItem(
        id=item.id,
        type="message",
        object="realtime.item",
        status=item.status,
        role=item.role,
        content=[WireContent(type=p.type, text=p.text, transcript=p.transcript) for p in item.content],
    )


def wire_response(response: Response) -> WireResponse:
    details: WireStatusDetails | None = None
    if response.status in ("cancelled", "incomplete"):
        details = WireStatusDetails(type=response.status, reason=response.reason)
    elif response.status == "failed":
        code, message = response.error or ("server_error", "the response failed")
        details = WireStatusDetails(
            type="failed", error=WireStatusError(type="server_error", code=code, message=message)
        )
    usage = None
    if response.done:
        text_in, audio_in = response.input_text_tokens, audio_tokens(response.input_audio_ms)
        text_out, audio_out = response.output_text_tokens, audio_tokens(response.output_audio_ms)
        usage = WireUsage(
            total_tokens=text_in + audio_in + text_out + audio_out,
            input_tokens=text_in + audio_in,
            output_tokens=text_out + audio_out,
            input_token_details=WireInputDetails(text_tokens=text_in, audio_tokens=audio_in),
            output_token_details=WireOutputDetails(text_tokens=text_out, audio_tokens=audio_out),
        )
    return WireResponse(
        id=response.id,
        status=response.status,
        status_details=details,
        output=[wire_item(item) for item in response.outputs],
        conversation_id=CONVERSATION_ID if response.in_conversation else None,
        output_modalities=list(response.output_modalities),
        audio=WireResponseAudio(
            output=WireResponseAudioOutput(format=wire_format(response.output_format), voice=response.voice)
        ),
        max_output_tokens="inf" if response.max_output_tokens is None else response.max_output_tokens,
        metadata=response.metadata,
        usage=usage,
    )
