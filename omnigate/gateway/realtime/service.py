"""The engines behind ``/v1/realtime`` in one gateway process, and how a new session picks one.

The main engine serves the route: a text-to-speech engine turn by turn, a duplex engine (``--engine duplex``) in
full duplex, a model that answers the conversation itself (``--engine qwen3-omni``) turn by turn with no LLM.
``--duplex-model`` loads a duplex engine next to a TTS main engine, for sessions that ask for it
(``/v1/duplex``, ``?duplex=1`` or its model name). A session that asks for duplex where no duplex engine is loaded
is refused, never answered turn-based; ``?duplex=0`` on a duplex-only server is refused too.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from omnigate.engines.answering import ANSWERING_FAMILY, AnsweringEngine
from omnigate.engines.pool import EnginePool
from omnigate.engines.pool_api import EnginePoolAPI
from omnigate.engines.registry import load_engine
from omnigate.engines.vad import VAD_CALL_THREADS
from omnigate.gateway.realtime.answer_backend import ModelAnswerBackend
from omnigate.gateway.realtime.backend import Backend, SessionRefused
from omnigate.gateway.realtime.connection import ResponderReports
from omnigate.gateway.realtime.duplex_backend import DuplexBackend, DuplexEngineApi
from omnigate.gateway.realtime.responder_clients import ResponderClients
from omnigate.gateway.realtime.tts_backend import TtsBackend
from omnigate.gateway.settings import Settings
from omnigate.os_threads import named_executor
from omnigate.sessions.realtime.session import RealtimeLimits
from omnigate.sessions.segmenter import SegmenterConfig
from omnigate.sessions.speech import SessionLimits

log = logging.getLogger(__name__)


# Model names OpenAI's realtime clients send by default; accepted as aliases of the served engine.
OPENAI_REALTIME_MODELS = frozenset(
    {
        "gpt-realtime",
        "gpt-realtime-1.5",
        "gpt-realtime-2",
        "gpt-realtime-2.1",
        "gpt-realtime-2.1-mini",
        "gpt-realtime-mini",
        "gpt-4o-realtime-preview",
        "gpt-4o-mini-realtime-preview",
    }
)


def vad_threads(cores: int | None = None) -> int:
    """VAD pool threads for ``cores`` (default: this machine's): as many scoring calls at once as the cores hold,
    at least 2, at most 32 (each thread is one session's scoring at a time; 32 score thousands of sessions)."""
    return min(32, max(2, (cores or os.cpu_count() or 2) // VAD_CALL_THREADS))


@dataclass(frozen=True)
class Route:
    """What a session got: its backend and the model names it may use."""

    backend: Backend
    model: str
    served_models: frozenset[str]


class RealtimeService:
    """The realtime engines of a gateway process and the executor their sessions' VAD runs on."""

    def __init__(
        self,
        settings: Settings,
        pool: EnginePoolAPI[Any],
        duplex: DuplexEngineApi | None,
        owns_duplex: bool,
        reports: ResponderReports | None = None,
        close_duplex: Callable[[], Awaitable[None]] | None = None,
        answerer: AnsweringEngine | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.duplex = duplex
        self.answerer = answerer  # the main engine answers the conversation itself: it is no TTS engine
        self.tts = None if pool.info.capabilities.duplex or answerer is not None else pool
        self._owns_duplex = owns_duplex
        # a duplex or answering engine served from an engine core: its connection's close
        self._close_duplex = close_duplex
        # the LLM and transcription clients of sessions that answer the user (serve --llm-url), None without
        responder = settings.responder if answerer is None else None  # the model answers: no LLM, no recognizer
        self.responder = ResponderClients.start(responder) if responder is not None else None
        self.reports = reports  # where sessions report answered turns and service failures (the metrics)
        # Silero scores a 32 ms window in ~0.15 ms of CPU: off the event loop, on a shared pool sized from the cores.
        self.vad_executor = named_executor(vad_threads(), "omnigate-vad")

    @property
    def limits(self) -> RealtimeLimits:
        s = self.settings
        return RealtimeLimits(
            outbox_media_ms=s.ws_outbox_ms,
            input_max_bytes=s.realtime_input_max_bytes,
            append_max_bytes=s.realtime_input_max_bytes,
            max_event_bytes=s.ws_max_text_event_bytes,
            max_config_bytes=s.ws_max_config_bytes,
            max_text_chars=s.max_input_chars,
            idle_timeout_s=s.idle_timeout_s,
            max_session_s=s.max_session_s,
        )

    def route(self, *, duplex: bool | None, model: str | None) -> Route:
        """Pick the engine for a new session. Raises SessionRefused."""
        tts_names = self._names(self.tts.info.model, self.tts.info.family) if self.tts is not None else frozenset()
        if self.answerer is not None:
            tts_names = self._names(self.answerer.info.model, self.answerer.info.family)
        duplex_names = (
            self._names(self.duplex.info.model, self.duplex.info.family) if self.duplex is not None else frozenset()
        )
        if duplex is None and model is not None:
            if model in duplex_names and model not in tts_names:
                duplex = True
            elif model in tts_names and model not in duplex_names:
                duplex = False
        if duplex is None:
            duplex = self.tts is None and self.answerer is None
        if duplex:
            if self.duplex is None:
                raise SessionRefused(
                    "duplex_unsupported", "this server runs no duplex engine; connect without duplex=1 for turn-based"
                )
            served = duplex_names | OPENAI_REALTIME_MODELS
            backend: Backend = DuplexBackend(
                self.duplex,
                input_max_bytes=self.settings.realtime_input_max_bytes,
                outbox_ms=self.settings.ws_outbox_ms,
                turn_end_ms=self.settings.duplex_turn_end_ms,
            )
            name = self.duplex.info.model
        elif self.answerer is not None:
            served = tts_names | OPENAI_REALTIME_MODELS
            backend = ModelAnswerBackend(self.answerer)
            name = self.answerer.info.model
        else:
            if self.tts is None:
                raise SessionRefused("turn_based_unsupported", "this server runs only a duplex engine")
            served = tts_names | OPENAI_REALTIME_MODELS
            backend = TtsBackend(
                self.tts,
                self._session_limits(),
                max_audio_ms=int(self.settings.max_utterance_audio_s * 1000),
                segmenter=SegmenterConfig(
                    max_chars=self.settings.segment_max_chars, max_wait_ms=self.settings.segment_max_wait_ms
                ),
            )
            name = self.tts.info.model
        if model is not None and model not in served:
            raise SessionRefused("model_not_found", f"model {model!r} is not served on this route")
        return Route(backend=backend, model=model or name, served_models=served)

    async def aclose_services(self) -> None:
        """Close the responder's connections to the LLM and the transcription server, and the engine core's duplex
        connection."""
        if self._close_duplex is not None:
            await self._close_duplex()
        if self.responder is not None:
            await self.responder.aclose()

    def close(self) -> None:
        """Stop a duplex engine this service loaded and the VAD pool. Blocking: call from a thread."""
        self.vad_executor.shutdown(wait=True, cancel_futures=True)
        if self._owns_duplex and self.duplex is not None:
            self.duplex.shutdown()

    def _session_limits(self) -> SessionLimits:
        s = self.settings
        # The realtime connection keeps its own idle timeout (any client event counts, audio included).
        return SessionLimits(
            outbox_media_ms=s.ws_outbox_ms,
            outbox_bytes=s.outbox_bytes,
            idle_timeout_ms=s.max_session_s * 1000.0,
            max_session_ms=s.max_session_s * 1000.0,
        )

    @staticmethod
    def _names(model: str, family: str) -> frozenset[str]:
        return frozenset({model, family})


async def start_realtime(
    settings: Settings, pool: EnginePoolAPI[Any], reports: ResponderReports | None = None
) -> RealtimeService:
    """Build the service for a started pool, loading ``settings.duplex_model`` beside a TTS main engine."""
    if pool.info.capabilities.duplex:
        if settings.core_socket is not None:
            from omnigate.engines.core.duplex_client import connect_duplex_core

            client = await connect_duplex_core(settings.core_socket)
            log.info("duplex engine %s on the engine core: %d sessions", client.info.model, client.info.max_sessions)
            return RealtimeService(
                settings, pool, client, owns_duplex=False, reports=reports, close_duplex=client.aclose
            )
        if not isinstance(pool, EnginePool):
            raise ValueError("a duplex main engine runs in this process: it needs the local engine pool")
        return RealtimeService(settings, pool, cast(DuplexEngineApi, pool.engine), owns_duplex=False, reports=reports)
    if pool.info.family == ANSWERING_FAMILY:
        if settings.core_socket is not None:
            from omnigate.engines.core.answer_client import connect_answer_core

            answers = await connect_answer_core(settings.core_socket)
            log.info("%s answers on the engine core: %d slots", answers.info.model, answers.info.max_sessions)
            return RealtimeService(
                settings, pool, None, owns_duplex=False, reports=reports, close_duplex=answers.aclose, answerer=answers
            )
        if not isinstance(pool, EnginePool):
            raise ValueError(f"the {ANSWERING_FAMILY} engine runs in this process: it needs the local engine pool")
        answerer = cast(AnsweringEngine, pool.engine)
        return RealtimeService(settings, pool, None, owns_duplex=False, reports=reports, answerer=answerer)
    if settings.duplex_model is None:
        service = RealtimeService(settings, pool, None, owns_duplex=False, reports=reports)
    else:
        engine = await asyncio.to_thread(load_engine, "duplex", settings.duplex_model, **settings.duplex_options)
        log.info("duplex engine %s ready for /v1/duplex: %d sessions", engine.info.model, engine.info.max_sessions)
        service = RealtimeService(settings, pool, cast(DuplexEngineApi, engine), owns_duplex=True, reports=reports)
    recognizer = service.responder.recognizer if service.responder is not None else None
    if recognizer is not None:
        recognizer.start()  # the processes load their first decoders in the background
        log.info(
            "embedded speech recognizer started: pocketsphinx en-US, %d turns at once in %d processes",
            recognizer.max_decoders,
            len(recognizer.processes),
        )
    return service
