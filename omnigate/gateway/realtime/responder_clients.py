"""The HTTP clients a gateway process's realtime sessions answer with, built from ``serve --llm-url/--asr-url``.

One connection pool serves every session of the process (keep-alive connections to the LLM and the transcription
server are reused across turns); each session makes at most one LLM request at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from omnigate.engines.openai_compat.chat import ChatClient
from omnigate.engines.openai_compat.http_calls import ServiceTimeouts, http_client
from omnigate.engines.openai_compat.transcription import TranscriptionClient
from omnigate.engines.recognizer import EmbeddedRecognizer
from omnigate.gateway.settings import ResponderSettings


@dataclass(eq=False)
class ResponderClients:
    """The chat client, the transcription client (None without ``--asr-url``), the embedded recognizer (without
    ``--asr-url``, unless turned off) and the settings they came from."""

    settings: ResponderSettings
    http: httpx.AsyncClient
    chat: ChatClient
    transcription: TranscriptionClient | None
    recognizer: EmbeddedRecognizer | None = None

    @classmethod
    def start(cls, settings: ResponderSettings) -> ResponderClients:
        http = http_client(settings.connect_timeout_s)
        chat = ChatClient(
            http,
            settings.llm_url,
            api_key=settings.llm_api_key,
            timeouts=ServiceTimeouts(
                connect_s=settings.connect_timeout_s,
                first_byte_s=settings.llm_first_token_timeout_s,
                idle_s=settings.llm_idle_timeout_s,
                total_s=settings.llm_timeout_s,
            ),
        )
        transcription = None
        if settings.asr_url is not None:
            transcription = TranscriptionClient(
                http,
                settings.asr_url,
                model=settings.asr_model,
                api_key=settings.asr_api_key,
                timeouts=ServiceTimeouts(
                    connect_s=settings.connect_timeout_s,
                    first_byte_s=settings.asr_timeout_s,
                    idle_s=settings.asr_timeout_s,
                    total_s=settings.asr_timeout_s,
                ),
                max_audio_s=settings.asr_max_audio_s,
            )
        recognizer = None
        if transcription is None and settings.embedded_asr:
            recognizer = EmbeddedRecognizer(
                max_decoders=settings.embedded_asr_max_decoders,
                max_audio_s=settings.asr_max_audio_s,
                timeout_s=settings.asr_timeout_s,
            )
        return cls(settings, http, chat, transcription, recognizer)

    async def aclose(self) -> None:
        if self.recognizer is not None:
            await self.recognizer.aclose()
        await self.http.aclose()
