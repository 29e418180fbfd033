"""``WS /v1/realtime`` (and ``/v1/duplex``): the OpenAI Realtime protocol over a WebSocket.

The adapter only moves messages: a reader task hands each text frame to the connection core, a writer task sends
what the core produces (audio travels as ``response.output_audio.delta`` events). A disconnect is seen by the
reader at once; a client that accepts nothing for the stall timeout is dropped, which stops its engine work. A
failure of the server's own (a client event the core could not take, a writer that raised) ends the session with a
typed ``server_error`` and close 1011, never a silent drop.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from omnigate.gateway.realtime.backend import SessionRefused
from omnigate.gateway.realtime.connection import RealtimeConnection
from omnigate.gateway.realtime.service import RealtimeService
from omnigate.gateway.security.client_session import minted_session, stored_session_event
from omnigate.gateway.speech.voices import resolve_voice
from omnigate.gateway.state import Gateway
from omnigate.gateway.task_pair import run_reader_writer
from omnigate.sessions.realtime.outbox import Closing, OutgoingAudio, OutgoingEvent
from omnigate.sessions.realtime.server_events import ErrorEvent, WireError, encode_event
from omnigate.sessions.registry import SessionLimitReached

log = logging.getLogger(__name__)

TRANSPORT = "realtime"
SUBPROTOCOL = "realtime"


async def realtime_endpoint(ws: WebSocket) -> None:
    """``/v1/realtime``: the main engine's mode, or duplex with ``?duplex=1`` (``?duplex=0``: turn-based)."""
    flag = ws.query_params.get("duplex")
    duplex = None if flag is None else flag.lower() in ("1", "true", "yes")
    await _serve(ws, duplex)


async def duplex_endpoint(ws: WebSocket) -> None:
    """``/v1/duplex``: always full duplex."""
    await _serve(ws, True)


async def _serve(ws: WebSocket, duplex: bool | None) -> None:
    gateway: Gateway = ws.app.state.gateway
    service: RealtimeService | None = getattr(ws.app.state, "realtime", None)
    settings = gateway.settings
    if gateway.pool is None or service is None:
        await _refuse(ws, "not_ready", "the engine is not loaded yet", 1013, settings.retry_after_s)
        return
    try:
        route = service.route(duplex=duplex, model=ws.query_params.get("model"))
    except SessionRefused as exc:
        await _refuse(ws, exc.code, exc.message, 1008, exc.retry_after_s)
        return
    try:
        with gateway.registry.admit(TRANSPORT) as lease:
            await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in ws.scope.get("subprotocols", ()) else None)
            info = route.backend.capabilities
            connection = RealtimeConnection(
                route.backend,
                limits=service.limits,
                model=route.model,
                served_models=route.served_models,
                resolve_voice=lambda name: session_voice(service, info.native_duplex, name),
                vad_executor=service.vad_executor,
                responder=service.responder,
                reports=service.reports,
            )
            try:
                await connection.reserve()
                connection.open()
            except SessionRefused as exc:
                connection.release()
                await _refuse(ws, exc.code, exc.message, 1013, exc.retry_after_s, accepted=True)
                return
            lease.drain_target = connection
            minted = stored_session_event(minted_session(ws.scope), "realtime")
            if minted is not None:
                connection.receive_text(minted)  # the configuration minted with the client secret
            await WsRealtimeTransport(ws, connection, settings.stall_timeout_s).run()
    except SessionLimitReached as exc:
        code = "shutting_down" if gateway.registry.draining else "server_busy"
        await _refuse(ws, code, str(exc), 1012 if gateway.registry.draining else 1013, exc.retry_after_s)


def session_voice(service: RealtimeService, duplex: bool, name: str) -> str:
    """The engine voice a session's voice name stands for (names the engine does not know pass through)."""
    engine = service.duplex if duplex else (service.answerer or service.tts)
    assert engine is not None
    resolved = resolve_voice(engine.info, name)
    return resolved if resolved is not None else name


async def _refuse(
    ws: WebSocket, code: str, message: str, close_code: int, retry_after_s: float | None, *, accepted: bool = False
) -> None:
    """A typed refusal in the protocol's error shape, then a close whose reason carries the retry hint."""
    if not accepted:
        await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in ws.scope.get("subprotocols", ()) else None)
    hint = f"; retry after {retry_after_s:g}s" if retry_after_s is not None else ""
    error = ErrorEvent(
        event_id="event_refused",
        error=WireError(type="invalid_request_error", code=code, message=message + hint),
    )
    try:
        await ws.send_text(encode_event(error).decode())
        await ws.close(close_code, f"{code}{hint}"[:120])
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass


class WsRealtimeTransport:
    """Reader and writer tasks around one :class:`RealtimeConnection`."""

    def __init__(self, ws: WebSocket, connection: RealtimeConnection, stall_timeout_s: float) -> None:
        self.ws = ws
        self.connection = connection
        self.stall_timeout_s = stall_timeout_s
        self.disconnected = False

    async def run(self) -> None:
        try:
            await run_reader_writer(self._read(), self._write(), "realtime")
        finally:
            self.connection.release()

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                self.disconnected = True
                self.connection.disconnect()
                return
            text = message.get("text")
            if text is None:
                self.connection.protocol_error("invalid_message", "binary frames are not accepted; send JSON text")
                continue
            try:
                self.connection.receive_text(text)
            except Exception:
                log.exception("a realtime session could not take a client event")
                self.connection.fail("server_error", "the server failed handling a client event")
            if self.connection.closed:
                # Fatal: the writer sends the error and closes; keep reading until then to see a disconnect.
                continue

    async def _write(self) -> None:
        try:
            await self._write_outputs()
        except Exception:
            log.exception("a realtime writer failed")
            self.connection.disconnect()
            await self._fail_now("server_error", "the server failed sending this session's events")

    async def _fail_now(self, code: str, message: str) -> None:
        """Send a typed error and close 1011 directly: the writer that would have sent them is gone."""
        if self.disconnected:
            return
        error = ErrorEvent(
            event_id="event_server_error", error=WireError(type="server_error", code=code, message=message)
        )
        if await self._send(encode_event(error).decode()):
            await self._close(Closing(code, code, 1011))

    async def _write_outputs(self) -> None:
        while True:
            output = await self.connection.next_output()
            if isinstance(output, OutgoingEvent):
                if not await self._send(output.payload.decode()):
                    return
            elif isinstance(output, Closing):
                await self._close(output)
                return
            elif isinstance(output, OutgoingAudio):
                raise RuntimeError("a WebSocket session carries audio as events")

    async def _send(self, text: str) -> bool:
        if self.disconnected:
            return False
        try:
            async with asyncio.timeout(self.stall_timeout_s):
                await self.ws.send_text(text)
        except TimeoutError:
            log.info("closing a stalled realtime client")
            self.disconnected = True
            self.connection.disconnect()
            return False
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.disconnected = True
            self.connection.disconnect()
            return False
        return True

    async def _close(self, closing: Closing) -> None:
        if self.disconnected:
            return
        try:
            async with asyncio.timeout(1.0):
                await self.ws.close(closing.close_code, closing.reason[:120])
        except (TimeoutError, WebSocketDisconnect, RuntimeError, OSError):
            pass


__all__ = ["duplex_endpoint", "realtime_endpoint", "session_voice"]
