"""A LiveKit Agents TTS that speaks through omnigate's streaming WebSocket (extra ``livekit``).

``TTS.stream()`` holds one pooled ``WS /v1/audio/speech/stream`` connection for the synthesis stream: text goes out
as it is pushed (token by token: the server segments it), ``flush()`` ends the utterance (``input.done``), and PCM
frames are emitted as they arrive, one segment per utterance. Closing the stream mid-utterance (a barge-in) sends
``input.cancel``; the connection goes back to the pool only once the server has ended that utterance, so nothing of
it can reach a later stream. ``synthesize()`` takes the same path. Server refusals become ``APIStatusError`` (retryable
where the server says so), unreachable servers ``APIConnectionError``.

    from omnigate.integrations.livekit import TTS
    session = AgentSession(tts=TTS(base_url="http://127.0.0.1:8000", voice="alloy"), ...)
"""

from __future__ import annotations

import asyncio
import os
import weakref
from typing import Literal, Never

import msgspec
from livekit.agents import (
    DEFAULT_API_CONNECT_OPTIONS,
    APIConnectionError,
    APIConnectOptions,
    APIError,
    APIStatusError,
    APITimeoutError,
    tts,
    utils,
)
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
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

# How long a barge-in waits for the server to end the cancelled utterance before the connection is closed instead.
CANCEL_DRAIN_TIMEOUT_S = 5.0
# Error codes that mean "later, or elsewhere" (HTTP 503); any other typed error is the request's fault (HTTP 400).
_UNAVAILABLE = frozenset({"server_busy", "not_ready", "shutting_down"})


class _Connection:
    """One pooled WebSocket, configured once, with the count of its utterances still open."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.ledger = UtteranceLedger()


def _status_error(error: ServerError) -> APIStatusError:
    return APIStatusError(
        f"omnigate refused: {error.code}: {error.message}",
        status_code=503 if error.code in _UNAVAILABLE else 400,
        body={"code": error.code, "message": error.message, "retry_after": error.retry_after_s},
        retryable=error.retryable,
    )


async def _refusal(ws: ClientConnection, closed: ConnectionClosed) -> APIError:
    """Why the server closed a connection it had just accepted: its typed error event (no free slot, draining)."""
    try:
        while True:
            message = await ws.recv()
            if isinstance(message, str) and isinstance(event := parse_event(message), ServerError):
                return _status_error(event)
    except (ConnectionClosed, msgspec.DecodeError, msgspec.ValidationError):
        return APIConnectionError(f"omnigate closed the connection: {closed}")


class TTS(tts.TTS[Never]):
    """Streaming text-to-speech from an omnigate server; options mirror the WebSocket's ``session.config``."""

    def __init__(
        self,
        *,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        voice: str | None = None,
        model: str | None = None,
        speed: float = 1.0,
        sample_rate: int = 24000,
        language: str | None = None,
        instructions: str | None = None,
        split_granularity: Literal["sentence", "clause"] = "sentence",
        max_session_duration: float = 3600.0,
    ) -> None:
        """``base_url`` is the server's ``http(s)://host:port``; ``api_key`` defaults to ``$OMNIGATE_API_KEY``.

        The server resamples to ``sample_rate`` (24 kHz is what a LiveKit room plays). ``max_session_duration``
        bounds how long a pooled connection is reused; keep it under the server's ``--max-session-duration``.
        """
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True), sample_rate=sample_rate, num_channels=1)
        self._url = stream_url(base_url)
        self._api_key = api_key if api_key is not None else os.environ.get("OMNIGATE_API_KEY")
        self._options = SessionOptions(
            voice=voice,
            model=model,
            sample_rate=sample_rate,
            speed=speed,
            language=language,
            instructions=instructions,
            split_granularity=split_granularity,
        )
        self._pool = utils.ConnectionPool[_Connection](
            connect_cb=self._connect,
            close_cb=self._close,
            max_session_duration=max_session_duration,
        )
        self._streams: weakref.WeakSet[SynthesizeStream] = weakref.WeakSet()
        self._drains: set[asyncio.Task[None]] = set()

    @property
    def model(self) -> str:
        return self._options.model or "omnigate"

    @property
    def provider(self) -> str:
        return "omnigate"

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> tts.ChunkedStream:
        return self._synthesize_with_stream(text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> SynthesizeStream:
        stream = SynthesizeStream(tts=self, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    def prewarm(self) -> None:
        self._pool.prewarm()

    async def aclose(self) -> None:
        for stream in list(self._streams):
            await stream.aclose()
        for task in list(self._drains):
            await utils.aio.cancel_and_wait(task)
        await self._pool.aclose()

    # ---- connections ------------------------------------------------------------------------------------------

    async def _connect(self, connect_timeout: float) -> _Connection:
        try:
            async with asyncio.timeout(connect_timeout):
                ws = await connect(self._url, additional_headers=auth_headers(self._api_key), max_size=None)
        except TimeoutError:
            raise APITimeoutError(f"no connection to {self._url} within {connect_timeout:g}s") from None
        except InvalidStatus as exc:
            response = exc.response
            raise APIStatusError(
                f"omnigate refused the connection: HTTP {response.status_code}",
                status_code=response.status_code,
                body=response.body.decode(errors="replace") if response.body else None,
            ) from None
        except (OSError, InvalidHandshake) as exc:
            raise APIConnectionError(f"cannot connect to {self._url}: {exc}") from None
        try:
            await ws.send(self._options.config_event())
        except ConnectionClosed as exc:
            raise await _refusal(ws, exc) from None
        return _Connection(ws)

    async def _close(self, conn: _Connection) -> None:
        await conn.ws.close()

    async def _acquire(self, connect_timeout: float) -> _Connection:
        while True:
            conn = await self._pool.get(timeout=connect_timeout)
            if conn.ws.state is State.OPEN:
                return conn
            self._pool.remove(conn)  # the server closed it while idle (its idle timeout)

    def _release_after_cancel(self, conn: _Connection) -> None:
        """Cancel the connection's open utterance; pool it again once the server has ended it."""
        task = asyncio.create_task(self._drain(conn), name="omnigate-tts-drain")
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _drain(self, conn: _Connection) -> None:
        if not conn.ledger.open:
            self._pool.put(conn)
            return
        try:
            await conn.ws.send(INPUT_CANCEL)
            conn.ledger.cancelled()
            async with asyncio.timeout(CANCEL_DRAIN_TIMEOUT_S):
                while conn.ledger.open:
                    message = await conn.ws.recv()
                    if isinstance(message, str) and isinstance(parse_event(message), SessionDone):
                        conn.ledger.done()
        except (TimeoutError, ConnectionClosed, OSError, msgspec.DecodeError, msgspec.ValidationError):
            self._pool.remove(conn)
        except BaseException:
            self._pool.remove(conn)
            raise
        else:
            self._pool.put(conn)


class SynthesizeStream(tts.SynthesizeStream):
    """One synthesis stream on one pooled connection; each flushed segment is one server utterance."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._omnigate = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(
            request_id=utils.shortuuid(),
            sample_rate=self._omnigate.sample_rate,
            num_channels=1,
            mime_type="audio/pcm",
            stream=True,
        )
        owner = self._omnigate
        conn = await owner._acquire(self._conn_options.timeout)
        self._acquire_time = owner._pool.last_acquire_time
        self._connection_reused = owner._pool.last_connection_reused
        ledger = conn.ledger
        input_ended = False

        async def send() -> None:
            nonlocal input_ended
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    if ledger.flushed():
                        await conn.ws.send(INPUT_DONE)
                    continue
                self._mark_started()
                await conn.ws.send(text_event(data))
                ledger.text_sent()
            if ledger.flushed():  # input closed without a flush: the utterance still ends
                await conn.ws.send(INPUT_DONE)
            input_ended = True

        async def receive() -> None:
            segment: str | None = None
            while not (input_ended and ledger.open == 0):
                message = await conn.ws.recv()
                if isinstance(message, bytes):
                    if segment is not None:
                        output_emitter.push(message)
                    continue
                event = parse_event(message)
                if isinstance(event, AudioStart) and segment is None:
                    segment = utils.shortuuid()
                    output_emitter.start_segment(segment_id=segment)
                elif isinstance(event, SessionDone):
                    ledger.done()
                    if segment is not None:
                        output_emitter.end_segment()
                        segment = None
                    if event.status == "error":
                        raise APIError(f"omnigate could not synthesize the utterance: {event.error}")
                elif isinstance(event, ServerError):
                    raise _status_error(event)

        sender = asyncio.create_task(send(), name="omnigate-tts-send")
        receiver = asyncio.create_task(receive(), name="omnigate-tts-receive")
        outcome: Literal["clean", "cancelled", "failed"] = "failed"
        try:
            await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
            if receiver.done():
                receiver.result()
            else:
                sender.result()
                if ledger.open:
                    await receiver
            outcome = "clean"
        except asyncio.CancelledError:
            outcome = "cancelled"  # the stream was closed: a barge-in, or the agent moved on
            raise
        except ConnectionClosed as exc:
            raise APIConnectionError(f"omnigate closed the connection: {exc}") from None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise APIError(f"unexpected message from omnigate: {exc}", retryable=False) from None
        finally:
            await utils.aio.cancel_and_wait(sender, receiver)
            if outcome == "clean":
                owner._pool.put(conn)
            elif outcome == "cancelled" and conn.ws.state is State.OPEN:
                owner._release_after_cancel(conn)
            else:
                owner._pool.remove(conn)
