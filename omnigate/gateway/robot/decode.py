"""Robot observations are decoded off the event loop, on threads of their own, a bounded number at once.

msgpack decoding holds the GIL for as long as it builds objects, so the bytes are first checked against a budget
(:func:`~omnigate.engines.policy.wire.check_budget`: objects, nesting, declared lengths) and only then decoded and
checked against the policy's observation spec, all on this pool's threads. The pool is the robot route's own, so
a robot flood never delays speech encoding or image decoding on other pools. Each session decodes one observation
at a time (its reader awaits the decode); server-wide at most ``max_pending`` decodes run or wait, and one past
that is refused typed (``server_busy``) instead of queued.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future
from typing import Any

from omnigate.engines.policy.spec import Observation, PolicyInfo, check_observation
from omnigate.engines.policy.wire import WireError, unpack
from omnigate.os_threads import named_executor

THREAD_PREFIX = "omnigate-robot-decode"
# Decoding a 2 MB observation takes about a millisecond: a few threads keep up with hundreds of robots.
MAX_THREADS = 4
PENDING_PER_THREAD = 8


def decode_observation(info: PolicyInfo, payload: bytes, max_bytes: int) -> Observation:
    """Bytes to a checked observation (budget, msgpack, spec), or :class:`~omnigate.engines.policy.wire.WireError`.
    Runs on the pool."""
    return check_observation(info, unpack(payload, max_bytes))


class DecoderBusy(Exception):
    """Every decode slot of the server is taken."""


class ObservationDecoder:
    """The robot route's decoding pool, shared by every robot session of the process."""

    def __init__(self, info: PolicyInfo, max_bytes: int, threads: int | None = None) -> None:
        self.info = info
        self.max_bytes = max_bytes
        self.threads = threads or min(MAX_THREADS, os.cpu_count() or 1)
        self.max_pending = self.threads * PENDING_PER_THREAD
        self._executor = named_executor(self.threads, THREAD_PREFIX)
        # Held from submission until the job ends on its thread (not until its awaiter stops waiting), so a
        # cancelled session's decode still counts while it runs.
        self._slots = threading.BoundedSemaphore(self.max_pending)
        self._closed = False

    async def decode(self, payload: bytes) -> Observation:
        """The checked observation. Raises :class:`~omnigate.engines.policy.wire.WireError`, or
        :class:`DecoderBusy` when every slot is taken."""
        if self._closed:
            raise WireError("shutting_down", "the server is shutting down")
        if not self._slots.acquire(blocking=False):
            raise DecoderBusy()
        try:
            job = self._executor.submit(decode_observation, self.info, payload, self.max_bytes)
        except BaseException:
            self._slots.release()
            raise
        job.add_done_callback(self._release)
        return await asyncio.wrap_future(job)

    def _release(self, _job: Future[Any]) -> None:
        self._slots.release()

    def close(self) -> None:
        """Stop the threads once the running decodes end; waiting ones are dropped (their sessions are closed)."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
