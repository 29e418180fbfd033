"""Realtime sessions on a text-to-speech engine: each response speaks assistant text through the speech session core.

A response's text becomes one utterance of a :class:`SessionDriver`: appends as the text arrives (whole, or streamed
from an LLM), then a flush. Its sentences are synthesized as soon as the segmenter releases them and stream out;
``response.cancel`` maps to the session's ``Cancel`` (epoch fence: the engine stream is aborted and its queued audio
purged). A pump task moves the driver's events into the realtime outbox only while that outbox has room, so a
client that stops reading stops the engine.

A response is bound to the speech session's own index of its utterance, read from the session when the response
opens, so the two numberings cannot drift apart. Once that utterance has ended (at its audio cap, or failed), text
still streaming in for the response is dropped rather than allowed to begin another utterance, and a response opens
on an empty speech session: nothing of an earlier response is spoken in a later one. The text a response has
given the speech session and the engine has not begun to speak is bounded (:meth:`TtsBackend.text_room`): an LLM
that writes faster than the reply is heard is read no faster than it is spoken.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from omnigate.engines.pool_api import EnginePoolAPI
from omnigate.gateway.realtime.backend import Backend, ResponseSink, SessionRefused
from omnigate.sessions.driver import SessionDriver
from omnigate.sessions.messages import (
    AppendText,
    Cancel,
    Configure,
    ErrorEvent,
    Flush,
    MediaChunk,
    SegmentStarted,
    SessionClosed,
    SessionConfig,
    UtteranceDone,
)
from omnigate.sessions.realtime.capabilities import RealtimeCapabilities, capabilities_for
from omnigate.sessions.realtime.config import ConfigRefused, RealtimeConfig, ResponseSettings
from omnigate.sessions.realtime.conversation import Response, ResponseStatus
from omnigate.sessions.segmenter import SegmenterConfig
from omnigate.sessions.speech import ConfigError, SessionLimits, synthesis_params

log = logging.getLogger(__name__)

MS_PER_TOKEN = 80

_STATUS: dict[str, tuple[ResponseStatus, str | None]] = {
    "completed": ("completed", None),
    "silence": ("completed", None),
    "cancelled": ("cancelled", "client_cancelled"),
    "max_duration": ("incomplete", "max_output_tokens"),
    "error": ("failed", None),
}


class TtsBackend(Backend):
    """Speaks the responses of one realtime session with a TTS engine pool."""

    def __init__(
        self, pool: EnginePoolAPI[Any], limits: SessionLimits, *, max_audio_ms: int, segmenter: SegmenterConfig
    ) -> None:
        self.pool = pool
        self.capabilities: RealtimeCapabilities = capabilities_for(pool.info)
        self.sample_rate = pool.info.sample_rate
        self._limits = limits
        self._max_audio_ms = max_audio_ms
        self._segmenter = segmenter
        self._driver: SessionDriver | None = None
        self._sink: ResponseSink | None = None
        self._pump: asyncio.Task[None] | None = None
        self._config: SessionConfig | None = None
        self._current: tuple[Response, int] | None = None  # the response being spoken and its utterance's index
        # Non-space characters of the current response's text the engine has not begun to speak, and their bound
        # (well above what the segmenter holds back, so the engine always has a unit to begin).
        self._unspoken = 0
        self._max_unspoken = 16 * segmenter.max_chars
        self._text_room = asyncio.Event()
        self._text_room.set()
        self._error: tuple[str, str] | None = None
        self._engine_ms: float | None = None  # the engine's time to the first audio of the utterance, when it comes

    def start(self, sink: ResponseSink, config: RealtimeConfig) -> None:
        self._sink = sink
        self._driver = SessionDriver(self.pool, self._limits, on_first_audio=self._first_audio)
        try:
            self._configure(self._session_config(config, self._max_audio_ms))
        except ConfigRefused as exc:
            self._driver.release()
            raise SessionRefused(exc.code, exc.message) from None
        self._pump = asyncio.get_running_loop().create_task(self._run_pump(), name="realtime-tts-pump")
        self._pump.add_done_callback(self._pump_ended)

    def reconfigure(self, config: RealtimeConfig) -> None:
        self._configure(self._session_config(config, self._max_audio_ms))

    def open_speech(self, response: Response, settings: ResponseSettings) -> None:
        driver = self._require_driver()
        assert self._config is not None
        if driver.session.pending_utterances:
            driver.submit(Cancel())  # left over from an earlier response: it must not be spoken in this one
        max_audio_ms = self._max_audio_ms
        if settings.max_output_tokens is not None:
            max_audio_ms = min(max_audio_ms, settings.max_output_tokens * MS_PER_TOKEN)
        if max_audio_ms != self._config.max_audio_ms:
            self._configure(msgspec.structs.replace(self._config, max_audio_ms=max_audio_ms))
        self._current = (response, driver.session.next_utterance)
        self._error = None
        self._count_unspoken(-self._unspoken)

    def add_speech(self, response: Response, text: str) -> None:
        if self._takes_text(response):
            self._count_unspoken(_speakable(text))
            self._require_driver().submit(AppendText(text))

    async def text_room(self) -> None:
        """Until the engine has begun to speak enough of the text it was given to take more."""
        await self._text_room.wait()

    def close_speech(self, response: Response) -> None:
        if self._takes_text(response):
            self._require_driver().submit(Flush())

    def cancel(self, response: Response) -> None:
        if self._current is not None and self._current[0] is response and self._driver is not None:
            self._current = None
            self._count_unspoken(-self._unspoken)
            self._driver.submit(Cancel())

    def push_audio(self, pcm: bytes) -> bool:
        return True  # a TTS engine reads no audio: the core only counts it against the input cap

    def clear_input(self) -> None:
        """Nothing is held here: the core's count is all there is."""

    def released_audio(self, ms: float) -> None:
        """The pump waits for outbox room itself; the driver grants engine credit as its events are taken."""

    def release(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None
        if self._driver is not None:
            self._driver.release()
        self._sink = None  # the session refers to this backend: no cycle outlives the session

    # ---- internals ----------------------------------------------------------------------------------------------

    def _pump_ended(self, pump: asyncio.Task[None]) -> None:
        # Without its pump a session's responses would never end: a pump that died ends the session, typed.
        if pump.cancelled() or (error := pump.exception()) is None:
            return
        log.error("a realtime speech pump failed", exc_info=error)
        if self._sink is not None:
            self._sink.fail("server_error", "speech synthesis failed in the server")

    def _first_audio(self, engine_ms: float) -> None:
        # The driver reports it as it hands over that audio: the pump's next event is the chunk it is about.
        self._engine_ms = engine_ms

    def _count_unspoken(self, chars: int) -> None:
        self._unspoken = max(0, self._unspoken + chars)
        if self._unspoken <= self._max_unspoken:
            self._text_room.set()
        else:
            self._text_room.clear()

    def _takes_text(self, response: Response) -> bool:
        """Whether text of ``response`` goes to the speech session: it is the response being spoken, and its
        utterance is yet to begin or still collecting text (an utterance ended at its cap takes no more)."""
        current = self._current
        if current is None or current[0] is not response:
            return False
        session = self._require_driver().session
        return current[1] in (session.next_utterance, session.collecting_utterance)

    def _require_driver(self) -> SessionDriver:
        if self._driver is None:
            raise RuntimeError("the backend was not started")
        return self._driver

    def _session_config(self, config: RealtimeConfig, max_audio_ms: int) -> SessionConfig:
        return SessionConfig(
            voice=config.voice,
            speed=config.speed,
            # Instructions reach only an engine that takes them; otherwise the session lists them as unused.
            instructions=(config.instructions or None) if self.pool.info.capabilities.instructions else None,
            max_audio_ms=max_audio_ms,
            segmenter=self._segmenter,
        )

    def _configure(self, session_config: SessionConfig) -> None:
        try:
            synthesis_params(self.pool.info, session_config)
        except ConfigError as exc:
            raise ConfigRefused(exc.code, exc.message, f"session.audio.output.{exc.param or 'voice'}") from None
        self._require_driver().submit(Configure(session_config))
        self._config = session_config

    async def _run_pump(self) -> None:
        driver = self._require_driver()
        sink = self._sink
        assert sink is not None
        while True:
            await sink.wait_for_room()
            event = await driver.next_event()
            engine_ms, self._engine_ms = self._engine_ms, None  # set by the driver for a first chunk only
            if isinstance(event, SessionClosed):
                if event.reason != "released":
                    sink.fail(event.code or event.reason, f"the speech session ended: {event.reason}")
                return
            current = self._current
            if isinstance(event, ErrorEvent):
                if event.fatal:
                    sink.fail(event.code, event.message)
                    return
                if current is not None:
                    self._error = (event.code, event.message)
                else:
                    sink.report_error(event.code, event.message)
                continue
            if current is None or event.utterance != current[1]:
                continue  # an utterance of a response already ended (cancelled): nothing of it goes out
            response = current[0]
            if isinstance(event, MediaChunk):
                sink.response_audio(response, event.pcm, event.sample_rate, engine_ms)
            elif isinstance(event, SegmentStarted):
                self._count_unspoken(-_speakable(event.text))
                sink.response_text(response, event.text, len(event.text.split()))
            elif isinstance(event, UtteranceDone):
                self._current = None
                self._count_unspoken(-self._unspoken)
                status, reason = _STATUS.get(event.status, ("failed", None))
                error = None
                if status == "failed":
                    error = self._error or ("generation_failed", event.error or "speech synthesis failed")
                sink.finish_response(response, status, reason, error)


def _speakable(text: str) -> int:
    """Characters of ``text`` that are not white space: what the segmenter and the engine keep of it."""
    return sum(1 for ch in text if not ch.isspace())
