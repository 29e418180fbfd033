"""The HTTP clients a gateway process's realtime sessions answer with, built from ``serve --llm-url/--asr-url``.

One connection pool serves every session of the process (keep-alive connections to the LLM and the transcription
server are reused across turns); each session makes at most one LLM request at a time. Without ``--llm-url`` the
chat is the embedded LLM's (:mod:`omnigate.engines.llm`), started here: its model loads on its own worker thread
while the server already serves.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import httpx

from omnigate.engines.openai_compat.chat import ChatClient, ChatStream
from omnigate.engines.openai_compat.http_calls import ServiceTimeouts, http_client
from omnigate.engines.openai_compat.messages import ChatRequest
from omnigate.engines.openai_compat.transcription import TranscriptionClient
from omnigate.engines.recognizer import EmbeddedRecognizer
from omnigate.gateway.settings import ResponderSettings

if TYPE_CHECKING:
    from omnigate.engines.llm.engine import LlmEngine


class ChatSource(Protocol):
    """What a session streams its answers from: a :class:`ChatClient`, or the embedded LLM's chat."""

    def stream(self, request: ChatRequest) -> ChatStream: ...


@dataclass(eq=False)
class ResponderClients:
    """The chat client (an HTTP client of ``--llm-url``, or the embedded LLM's chat), the transcription client (None
    without ``--asr-url``), the embedded recognizer (without ``--asr-url``, unless turned off), the embedded LLM's
    engine when the chat is its, and the settings they came from."""

    settings: ResponderSettings
    http: httpx.AsyncClient
    chat: ChatSource
    transcription: TranscriptionClient | None
    recognizer: EmbeddedRecognizer | None = None
    llm: LlmEngine | None = None

    @classmethod
    def start(cls, settings: ResponderSettings) -> ResponderClients:
        http = http_client(settings.connect_timeout_s)
        chat: ChatSource
        llm: LlmEngine | None = None
        if settings.llm_url is None:
            # Imported here: the embedded LLM's stack (torch, transformers) is imported only when it is used.
            from omnigate.engines.llm.chat import start_embedded_chat

            embedded = start_embedded_chat(load_wait_s=settings.llm_first_token_timeout_s, seed=settings.llm_seed)
            chat, llm = embedded, embedded.engine
        else:
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
        return cls(settings, http, chat, transcription, recognizer, llm)

    async def aclose(self) -> None:
        if self.recognizer is not None:
            await self.recognizer.aclose()
        await self.http.aclose()
        if self.llm is not None:
            await asyncio.to_thread(self.llm.stop)
