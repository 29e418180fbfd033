"""``omnigate serve`` with an engine core: a supervisor process that runs one engine core and N gateway workers.

The supervisor serves nothing itself. It starts the engine core (``python -m omnigate.engines.core``) and the
gateway workers (``omnigate serve ... --attach-core PATH``), each with the serve options it was given; the workers
bind the port with ``SO_REUSEPORT`` and reach the core over its Unix socket. Either kind of child that exits
unexpectedly is started again after a backoff, however many times it exits (:mod:`restart_policy`): while the core
is down its gateways fail the streams it served with ``engine_unavailable`` and answer ``/ready`` with 503, and attach
again when it is back. A child that keeps failing soon after its start ends serve with status 1.

SIGTERM or SIGINT drains: the signal goes to every worker (each drains its own sessions, as a single gateway does),
and the core is stopped only once every worker has exited, so live utterances finish. A second signal forces the
workers out. The children run in their own process groups, so a terminal's Ctrl-C reaches only the supervisor,
and on Linux each child is killed if the supervisor dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from omnigate.gateway.cli.restart_policy import GiveUp, RestartPolicy, RestartTracker

log = logging.getLogger("omnigate.gateway.cli.supervisor")

CORE_STOP_TIMEOUT_S = 30.0
# After giving up on a child, the workers get this long to drain before they are killed: a worker still starting
# waits for a core that will not come back and does not act on SIGTERM until its startup ends.
GIVE_UP_STOP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: take SIGKILL when the supervisor dies (Linux), so no orphan holds the port."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(eq=False)
class Child:
    """One supervised process and how it has been failing."""

    name: str
    argv: list[str]
    restarts: RestartTracker
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self.argv, start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None
        )
        self.restarts.started(time.monotonic())
        log.info("%s started: pid %d", self.name, self.process.pid)

    async def wait(self) -> int:
        """The exit status of the current process (0 when none was started)."""
        return 0 if self.process is None else await self.process.wait()

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)


class Supervisor:
    def __init__(self, serve_argv: Sequence[str], workers: int, socket_path: str) -> None:
        policy = RestartPolicy()
        self.core = Child(
            "engine core",
            [sys.executable, "-m", "omnigate.engines.core", "--socket", socket_path, *serve_argv],
            RestartTracker(policy),
        )
        worker_argv = [sys.executable, "-m", "omnigate.gateway.cli", *serve_argv, "--attach-core", socket_path]
        self.workers = [Child(f"gateway worker {i}", worker_argv, RestartTracker(policy)) for i in range(workers)]
        self._signals = 0
        self._stop = asyncio.Event()
        self._kill_timer: asyncio.TimerHandle | None = None
        self.exit_code = 0

    def on_signal(self, sig: int) -> None:
        self._signals += 1
        log.info(
            "received %s: %s the gateway workers",
            signal.Signals(sig).name,
            "draining" if self._signals == 1 else "killing",
        )
        self._stop_workers(signal.SIGTERM if self._signals == 1 else signal.SIGKILL)

    def _stop_workers(self, sig: int) -> None:
        self._stop.set()
        for worker in self.workers:
            worker.signal(sig)

    def _kill_workers(self) -> None:
        log.error("gateway workers still running %g s after serve gave up; killing them", GIVE_UP_STOP_TIMEOUT_S)
        self._stop_workers(signal.SIGKILL)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)
        await self.core.start()
        for worker in self.workers:
            await worker.start()
        if self._stop.is_set():  # a signal came while they started: those started after it drain too
            self._stop_workers(signal.SIGTERM)
        # One watcher per child for the supervisor's whole life: it sees every exit, however many restarts.
        core_watch = loop.create_task(self._watch(self.core), name="watch-engine-core")
        worker_watches = [loop.create_task(self._watch(w), name=f"watch-{w.name}") for w in self.workers]
        try:
            # Drain: workers first (they finish their utterances on the core), then the core.
            codes = await asyncio.gather(*worker_watches)
            self.core.signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(CORE_STOP_TIMEOUT_S):
                    await core_watch
            except TimeoutError:
                self.core.signal(signal.SIGKILL)
                await self.core.wait()
        finally:
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            for task in (core_watch, *worker_watches):
                task.cancel()
            await asyncio.gather(core_watch, *worker_watches, return_exceptions=True)
        if any(code != 0 for code in codes):
            self.exit_code = 1
        return self.exit_code

    async def _watch(self, child: Child) -> int:
        """Restart ``child`` each time it exits unexpectedly until serve stops. Returns the exit status of its
        last process when that ended after the stop began (0 when it was not running then)."""
        while True:
            code = await child.wait()
            if self._stop.is_set():
                return code
            decision = child.restarts.exited(time.monotonic())
            if isinstance(decision, GiveUp):
                stable_s = child.restarts.policy.stable_after_s
                log.error(
                    "%s exited with %s: %d failures in a row, each within %g s of its start; it is not restarted "
                    "again: stopping serve (status 1)",
                    child.name,
                    code,
                    decision.failures_in_a_row,
                    stable_s,
                )
                self.exit_code = 1
                self._stop_workers(signal.SIGTERM)
                if self._kill_timer is None:
                    loop = asyncio.get_running_loop()
                    self._kill_timer = loop.call_later(GIVE_UP_STOP_TIMEOUT_S, self._kill_workers)
                return 0
            log.error(
                "%s exited with %s (failure %d in a row); restarting in %.1f s",
                child.name,
                code,
                decision.failures_in_a_row,
                decision.after_s,
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(decision.after_s):
                    await self._stop.wait()
            if self._stop.is_set():
                return 0
            await child.start()
            if self._stop.is_set():  # a signal came while it started: it drains with the others
                child.signal(signal.SIGTERM)


def supervise(serve_argv: Sequence[str], workers: int) -> int:
    """Run the engine core and ``workers`` gateway processes until a signal; the exit status of serve."""
    with tempfile.TemporaryDirectory(prefix="omnigate-core-") as folder:
        os.chmod(folder, 0o700)
        supervisor = Supervisor(serve_argv, workers, os.path.join(folder, "core.sock"))
        return asyncio.run(supervisor.run())
