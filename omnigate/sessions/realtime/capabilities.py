"""What a realtime session can ask of the engine behind it, derived from the engine's declared capabilities.

Turn detection (server VAD), truncation and the audio formats are the gateway's own work, so every engine has them.
A natively duplex engine decides itself when to speak: it composes its replies, takes no text and no client commits.
A text-to-speech engine speaks the assistant text items the client creates and composes nothing of its own.
"""

from __future__ import annotations

import msgspec

from omnigate.engines.base import EngineInfo
from omnigate.sessions.realtime.server_events import WireCapabilities

AUDIO_FORMATS = ("audio/pcm", "audio/pcmu", "audio/pcma")


class RealtimeCapabilities(msgspec.Struct, frozen=True):
    engine: str
    native_duplex: bool
    speaks_text_items: bool
    create_response: bool
    client_commit: bool
    output_modalities: tuple[str, ...]
    voices: tuple[str, ...]
    default_voice: str
    speed: bool
    instructions: bool
    server_vad: bool = True
    semantic_vad: bool = False
    interrupt_response: bool = True
    audio_truncate: bool = True
    input_transcription: bool = False
    tools: bool = False
    temperature: bool = False
    """The session's (or a response's) ``temperature`` reaches the model that writes the answer."""
    answers_turns: bool = False
    """The engine answers the conversation itself (its items and the user's committed audio), in its own voice."""
    voice_aliases: tuple[str, ...] = ()
    """OpenAI's voice names that stand for served voices (named when an unknown voice is refused)."""

    def wire(self) -> WireCapabilities:
        return WireCapabilities(
            engine=self.engine,
            native_duplex=self.native_duplex,
            speaks_text_items=self.speaks_text_items,
            server_vad=self.server_vad,
            semantic_vad=self.semantic_vad,
            interrupt_response=self.interrupt_response,
            create_response=self.create_response,
            client_commit=self.client_commit,
            audio_truncate=self.audio_truncate,
            input_transcription=self.input_transcription,
            tools=self.tools,
            voices=list(self.voices),
            output_modalities=list(self.output_modalities),
            audio_formats=list(AUDIO_FORMATS),
            answers_turns=self.answers_turns,
        )


def capabilities_for(info: EngineInfo) -> RealtimeCapabilities:
    caps = info.capabilities
    duplex = caps.duplex
    return RealtimeCapabilities(
        engine=info.family,
        native_duplex=duplex,
        speaks_text_items=not duplex,
        create_response=duplex,
        client_commit=not duplex,
        # A duplex model's text stream can be sent alone; a TTS engine exists to speak.
        output_modalities=("audio", "text") if duplex else ("audio",),
        voices=tuple(sorted(info.voice_ids())),
        voice_aliases=tuple(info.voice_aliases()),
        default_voice=info.default_voice,
        speed=caps.speed,
        instructions=caps.instructions,
    )
