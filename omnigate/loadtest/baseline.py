"""The transport's physical limit: a bare ``websockets`` server that speaks just enough of the speech stream.

It accepts ``session.config``, ``input.text``, ``input.done``, ``input.cancel`` and ``session.close`` on
``/v1/audio/speech/stream``, cuts text into sentences, and answers each sentence with ``audio.start``, synthetic PCM
chunks at the synthetic engine's cadence (24 kHz s16le mono, 40 ms chunks, 60 ms of audio per character, produced
at a configurable real-time factor) and ``audio.done``, then ``session.done`` per flushed utterance. No ASGI, no
session core, no engine pool: measured against it, the gateway's overhead is a ratio. It serves only streamed PCM, so
``session.config`` must carry ``response_format`` and ``stream_audio``.

Like the gateway's media routes it answers no ``permessage-deflate`` by default, so a client at its defaults (which
offers it) negotiates the same with both and the ratio compares like with like; ``compression=True`` accepts it as a
``websockets`` server at its defaults does, to measure what deflating media costs.
"""

from __future__ import annotations

import asyncio
import math
import re
import signal
import sys
from array import array

import msgspec
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from omnigate.loadtest.protocol import (
    CLIENT_DECODER,
    AudioDoneEvent,
    AudioStartEvent,
    ErrorEvent,
    InputCancelMessage,
    InputDoneMessage,
    InputTextMessage,
    SessionCloseMessage,
    SessionConfigMessage,
    SessionDoneEvent,
)

SPEECH_STREAM_PATH = "/v1/audio/speech/stream"
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s")
_EVENT_ENCODER = msgspec.json.Encoder()
_TONE_HZ = 400  # a whole number of periods per 40 ms chunk, so chunks join without clicks


class BaselineSettings(msgspec.Struct, frozen=True):
    """How the baseline produces audio; the defaults match the synthetic engine's cadence."""

    sample_rate: int = 24_000
    chunk_ms: int = 40
    ms_per_char: float = 60.0
    rtf: float = 1.0
    """Production time over audio time: 1.0 paces chunks in real time, 0 sends them as fast as possible."""
    first_chunk_ms: float = 0.0
    """Extra delay before the first chunk of each sentence."""
    max_pending_units: int = 64
    max_unit_chars: int = 120
    """Text without sentence punctuation is released as a unit at this length."""
    compression: bool = False
    """Accept ``permessage-deflate`` when a client offers it (the gateway's media routes never do)."""


class _Unit(msgspec.Struct, frozen=True):
    utterance: int
    sentence: int
    text: str


class _UtteranceEnd(msgspec.Struct, frozen=True):
    utterance: int
    sentences: int


class _Close(msgspec.Struct, frozen=True):
    pass


_Work = _Unit | _UtteranceEnd | _Close


def split_units(buffer: str, max_chars: int) -> tuple[list[str], str]:
    """Complete sentences at the start of ``buffer`` (punctuation then whitespace), and the rest.

    A rest longer than ``max_chars`` without punctuation is released too, so a unit's latency stays bounded.
    """
    units: list[str] = []
    while match := _SENTENCE_END.search(buffer):
        unit = buffer[: match.end()].strip()
        buffer = buffer[match.end() :]
        if unit:
            units.append(unit)
    if len(buffer) > max_chars:
        units.append(buffer.strip())
        buffer = ""
    return units, buffer


def tone_chunk(sample_rate: int, chunk_ms: int) -> bytes:
    """One chunk of a quiet sine tone as s16le."""
    count = sample_rate * chunk_ms // 1000
    samples = array("h", (int(6000 * math.sin(2 * math.pi * _TONE_HZ * i / sample_rate)) for i in range(count)))
    if sys.byteorder == "big":
        samples.byteswap()
    return samples.tobytes()


class BaselineSession:
    """One connection: a reader that turns messages into units, and a writer that synthesizes them in order."""

    def __init__(self, connection: ServerConnection, settings: BaselineSettings, chunk: bytes) -> None:
        self._connection = connection
        self._settings = settings
        self._chunk = chunk
        self._work: asyncio.Queue[_Work] = asyncio.Queue(maxsize=settings.max_pending_units)
        self._buffer = ""
        self._utterance = 0
        self._sentences = 0

    async def serve(self) -> None:
        writer = asyncio.create_task(self._write())
        try:
            async for message in self._connection:
                if isinstance(message, bytes):
                    await self._error("binary frames are not accepted", "invalid_message")
                    continue
                try:
                    command = CLIENT_DECODER.decode(message)
                except msgspec.DecodeError as exc:
                    await self._error(str(exc), "invalid_message")
                    continue
                if isinstance(command, SessionCloseMessage):
                    await self._work.put(_Close())
                    await writer
                    return
                writer = await self._handle(command, writer)
        except ConnectionClosed:
            pass
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    async def _handle(
        self,
        command: SessionConfigMessage | InputTextMessage | InputDoneMessage | InputCancelMessage,
        writer: asyncio.Task[None],
    ) -> asyncio.Task[None]:
        if isinstance(command, SessionConfigMessage):
            if command.response_format != "pcm":
                await self._error("the baseline serves only pcm", "unsupported_format")
        elif isinstance(command, InputTextMessage):
            self._buffer += command.text
            units, self._buffer = split_units(self._buffer, self._settings.max_unit_chars)
            for unit in units:
                await self._queue_unit(unit)
        elif isinstance(command, InputDoneMessage):
            if self._buffer.strip():
                await self._queue_unit(self._buffer.strip())
            await self._work.put(_UtteranceEnd(self._utterance, self._sentences))
            self._next_utterance()
        else:
            # Cancel: stop the writer, forget the queued work, end the utterance with what was sent.
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            while not self._work.empty():
                self._work.get_nowait()
            await self._send(
                SessionDoneEvent(utterance_index=self._utterance, total_sentences=self._sentences, status="cancelled")
            )
            self._next_utterance()
            writer = asyncio.create_task(self._write())
        return writer

    def _next_utterance(self) -> None:
        self._buffer = ""
        self._utterance += 1
        self._sentences = 0

    async def _queue_unit(self, text: str) -> None:
        await self._work.put(_Unit(self._utterance, self._sentences, text))
        self._sentences += 1

    async def _write(self) -> None:
        while True:
            work = await self._work.get()
            if isinstance(work, _Close):
                return
            if isinstance(work, _UtteranceEnd):
                await self._send(SessionDoneEvent(utterance_index=work.utterance, total_sentences=work.sentences))
            else:
                await self._synthesize(work)

    async def _synthesize(self, unit: _Unit) -> None:
        settings = self._settings
        loop = asyncio.get_running_loop()
        await self._send(
            AudioStartEvent(
                utterance_index=unit.utterance,
                sentence_index=unit.sentence,
                sentence_text=unit.text,
                format="pcm",
                sample_rate=settings.sample_rate,
            )
        )
        total_samples = round(len(unit.text) * settings.ms_per_char * settings.sample_rate / 1000)
        chunk_samples = len(self._chunk) // 2
        start = loop.time() + settings.first_chunk_ms / 1000.0
        sent_samples = 0
        total_bytes = 0
        while sent_samples < total_samples:
            samples = min(chunk_samples, total_samples - sent_samples)
            sent_samples += samples
            # Each chunk leaves when it would have been produced: its audio time scaled by the real-time factor.
            ready = start + sent_samples / settings.sample_rate * settings.rtf
            await asyncio.sleep(max(0.0, ready - loop.time()))
            await self._connection.send(self._chunk[: samples * 2])
            total_bytes += samples * 2
        await self._send(
            AudioDoneEvent(
                utterance_index=unit.utterance, sentence_index=unit.sentence, total_bytes=total_bytes, error=False
            )
        )

    async def _error(self, message: str, code: str) -> None:
        await self._send(ErrorEvent(message=message, code=code))

    async def _send(self, event: AudioStartEvent | AudioDoneEvent | SessionDoneEvent | ErrorEvent) -> None:
        await self._connection.send(_EVENT_ENCODER.encode(event).decode())


def _only_speech_stream(connection: ServerConnection, request: Request) -> Response | None:
    if request.path.split("?", 1)[0] != SPEECH_STREAM_PATH:
        return connection.respond(404, "only /v1/audio/speech/stream is served here\n")
    return None


def baseline_server(host: str, port: int, settings: BaselineSettings) -> Server:
    """The baseline server, not yet listening: ``async with baseline_server(...) as server`` serves in its block."""
    chunk = tone_chunk(settings.sample_rate, settings.chunk_ms)

    async def handler(connection: ServerConnection) -> None:
        await BaselineSession(connection, settings, chunk).serve()

    return serve(
        handler,
        host,
        port,
        compression="deflate" if settings.compression else None,
        process_request=_only_speech_stream,
        ping_interval=None,
        max_size=4 * 2**20,
    )


def bound_address(server: Server) -> tuple[str, int]:
    """Host and port the server listens on (the port is chosen by the system when 0 was asked for)."""
    host, port = next(iter(server.sockets)).getsockname()[:2]
    return str(host), int(port)


async def run_baseline(host: str, port: int, settings: BaselineSettings) -> None:
    """Serve until SIGINT or SIGTERM; prints ``listening on ws://HOST:PORT`` once it accepts connections."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with baseline_server(host, port, settings) as server:
        bound_host, bound_port = bound_address(server)
        print(f"listening on ws://{bound_host}:{bound_port}", flush=True)
        await stop.wait()
