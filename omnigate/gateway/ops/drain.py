"""Graceful drain: on SIGTERM stop admitting, let live work finish up to a deadline, close the rest typed.

uvicorn on its own closes every WebSocket with 1012 the moment it shuts down. :class:`DrainingServer` runs the drain
first and lets uvicorn shut down only once the session registry is empty or the deadline has passed:

1. the registry refuses new sessions (WebSocket close 1012 / HTTP 503 with ``shutting_down``) and ``/ready`` answers
   503, so a load balancer stops sending traffic while the listener still answers probes;
2. sessions with nothing in progress are closed at once with a typed ``shutting_down`` error (close code 1012);
   sessions with an utterance or a video generation in progress are closed the same way as soon as it ends;
3. at the deadline every remaining session is closed the same way, and the process exits 0.

Speech sessions are seen through their lease's session driver, other sessions (video over a WebSocket or a WebRTC
call, realtime sessions over either) through the :class:`~omnigate.sessions.registry.DrainTarget` their route
registers on the lease. A realtime session is idle between responses; one still responding at the deadline has its
response cancelled (``response.done`` with status ``cancelled``) before the typed close.

A second signal skips the drain (uvicorn's forced exit).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from types import FrameType

import msgspec
import uvicorn

from omnigate.gateway.state import Gateway
from omnigate.sessions.registry import SessionLease

log = logging.getLogger(__name__)

CLOSE_CODE = "shutting_down"
CLOSE_MESSAGE = "the server is shutting down; reconnect to retry"
# How often the drain looks for sessions that became idle or ended. Sessions signal neither, so the drain re-checks
# at uvicorn's own main-loop rate; it runs once per process lifetime and for seconds at most.
TICK_S = 0.1
# After the deadline: how long closed sessions get to send their close frames before uvicorn takes over.
CLOSE_GRACE_S = 2.0


class DrainReport(msgspec.Struct, frozen=True):
    sessions_at_start: int
    closed_idle: int
    closed_at_deadline: int
    left_open: int
    seconds: float


def _idle(lease: SessionLease) -> bool:
    """Nothing in progress: no utterance collecting, queued or speaking; no video being generated."""
    driver = lease.driver
    if driver is not None:
        return driver.session.pending_utterances == 0
    target = lease.drain_target
    return target is not None and target.idle


def _close(lease: SessionLease) -> bool:
    """Close the session typed; False when it has no way to be closed or is closing already."""
    driver = lease.driver
    if driver is not None:
        if driver.closed:
            return False
        driver.fail(CLOSE_CODE, CLOSE_MESSAGE)
        return True
    target = lease.drain_target
    return target is not None and target.end(CLOSE_CODE, CLOSE_MESSAGE)


async def drain(gateway: Gateway, timeout_s: float) -> DrainReport:
    """Stop admitting and close every session as it goes idle, or at ``timeout_s`` at the latest."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + timeout_s
    registry = gateway.registry
    registry.draining = True
    at_start = registry.total_active
    log.info("draining: %d live sessions, deadline %.1f s", at_start, timeout_s)
    closed_idle = 0
    while registry.total_active and loop.time() < deadline:
        closed_idle += sum(_close(lease) for lease in list(registry.leases) if _idle(lease))
        await asyncio.sleep(TICK_S)
    closed_late = sum(_close(lease) for lease in list(registry.leases))
    grace_end = loop.time() + CLOSE_GRACE_S
    while registry.total_active and loop.time() < grace_end:  # noqa: ASYNC110 - see TICK_S
        await asyncio.sleep(TICK_S)
    report = DrainReport(
        sessions_at_start=at_start,
        closed_idle=closed_idle,
        closed_at_deadline=closed_late,
        left_open=registry.total_active,
        seconds=round(loop.time() - started, 3),
    )
    log.info(
        "drain finished in %.1f s: %d sessions closed when idle, %d at the deadline, %d left to the server",
        report.seconds,
        report.closed_idle,
        report.closed_at_deadline,
        report.left_open,
    )
    return report


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains the gateway before the usual shutdown."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.drain_timeout_s = drain_timeout_s
        self.drain_report: DrainReport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested or self._loop is None or self.should_exit:
            # A second signal, or one before startup finished: uvicorn's own handling (forced on repeat).
            super().handle_exit(sig, frame)
            if self._drain_requested:
                self.force_exit = True
            return
        self._drain_requested = True
        log.info("received %s: draining before shutdown", signal.Signals(sig).name)
        # A signal handler interrupts the loop between bytecodes: hand the work to the loop thread-safely.
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit(), name="gateway-drain")

    async def _drain_then_exit(self) -> None:
        started = time.monotonic()
        try:
            self.drain_report = await drain(self.gateway, self.drain_timeout_s)
        except Exception:
            log.exception("drain failed after %.1f s; shutting down", time.monotonic() - started)
        finally:
            self.should_exit = True
