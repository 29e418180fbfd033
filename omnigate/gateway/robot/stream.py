"""``WS /v1/realtime/robot/openpi``: openpi's websocket policy protocol, many robots on one batched policy.

The wire is openpi's, so ``openpi_client.websocket_client_policy.WebsocketClientPolicy(host="ws://HOST:PORT/v1/
realtime/robot/openpi")`` works unchanged:

1. on connect the server sends the policy's metadata as one binary msgpack message;
2. each binary msgpack-numpy observation gets one binary msgpack reply: ``actions`` (float32, action horizon x
   action dim) and ``server_timing`` (``infer_ms``, ``prev_total_ms``, and ``queue_ms`` / ``batch_size``);
3. anything wrong with an observation is answered with a *text* message (openpi's client raises it as an error): a
   JSON error ``{"type": "error", "code", "message", "param"}``. Unlike openpi's server, the session goes on.

Query parameters a client may add to the URL: ``control_rate_hz`` (the robot's rate, which orders the batches;
measured from its observations when absent) and ``on_busy=latest`` (a second observation before the reply replaces
the waiting one instead of being refused with ``observation_in_flight``).

The session is admitted like every other (transport ``robot``), closes after the idle timeout with no observation
in flight, and is a drain target: idle while nothing is in flight.

Observations are decoded off the event loop under a budget (:mod:`omnigate.gateway.robot.decode`). A burst is
answered, not punished: the reader takes the next message only once its last refusal is on its way, so a client
that reads gets every refusal and every reply, and only one that stops reading is closed (the sender's stall
timeout, 1008 ``stalled``). A task of the session that fails ends it with a typed ``internal_error`` and 1011,
and everything it held is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from omnigate.engines.policy.pool import ObservationBusy, PolicyPool, PolicyReply, PolicySession
from omnigate.engines.policy.wire import WireError, pack
from omnigate.engines.pool import PoolClosed, PoolFull
from omnigate.gateway.errors import json_error
from omnigate.gateway.ops.metrics import Metrics
from omnigate.gateway.robot.decode import DecoderBusy, ObservationDecoder
from omnigate.gateway.settings import Settings
from omnigate.gateway.state import Gateway
from omnigate.sessions.registry import SessionLimitReached

log = logging.getLogger(__name__)

TRANSPORT = "robot"
SERVER_END_CLOSE_CODE = 1012
INTERNAL_ERROR_CLOSE_CODE = 1011
IN_FLIGHT = WireError(
    "observation_in_flight",
    "the previous observation has not been answered yet (connect with ?on_busy=latest to have a newer observation "
    "replace a waiting one)",
)
DECODERS_BUSY = WireError("server_busy", "every observation decoder of the server is taken: send the observation again")


async def start_robot(gateway: Gateway, metrics: Metrics) -> None:
    """Load the policy and start its scheduler and its decoding threads when ``--robot-model`` names one (off the
    loop: it builds a model)."""
    settings = gateway.settings
    if not settings.robot_model:
        return
    from omnigate.engines.policy.engine import PolicyEngine

    engine = await asyncio.to_thread(PolicyEngine.load, settings.robot_model, **settings.robot_options)
    pool = PolicyPool(engine, retry_after_s=settings.retry_after_s, step_observer=metrics.observe_robot_step)
    pool.start()
    info = engine.info
    log.info(
        "robot policy %s ready on %s: %d slots, batches up to %d%s",
        info.model,
        info.device,
        info.max_sessions,
        info.max_batch,
        " (random weights: actions are noise)" if info.random_weights else "",
    )
    gateway.robot_pool = pool
    gateway.robot_decoder = ObservationDecoder(info, settings.robot_max_observation_bytes)


async def stop_robot(gateway: Gateway) -> None:
    """Stop the scheduler (its sessions are closed), then the decoding threads."""
    pool, gateway.robot_pool = gateway.robot_pool, None
    decoder, gateway.robot_decoder = gateway.robot_decoder, None
    if pool is not None:
        await asyncio.to_thread(pool.stop)
    if decoder is not None:
        decoder.close()


async def robot_policy_endpoint(ws: WebSocket) -> None:
    """Admit the robot (transport ``robot``) and serve it, or refuse it typed before any work."""
    gateway: Gateway = ws.app.state.gateway
    pool, decoder = gateway.robot_pool, gateway.robot_decoder
    if pool is None or decoder is None:
        await _refuse(
            ws, "robot_unavailable", "this gateway serves no robot policy (start it with --robot-model)", 4404
        )
        return
    try:
        rate_hz, latest_wins = _session_options(ws)
    except ValueError as exc:
        await _refuse(ws, "invalid_request", str(exc), 1008)
        return
    try:
        with gateway.registry.admit(TRANSPORT) as lease:
            connection = RobotConnection(ws, gateway.settings, pool, decoder, ws.app.state.metrics)
            try:
                session = pool.open(connection.on_reply, rate_hz=rate_hz, latest_wins=latest_wins)
            except PoolFull as exc:
                await _refuse(ws, "server_busy", "every policy slot is taken", 1013, exc.retry_after_s)
                return
            except PoolClosed:
                await _refuse(ws, "shutting_down", "the server is shutting down", 1012)
                return
            lease.drain_target = connection
            try:
                await ws.accept()
                await connection.run(session)
            finally:
                pool.close(session)
    except SessionLimitReached as exc:
        draining = gateway.registry.draining
        code = "shutting_down" if draining else "server_busy"
        await _refuse(ws, code, str(exc), 1012 if draining else 1013, exc.retry_after_s)


def _session_options(ws: WebSocket) -> tuple[float | None, bool]:
    params = ws.query_params
    rate: float | None = None
    if "control_rate_hz" in params:
        try:
            rate = float(params["control_rate_hz"])
        except ValueError:
            raise ValueError("control_rate_hz must be a number of hertz") from None
        if not 0.1 <= rate <= 1000.0:
            raise ValueError("control_rate_hz must be within 0.1..1000")
    on_busy = params.get("on_busy", "refuse")
    if on_busy not in ("refuse", "latest"):
        raise ValueError("on_busy must be refuse or latest")
    return rate, on_busy == "latest"


async def _refuse(ws: WebSocket, code: str, message: str, close_code: int, retry_after_s: float | None = None) -> None:
    extra = {} if retry_after_s is None else {"retry_after": retry_after_s}
    await ws.accept()
    await ws.send_text(msgspec.json.encode(json_error(code, message, **extra)).decode())
    await ws.close(close_code, code)


class RobotConnection:
    """One accepted robot: the reader (observations in) and the sender (replies and refusals out)."""

    def __init__(
        self, ws: WebSocket, settings: Settings, pool: PolicyPool, decoder: ObservationDecoder, metrics: Metrics
    ) -> None:
        self.ws = ws
        self.settings = settings
        self.pool = pool
        self.decoder = decoder
        self.metrics = metrics
        self.session: PolicySession | None = None
        # The refusal the reader waits on, the replies to one observation in a step and one waiting (latest-wins),
        # and the session's final error: never more than that.
        self._outbox: asyncio.Queue[bytes | str] = asyncio.Queue(maxsize=4)
        self._reader: asyncio.Task[None] | None = None
        self._close_code = 1000
        self._close_reason = "client_closed"
        self._end_error: tuple[str, str] | None = None
        self._prev_total_ms: float | None = None
        self._in_flight_since: list[float] = []
        self._receive_timeout: asyncio.Timeout | None = None
        self.disconnected = False

    # ---- drain target -----------------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """No observation waiting, in a step, or answered and not yet handed to the sender."""
        return not self._in_flight_since

    def end(self, code: str, message: str) -> bool:
        """Close from the server's side with a typed error (text) and 1012; False when already ending."""
        reader = self._reader
        if self._end_error is not None or self.disconnected or reader is None or reader.done():
            return False
        self._end_error = (code, message)
        self._close_code, self._close_reason = SERVER_END_CLOSE_CODE, code
        reader.cancel()
        return True

    # ---- serving ------------------------------------------------------------------------------------------------

    async def run(self, session: PolicySession) -> None:
        self.session = session
        loop = asyncio.get_running_loop()
        self._session_deadline = loop.time() + self.settings.max_session_s
        await self.ws.send_bytes(pack(self.pool.info.metadata()))
        sender = asyncio.create_task(self._send_loop(), name="robot-sender")
        reader = self._reader = asyncio.create_task(self._read(), name="robot-reader")
        try:
            # The sender ends only by failing: then nothing would carry the replies, so the reader stops too.
            await asyncio.wait((reader, sender), return_when=asyncio.FIRST_COMPLETED)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            for task in (reader, sender):
                if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
                    self._fail(exc)
            if self._end_error is not None and not self.disconnected:
                await self._send_final(json_error(*self._end_error), sender)
            if not self.disconnected and not sender.done():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._outbox.join(), 1.0)
        finally:
            for task in (reader, sender):
                task.cancel()
            await asyncio.gather(reader, sender, return_exceptions=True)
            await self._close()

    def _fail(self, exc: BaseException) -> None:
        """A task of this session failed (a server fault): end the session with a typed error and 1011."""
        log.error("robot session failed", exc_info=exc)
        if self._end_error is None:
            self._end_error = ("internal_error", "the server failed while serving this session; connect again")
            self._close_code, self._close_reason = INTERNAL_ERROR_CLOSE_CODE, "internal_error"
        if self._reader is not None:
            self._reader.cancel()

    async def _send_final(self, body: dict[str, Any], sender: asyncio.Task[None]) -> None:
        if not sender.done():
            self._enqueue_text(body)
            return
        # the sender failed: the last word goes out directly, within the stall timeout
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.settings.stall_timeout_s):
                await self.ws.send_text(msgspec.json.encode(body).decode())

    def _rearm(self) -> None:
        if self._receive_timeout is None:
            return
        deadline = self._session_deadline
        if self.idle:
            deadline = min(deadline, asyncio.get_running_loop().time() + self.settings.idle_timeout_s)
        self._receive_timeout.reschedule(deadline)

    async def _read(self) -> None:
        while True:
            try:
                async with asyncio.timeout(None) as timeout:
                    self._receive_timeout = timeout
                    self._rearm()
                    message = await self.ws.receive()
            except TimeoutError:
                expired = asyncio.get_running_loop().time() >= self._session_deadline
                reason = "max_duration" if expired else "idle_timeout"
                self._enqueue_text(json_error(reason, f"the session was closed: {reason.replace('_', ' ')}"))
                self._close_code, self._close_reason = (1008 if expired else 4408), reason
                return
            finally:
                self._receive_timeout = None
            if message["type"] == "websocket.disconnect":
                self.disconnected = True
                self._close_reason = "client_disconnected"
                return
            payload = message.get("bytes")
            if payload is None:
                await self._refuse_observation(
                    WireError("invalid_observation", "observations are binary msgpack messages (openpi's format)")
                )
                continue
            await self._on_observation(payload)

    async def _on_observation(self, payload: bytes) -> None:
        assert self.session is not None
        received = time.perf_counter()
        # In flight until its reply reaches this connection, not only until the step ends; refused before decoding.
        if self._in_flight_since and not self.session.latest_wins:
            await self._refuse_observation(IN_FLIGHT)
            return
        try:
            observation = await self.decoder.decode(payload)
            replaced = self.pool.submit(self.session, observation)
        except WireError as exc:
            await self._refuse_observation(exc)
            return
        except DecoderBusy:
            await self._refuse_observation(DECODERS_BUSY)
            return
        except ObservationBusy:
            await self._refuse_observation(IN_FLIGHT)
            return
        except PoolClosed:
            await self._refuse_observation(WireError("shutting_down", "the server is shutting down"))
            return
        if replaced:
            self._in_flight_since[-1] = received  # the waiting one gets no reply: this one takes its place
        else:
            self._in_flight_since.append(received)

    async def _refuse_observation(self, error: WireError) -> None:
        """Answer with the typed refusal, then wait until it is sent: a burst of refused observations is answered at
        the pace the client reads (the transport holds back the rest), never piled up until the session is dropped."""
        self.metrics.robot_refusals.labels(error.code).inc()
        extra = {} if error.param is None else {"param": error.param}
        self._enqueue_text(json_error(error.code, error.message, **extra))
        await self._outbox.join()

    def on_reply(self, reply: PolicyReply) -> None:
        """The scheduler's sink (on the loop): encode the reply and queue it for the sender."""
        try:
            self._reply(reply)
        except Exception as exc:  # on the loop's callback: a failure must end this session, not vanish
            self._fail(exc)

    def _reply(self, reply: PolicyReply) -> None:
        received = self._in_flight_since.pop(0) if self._in_flight_since else time.perf_counter()
        if reply.result is None:
            code, _, message = (reply.error or "engine_error: the policy step failed").partition(": ")
            self._enqueue_text(json_error(code, message or code))
        else:
            result = reply.result
            timing: dict[str, Any] = {
                "infer_ms": result.infer_ms,
                "queue_ms": reply.queue_ms,
                "batch_size": result.batch_size,
            }
            if self._prev_total_ms is not None:
                timing["prev_total_ms"] = self._prev_total_ms
            self._prev_total_ms = (time.perf_counter() - received) * 1000.0
            self.metrics.robot_inference.observe(self._prev_total_ms / 1000.0)
            self._enqueue(pack({"actions": result.actions, "server_timing": timing}))
        self._rearm()

    def _enqueue_text(self, body: dict[str, Any]) -> None:
        self._enqueue(msgspec.json.encode(body).decode())

    def _enqueue(self, message: bytes | str) -> None:
        try:
            self._outbox.put_nowait(message)
        except asyncio.QueueFull:
            # Only a client that sends faster than it reads its refusals gets here: it is dropped, not buffered.
            log.info("closing a robot client that does not read its replies")
            self._drop(1008, "stalled")

    async def _send_loop(self) -> None:
        while True:
            message = await self._outbox.get()
            try:
                async with asyncio.timeout(self.settings.stall_timeout_s):
                    if isinstance(message, bytes):
                        await self.ws.send_bytes(message)
                    else:
                        await self.ws.send_text(message)
            except TimeoutError:
                self._drop(1008, "stalled")
            except (WebSocketDisconnect, RuntimeError, OSError):
                self._drop(1000, "client_disconnected")
            finally:
                self._outbox.task_done()

    def _drop(self, code: int, reason: str) -> None:
        self.disconnected = reason == "client_disconnected"
        self._close_code, self._close_reason = code, reason
        if self._reader is not None:
            self._reader.cancel()

    async def _close(self) -> None:
        if self.disconnected:
            return
        with contextlib.suppress(TimeoutError, WebSocketDisconnect, RuntimeError, OSError):
            async with asyncio.timeout(1.0):
                await self.ws.close(self._close_code, self._close_reason)
