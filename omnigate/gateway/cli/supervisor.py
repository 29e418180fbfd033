"""``omnigate serve`` with an engine core: a supervisor process that runs one engine core and N gateway workers.

The supervisor serves nothing itself. It starts the engine core (``python -m omnigate.engines.core``) and the
gateway workers (``omnigate serve ... --attach-core PATH``), each with the serve options it was given; the workers
bind the port with ``SO_REUSEPORT`` and reach the core over its Unix socket. Either kind of child that exits
unexpectedly is started again after a backoff: while the core is down its gateways fail the streams it served with
``engine_unavailable`` and answer ``/ready`` with 503, and attach again when it is back.

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

log = logging.getLogger("omnigate.gateway.cli.supervisor")

RESTART_BACKOFF_S = 0.2
RESTART_BACKOFF_MAX_S = 5.0
# A child that ran this long before exiting restarts without the backoff accumulated by earlier crashes.
STABLE_AFTER_S = 30.0
# A worker that fails this many times in a row without running stably (the port is taken, bad options) ends serve.
MAX_WORKER_FAILURES = 5
CORE_STOP_TIMEOUT_S = 30.0
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
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    failures_in_a_row: int = 0
    waiter: asyncio.Task[int] | None = field(default=None, repr=False)

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self.argv, start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None
        )
        self.started_at = time.monotonic()
        self.waiter = asyncio.get_running_loop().create_task(self.process.wait(), name=f"wait-{self.name}")
        log.info("%s started: pid %d", self.name, self.process.pid)

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)

    def exited(self) -> float:
        """Book an exit: returns the backoff before a restart."""
        ran_s = time.monotonic() - self.started_at
        self.failures_in_a_row = 1 if ran_s >= STABLE_AFTER_S else self.failures_in_a_row + 1
        backoff: float = RESTART_BACKOFF_S * 2.0 ** (self.failures_in_a_row - 1)
        return min(RESTART_BACKOFF_MAX_S, backoff)


class Supervisor:
    def __init__(self, serve_argv: Sequence[str], workers: int, socket_path: str) -> None:
        self.core = Child(
            "engine core", [sys.executable, "-m", "omnigate.engines.core", "--socket", socket_path, *serve_argv]
        )
        worker_argv = [sys.executable, "-m", "omnigate.gateway.cli", *serve_argv, "--attach-core", socket_path]
        self.workers = [Child(f"gateway worker {i}", worker_argv) for i in range(workers)]
        self._signals = 0
        self._stop = asyncio.Event()
        self.exit_code = 0

    def on_signal(self, sig: int) -> None:
        self._signals += 1
        self._stop.set()
        forward = signal.SIGTERM if self._signals == 1 else signal.SIGKILL
        log.info(
            "received %s: %s the gateway workers",
            signal.Signals(sig).name,
            "draining" if self._signals == 1 else "killing",
        )
        for worker in self.workers:
            worker.signal(forward)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)
        await self.core.start()
        for worker in self.workers:
            await worker.start()
        restarts: set[asyncio.Task[None]] = set()
        stop_wait = loop.create_task(self._stop.wait(), name="supervisor-stop")
        try:
            while not self._stop.is_set():
                waiters = {c.waiter: c for c in (self.core, *self.workers) if c.waiter is not None}
                done, _ = await asyncio.wait({*waiters, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    child = waiters.get(task)
                    if child is None or self._stop.is_set():
                        continue
                    child.waiter = None
                    backoff = child.exited()
                    log.error("%s exited with %s; restarting in %.1f s", child.name, task.result(), backoff)
                    if child is not self.core and child.failures_in_a_row > MAX_WORKER_FAILURES:
                        log.error("%s keeps failing; stopping", child.name)
                        self.exit_code = 1
                        self.on_signal(signal.SIGTERM)
                        break
                    restart = loop.create_task(self._restart(child, backoff), name=f"restart-{child.name}")
                    restarts.add(restart)
                    restart.add_done_callback(restarts.discard)
        finally:
            stop_wait.cancel()
            for restart in list(restarts):
                restart.cancel()
            await asyncio.gather(*restarts, return_exceptions=True)
        # Drain: workers first (they finish their utterances on the core), then the core.
        codes = [await w.waiter if w.waiter is not None else 0 for w in self.workers]
        self.core.signal(signal.SIGTERM)
        if self.core.waiter is not None:
            try:
                async with asyncio.timeout(CORE_STOP_TIMEOUT_S):
                    await self.core.waiter
            except TimeoutError:
                self.core.signal(signal.SIGKILL)
                await self.core.waiter
        if any(code != 0 for code in codes):
            self.exit_code = 1
        return self.exit_code

    async def _restart(self, child: Child, backoff_s: float) -> None:
        await asyncio.sleep(backoff_s)
        if not self._stop.is_set():
            await child.start()
            if self._stop.is_set():  # a signal came while it started: it drains with the others
                child.signal(signal.SIGTERM)


def supervise(serve_argv: Sequence[str], workers: int) -> int:
    """Run the engine core and ``workers`` gateway processes until a signal; the exit status of serve."""
    with tempfile.TemporaryDirectory(prefix="omnigate-core-") as folder:
        os.chmod(folder, 0o700)
        supervisor = Supervisor(serve_argv, workers, os.path.join(folder, "core.sock"))
        return asyncio.run(supervisor.run())
