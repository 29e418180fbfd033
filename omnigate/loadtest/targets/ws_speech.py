"""``ws-speech``: the incremental speech stream, ``WS /v1/audio/speech/stream``.

Each session opens one connection, sends ``session.config``, then per utterance streams the text word by word at
the configured pace (as an LLM or a speech recognizer would), sends ``input.done`` and waits for ``session.done``
before the next utterance; at the end it sends ``session.close`` and waits for the server to close.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import msgspec
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from omnigate.loadtest.corpus import word_chunks
from omnigate.loadtest.protocol import (
    CLIENT_ENCODER,
    SERVER_DECODER,
    AudioDoneEvent,
    AudioStartEvent,
    ErrorEvent,
    InputDoneMessage,
    InputTextMessage,
    SessionCloseMessage,
    SessionConfigMessage,
    SessionDoneEvent,
)
from omnigate.loadtest.targets.base import Target, ws_url
from omnigate.loadtest.targets.ws_connect import CLOSE_WAIT_S, connect_traced
from omnigate.loadtest.traces import SessionTrace, UtteranceTrace

SPEECH_STREAM_PATH = "/v1/audio/speech/stream"


class _Receiving:
    """What the reader task needs to know about the utterance in flight."""

    def __init__(self) -> None:
        self.utterance: UtteranceTrace | None = None
        self.done = asyncio.Event()
        self.closing = False


class WsSpeechTarget(Target):
    kind = "ws-speech"

    @property
    def url(self) -> str:
        return ws_url(self.spec.url, SPEECH_STREAM_PATH)

    async def run_session(self, texts: Sequence[str], trace: SessionTrace) -> None:
        connection = await connect_traced(
            self.url,
            self.settings.connect_timeout_s,
            trace,
            self.auth_headers(),
            compression=self.settings.compression,
        )
        if connection is None:
            return
        async with connection:
            await self._converse(connection, texts, trace)

    async def _converse(self, connection: ClientConnection, texts: Sequence[str], trace: SessionTrace) -> None:
        state = _Receiving()
        reader = asyncio.create_task(self._read(connection, trace, state))
        try:
            config = SessionConfigMessage(
                response_format=self.response_format,
                stream_audio=True,
                model=self.spec.model,
                voice=self.spec.voice,
            )
            await connection.send(CLIENT_ENCODER.encode(config).decode())
            for text in texts:
                if not trace.may_begin_utterance(time.perf_counter()):
                    break
                utterance = trace.begin_utterance(time.perf_counter(), text)
                state.utterance = utterance
                state.done.clear()
                await self._send_text(connection, utterance)
                await connection.send(CLIENT_ENCODER.encode(InputDoneMessage()).decode())
                if not await self._wait_done(state, reader):
                    if not reader.done():
                        trace.error("utterance_timeout")
                    return
            state.closing = True
            await connection.send(CLIENT_ENCODER.encode(SessionCloseMessage()).decode())
            try:
                await asyncio.wait_for(asyncio.shield(reader), CLOSE_WAIT_S)
            except TimeoutError:
                trace.error("close_timeout")
        except ConnectionClosed:
            # The reader records why the server closed; let it see the close before it is stopped.
            await asyncio.wait({reader}, timeout=CLOSE_WAIT_S)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _wait_done(self, state: _Receiving, reader: asyncio.Task[None]) -> bool:
        """Wait for the utterance's ``session.done``; False on timeout or when the connection ended first."""
        done = asyncio.ensure_future(state.done.wait())
        try:
            await asyncio.wait({done, reader}, timeout=self.settings.utterance_timeout_s, return_when="FIRST_COMPLETED")
        finally:
            done.cancel()
        return state.done.is_set()

    async def _send_text(self, connection: ClientConnection, utterance: UtteranceTrace) -> None:
        words_per_second = self.settings.words_per_second
        chunks = word_chunks(utterance.text) if words_per_second > 0 else [utterance.text]
        start_s = time.perf_counter()
        sent_chars = 0
        for index, chunk in enumerate(chunks):
            if words_per_second > 0:
                # A fixed schedule from the start, so slow sends do not stretch the pace.
                await asyncio.sleep(max(0.0, start_s + index / words_per_second - time.perf_counter()))
            await connection.send(CLIENT_ENCODER.encode(InputTextMessage(text=chunk)).decode())
            sent_chars += len(chunk)
            utterance.text_sent(time.perf_counter(), sent_chars)

    async def _read(self, connection: ClientConnection, trace: SessionTrace, state: _Receiving) -> None:
        try:
            async for message in connection:
                now_s = time.perf_counter()
                utterance = state.utterance
                if isinstance(message, bytes):
                    if utterance is None:
                        trace.error("protocol_audio_outside_utterance")
                    else:
                        utterance.audio(now_s, len(message))
                    continue
                self._on_event(message, now_s, trace, state)
        except ConnectionClosed:
            pass
        if not state.closing and connection.close_code not in (None, 1000):
            trace.error(f"ws_close_{connection.close_code}", connection.close_reason)
        elif not state.closing:
            trace.error("closed_by_server")

    @staticmethod
    def _on_event(message: str, now_s: float, trace: SessionTrace, state: _Receiving) -> None:
        try:
            event = SERVER_DECODER.decode(message)
        except msgspec.DecodeError as exc:
            trace.error("protocol_unknown_event", f"{exc}: {message[:200]}")
            return
        utterance = state.utterance
        if isinstance(event, ErrorEvent):
            trace.error(event.code or "server_error", event.message)
        elif utterance is None:
            trace.error("protocol_event_outside_utterance")
        elif isinstance(event, AudioStartEvent):
            trace.record_negotiated("format", f"{event.format} {event.sample_rate} Hz")
            utterance.unit_started(event.sentence_text, event.sample_rate)
        elif isinstance(event, AudioDoneEvent):
            if event.error:
                trace.error("audio_done_error")
        elif isinstance(event, SessionDoneEvent):
            finish_utterance(trace, utterance, now_s, event)
            state.done.set()


def finish_utterance(trace: SessionTrace, utterance: UtteranceTrace, now_s: float, event: SessionDoneEvent) -> None:
    """End ``utterance`` on its ``session.done``: anything but ``completed`` is a failure with its status as code
    (a listener heard the utterance end early)."""
    if event.status == "completed":
        utterance.finish(now_s, "completed")
        return
    trace.error(f"utterance_{event.status}", event.error if isinstance(event.error, str) else None)
    utterance.finish(now_s, "failed")
