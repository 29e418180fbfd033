"""A Pipecat TTS service that speaks through omnigate's streaming WebSocket (extra ``pipecat``).

LLM text frames go out as they come (``input.text``; no sentence aggregation on the client: the server's segmenter
does it), the end of the LLM turn ends the utterance (``input.done``), and the audio of each utterance comes back as
``TTSStartedFrame``, ``TTSAudioRawFrame``s and ``TTSStoppedFrame`` of its audio context. An interruption sends
``input.cancel`` and drops the audio still queued at once; audio of a cancelled utterance that was already in flight
is recognised by its utterance index and dropped too. The socket stays open across turns and interruptions, and is
reopened with backoff if it drops (Pipecat's ``WebsocketTTSService``).

    from omnigate.integrations.pipecat import OmnigateTTSService
    tts = OmnigateTTSService(base_url="http://127.0.0.1:8000", voice="alloy")
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncGenerator
from typing import Any, Literal

import msgspec
from loguru import logger
from pipecat.frames.frames import ErrorFrame, Frame, TTSAudioRawFrame, TTSStoppedFrame
from pipecat.processors.frame_processor import FrameProcessorSetup
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, WebsocketTTSService
from pipecat.utils.errors import ErrorCategory
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from omnigate.integrations.speech_client import (
    INPUT_CANCEL,
    INPUT_DONE,
    AudioStart,
    ServerError,
    SessionDone,
    SessionOptions,
    UtteranceLedger,
    auth_headers,
    parse_event,
    stream_url,
    text_event,
)

# Codes the server sends as consequences of an earlier refusal (a refused session.config): reported once, not again.
_CONSEQUENTIAL = frozenset({"no_config"})
_CATEGORIES = {
    "server_busy": ErrorCategory.RATE_LIMIT,
    "engine_busy": ErrorCategory.RATE_LIMIT,
    "engine_unavailable": ErrorCategory.SERVER,
    "not_ready": ErrorCategory.SERVER,
    "shutting_down": ErrorCategory.SERVER,
    "generation_failed": ErrorCategory.SERVER,
}


class OmnigateTTSService(WebsocketTTSService):
    """Streaming text-to-speech from an omnigate server; options mirror the WebSocket's ``session.config``."""

    def __init__(
        self,
        *,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        voice: str | None = None,
        model: str | None = None,
        speed: float = 1.0,
        sample_rate: int | None = None,
        language: str | None = None,
        instructions: str | None = None,
        split_granularity: Literal["sentence", "clause"] = "sentence",
        **kwargs: Any,
    ) -> None:
        """``base_url`` is the server's ``http(s)://host:port``; ``api_key`` defaults to ``$OMNIGATE_API_KEY``.

        ``sample_rate`` defaults to the pipeline's output rate; the server resamples to it. Other keyword arguments
        go to Pipecat's ``WebsocketTTSService`` (reconnect backoff, text transforms, ...).
        """
        kwargs.setdefault("text_aggregation_mode", TextAggregationMode.TOKEN)
        super().__init__(
            push_start_frame=True,
            push_stop_frames=True,
            sample_rate=sample_rate,
            settings=TTSSettings(model=model, voice=voice, language=None),
            **kwargs,
        )
        self._url = stream_url(base_url)
        self._api_key = api_key if api_key is not None else os.environ.get("OMNIGATE_API_KEY")
        self._options = SessionOptions(
            voice=voice,
            model=model,
            speed=speed,
            language=language,
            instructions=instructions,
            split_granularity=split_granularity,
        )
        self._receive_task: Any = None
        self._ledger = UtteranceLedger()
        self._collecting_context: str | None = None
        # The audio context of each utterance the connection has begun, by the server's utterance index.
        self._contexts: dict[int, str] = {}
        self._speaking: int | None = None  # the utterance whose audio.start came last
        # Token by token, a server that is down would be reported once per token: once per context is enough.
        self._unreachable_context: str | None = None

    def can_generate_metrics(self) -> bool:
        return True

    async def setup(self, setup: FrameProcessorSetup) -> None:
        await super().setup(setup)
        await self._connect()

    async def _update_settings(self, delta: TTSSettings) -> dict[str, Any]:
        changed: dict[str, Any] = await super()._update_settings(delta)
        if "voice" in changed or "model" in changed:
            self._options = msgspec.structs.replace(
                self._options, voice=self._settings.voice or None, model=self._settings.model or None
            )
            await self._disconnect()
            await self._connect()
        return changed

    # ---- connection -------------------------------------------------------------------------------------------

    async def _connect(self) -> None:
        await super()._connect()
        await self._connect_websocket()
        if self._websocket is not None and self._receive_task is None:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self) -> None:
        await super()._disconnect()
        if self._receive_task is not None:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()

    async def _connect_websocket(self) -> None:
        try:
            if self._websocket is not None and self._websocket.state is State.OPEN:
                return
            self._websocket = await self._websocket_connect(
                self._url, additional_headers=auth_headers(self._api_key), max_size=None
            )
            self._ledger = UtteranceLedger()
            self._collecting_context, self._contexts, self._speaking = None, {}, None
            options = msgspec.structs.replace(self._options, sample_rate=self.sample_rate)
            # Refused right after the handshake (no free slot): the receive loop reads the server's error.
            with contextlib.suppress(ConnectionClosed):
                await self._websocket.send(options.config_event())
            await self._call_event_handler("on_connected")
        except Exception as exc:
            self._websocket = None
            await self.push_error(
                error_msg=f"cannot connect to omnigate at {self._url}: {exc}",
                exception=exc,
                category=ErrorCategory.CONNECTIVITY,
            )
            await self._call_event_handler("on_connection_error", f"{exc}")

    async def _disconnect_websocket(self) -> None:
        try:
            await self.stop_all_metrics()
            if self._websocket is not None:
                await self._websocket.close()
        finally:
            self._websocket = None
            await self._call_event_handler("on_disconnected")

    # ---- text out ---------------------------------------------------------------------------------------------

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Send the text as it comes; the audio arrives on the receive task, in this context."""
        if self._unreachable_context == context_id:
            return  # already reported for this context
        if self._websocket is None or self._websocket.state is not State.OPEN:
            await self._connect()
        ws = self._websocket
        if ws is None:
            self._unreachable_context = context_id  # _connect_websocket reported why
            return
        self._unreachable_context = None
        try:
            if self._collecting_context not in (None, context_id) and self._ledger.flushed():
                await ws.send(INPUT_DONE)  # a new context ends the utterance still collecting
            if self._collecting_context != context_id:
                self._ledger.cancelled()
            self._collecting_context = context_id
            begun = self._ledger.begun
            self._ledger.text_sent()
            if self._ledger.begun != begun:
                self._contexts[self._ledger.begun - 1] = context_id
            await ws.send(text_event(text))
            await self.start_tts_usage_metrics(text)
        except Exception as exc:
            yield ErrorFrame(error=f"omnigate send failed: {exc}")
            return
        yield None

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The LLM turn ended: so does the utterance (the server speaks what it still holds)."""
        ws = self._websocket
        if ws is None or ws.state is not State.OPEN:
            return
        if self._ledger.flushed():
            self._collecting_context = None
            await ws.send(INPUT_DONE)

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Barge-in: cancel on the server at once; late audio of the cancelled utterances is dropped on arrival."""
        await self.stop_all_metrics()
        ws = self._websocket
        open_here = self._ledger.open and context_id in self._contexts.values()
        if open_here and ws is not None and ws.state is State.OPEN:
            self._ledger.cancelled()
            self._collecting_context = None
            await ws.send(INPUT_CANCEL)
        await super().on_audio_context_interrupted(context_id)

    # ---- audio in ---------------------------------------------------------------------------------------------

    async def _receive_messages(self) -> None:
        ws = self._websocket
        if ws is None:
            raise ConnectionError("omnigate is not connected")
        async for message in ws:
            if isinstance(message, bytes):
                context_id = self._contexts.get(self._speaking) if self._speaking is not None else None
                if context_id is not None and self.audio_context_available(context_id):
                    await self.stop_ttfb_metrics()
                    frame = TTSAudioRawFrame(message, self.sample_rate, 1, context_id=context_id)
                    await self.append_to_audio_context(context_id, frame)
                continue
            event = parse_event(message)
            if isinstance(event, AudioStart):
                self._speaking = event.utterance_index
            elif isinstance(event, SessionDone):
                self._ledger.done()
                self._speaking = None
                context_id = self._contexts.pop(event.utterance_index, None)
                if event.status == "error":
                    await self.push_error(error_msg=f"omnigate could not synthesize: {event.error}")
                if context_id is not None and self.audio_context_available(context_id):
                    await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                    await self.remove_audio_context(context_id)
            elif isinstance(event, ServerError):
                await self._on_server_error(event)

    async def _on_server_error(self, error: ServerError) -> None:
        if error.code in _CONSEQUENTIAL:
            logger.debug(f"{self}: {error}")
            return
        await self.stop_all_metrics()
        await self.push_error(
            error_msg=f"omnigate refused: {error}",
            exception=error,
            category=_CATEGORIES.get(error.code, ErrorCategory.INVALID_REQUEST),
        )
