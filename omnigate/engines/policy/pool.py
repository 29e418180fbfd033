"""The policy scheduler: robot sessions admitted by slots, observations batched deadline-first on one thread.

Each session has at most one observation in flight. A second one before the reply is refused
(:class:`ObservationBusy`), or, for a session that asked for latest-wins, replaces the one still waiting (the
replaced one gets no reply); an observation already in a step is always answered.

Deadlines: an observation is due one control period after it arrived. The period is the one the session declared,
else the one measured between its observations (a moving average), else the policy's default rate. Each step takes
the waiting observations earliest deadline first, up to the batch size: under contention a session that is late,
or that runs at a faster rate, goes first; with spare capacity every observation is served at once. A session that
sends nothing costs nothing.

The scheduler has the speech pool's shape (slots with :class:`~omnigate.engines.pool.PoolFull` and
:class:`~omnigate.engines.pool.PoolClosed`, a scheduler thread stepping the engine with earliest-deadline-first
batches, a step observer, results handed to the event loop with ``call_soon_threadsafe``), but not its code: the
speech pool's streams are text in and credit-metered audio out (``SynthesisParams``, ``grant(ms)``, deadlines from
the audio produced so far), none of which a policy has, while a policy needs per-observation replies and
latest-wins replacement, which a speech stream does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from omnigate.engines.base import EngineError
from omnigate.engines.policy.spec import Observation, PolicyResult, PolicyStream
from omnigate.engines.pool import PoolClosed, PoolFull, StepObserver

if TYPE_CHECKING:
    # torch: the gateway imports this scheduler for its route, and loads a policy only for --robot-model
    from omnigate.engines.policy.engine import PolicyEngine

log = logging.getLogger(__name__)

# The measured period follows a session's pace with this weight for the newest interval.
_PERIOD_EWMA = 0.2
MIN_RATE_HZ = 0.1
MAX_RATE_HZ = 1000.0


class ObservationBusy(Exception):
    """The session's previous observation has not been answered yet (and it did not ask for latest-wins)."""


class PolicyReply(msgspec.Struct):
    """The answer to one observation: ``result``, or ``error`` (``code: message``) when its step failed."""

    result: PolicyResult | None
    error: str | None
    received_at: float
    queue_ms: float


ReplySink = Callable[[PolicyReply], None]


@dataclass(eq=False)
class PolicySession:
    """The scheduler's handle for one robot session."""

    id: int
    stream: PolicyStream
    sink: ReplySink
    loop: asyncio.AbstractEventLoop
    default_period_s: float
    declared_period_s: float | None = None
    latest_wins: bool = False
    measured_period_s: float | None = None
    last_arrival: float | None = None
    pending: Observation | None = None
    pending_arrival: float = 0.0
    busy: bool = False
    closed: bool = False

    @property
    def period_s(self) -> float:
        if self.declared_period_s is not None:
            return self.declared_period_s
        if self.measured_period_s is not None:
            return self.measured_period_s
        return self.default_period_s

    def deadline(self) -> float:
        return self.pending_arrival + self.period_s

    @property
    def in_flight(self) -> bool:
        return self.busy or self.pending is not None


class PolicyPool:
    """Runs one policy engine for many robot sessions."""

    def __init__(
        self,
        engine: PolicyEngine,
        *,
        retry_after_s: float = 1.0,
        failure_threshold: int = 3,
        step_observer: StepObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_batch: int | None = None,
    ) -> None:
        self.engine = engine
        self.info = engine.info
        self.max_batch = engine.info.max_batch if max_batch is None else max(1, min(max_batch, engine.info.max_batch))
        self._retry_after_s = retry_after_s
        self._failure_threshold = failure_threshold
        self._step_observer = step_observer
        self._clock = clock
        self._cond = threading.Condition()
        self._sessions: dict[int, PolicySession] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.observations_total = 0
        self.replaced_total = 0
        self.failed_steps_total = 0
        self.consecutive_failures = 0
        self.last_batch_size = 0

    # ---- lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="omnigate-policy", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0, *, shutdown_engine: bool = True) -> None:
        """Stop the scheduler and release the engine (unless another scheduler shares it). Blocking."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:
            for session in list(self._sessions.values()):
                self._close_locked(session)
        if shutdown_engine:
            self.engine.shutdown()

    # ---- gauges ---------------------------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._sessions)

    @property
    def waiting(self) -> int:
        """Observations waiting for a step."""
        with self._cond:
            return sum(1 for s in self._sessions.values() if s.pending is not None and not s.busy)

    @property
    def health_problem(self) -> str | None:
        with self._cond:
            if self.consecutive_failures >= self._failure_threshold:
                return f"the last {self.consecutive_failures} policy steps failed"
            return None

    # ---- event-loop side ----------------------------------------------------------------------------------------

    def open(self, sink: ReplySink, *, rate_hz: float | None = None, latest_wins: bool = False) -> PolicySession:
        """Admit one robot session. Raises :class:`PoolFull` or :class:`PoolClosed`."""
        if rate_hz is not None and not MIN_RATE_HZ <= rate_hz <= MAX_RATE_HZ:
            raise ValueError(f"control rate must be within {MIN_RATE_HZ:g}..{MAX_RATE_HZ:g} Hz")
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._closing:
                raise PoolClosed()
            if len(self._sessions) >= self.info.max_sessions:
                raise PoolFull(self._retry_after_s)
            session = PolicySession(
                id=next(self._ids),
                stream=self.engine.open(),
                sink=sink,
                loop=loop,
                default_period_s=1.0 / self.info.control_rate_hz,
                declared_period_s=None if rate_hz is None else 1.0 / rate_hz,
                latest_wins=latest_wins,
            )
            self._sessions[session.id] = session
            return session

    def submit(self, session: PolicySession, observation: Observation) -> bool:
        """Queue the session's next observation; True when it replaced a waiting one (latest-wins), which then gets
        no reply. Raises :class:`ObservationBusy` or :class:`PoolClosed`."""
        with self._cond:
            if session.closed or self._closing:
                raise PoolClosed()
            if session.in_flight and not session.latest_wins:
                raise ObservationBusy()
            now = self._clock()
            if session.last_arrival is not None:
                interval = now - session.last_arrival
                previous = session.measured_period_s
                session.measured_period_s = (
                    interval if previous is None else previous + _PERIOD_EWMA * (interval - previous)
                )
            session.last_arrival = now
            replaced = session.pending is not None
            if replaced:
                self.replaced_total += 1
            session.pending = observation
            session.pending_arrival = now
            self.observations_total += 1
            self._cond.notify()
            return replaced

    def close(self, session: PolicySession) -> None:
        """End the session: a waiting observation is dropped, a running one's reply is not delivered. Idempotent."""
        with self._cond:
            self._close_locked(session)

    def _close_locked(self, session: PolicySession) -> None:
        if session.closed:
            return
        session.closed = True
        session.pending = None
        self._sessions.pop(session.id, None)
        if not session.busy:
            self.engine.close(session.stream)

    # ---- scheduler side ---------------------------------------------------------------------------------------

    def pick_locked(self) -> list[PolicySession]:
        """The waiting sessions earliest deadline first, up to the batch size."""
        waiting = [s for s in self._sessions.values() if s.pending is not None and not s.busy]
        waiting.sort(key=PolicySession.deadline)
        return waiting[: self.max_batch]

    def _serve(self) -> None:
        while True:
            with self._cond:
                batch = self.pick_locked()
                while not batch and not self._closing:
                    self._cond.wait()
                    batch = self.pick_locked()
                if self._closing:
                    return
                arrivals = []
                for session in batch:
                    session.stream.observation = session.pending
                    arrivals.append(session.pending_arrival)
                    session.pending = None
                    session.busy = True
            try:
                self._step(batch, arrivals)
            except BaseException:  # the scheduler must outlive anything the engine throws
                log.exception("policy scheduler step crashed")
                with self._cond:
                    # Whoever was not answered before the crash is answered now: no session waits on a lost step.
                    for session, arrived in zip(batch, arrivals, strict=True):
                        if session.busy:
                            self._answer_locked(session, None, "engine_error: the policy step crashed", arrived, 0.0)

    def _step(self, batch: list[PolicySession], arrivals: list[float]) -> None:
        started = self._clock()
        results: list[PolicyResult | None]
        error: str | None = None
        try:
            results = list(self.engine.step([s.stream for s in batch]))
            if len(results) != len(batch):
                raise RuntimeError(f"the policy returned {len(results)} results for a batch of {len(batch)}")
        except EngineError as exc:
            results, error = [None] * len(batch), f"{exc.code}: {exc.message}"
        except Exception as exc:
            log.exception("policy step failed")
            results, error = [None] * len(batch), f"engine_error: {type(exc).__name__}"
        finished = self._clock()
        if self._step_observer is not None:
            self._step_observer(finished - started, len(batch))
        with self._cond:
            self.steps += 1
            self.last_batch_size = len(batch)
            if error is None:
                self.consecutive_failures = 0
            else:
                self.consecutive_failures += 1
                self.failed_steps_total += 1
            for session, result, arrived in zip(batch, results, arrivals, strict=True):
                self._answer_locked(session, result, error, arrived, (started - arrived) * 1e3)
            self._cond.notify_all()

    def _answer_locked(
        self, session: PolicySession, result: PolicyResult | None, error: str | None, arrived: float, queue_ms: float
    ) -> None:
        """End the session's step and hand its reply to its loop (a closed session's stream is released instead)."""
        session.busy = False
        session.stream.observation = None
        if session.closed:
            self.engine.close(session.stream)
            return
        reply = PolicyReply(result=result, error=error, received_at=arrived, queue_ms=queue_ms)
        with contextlib.suppress(RuntimeError):  # a closed loop has nobody left to receive it
            session.loop.call_soon_threadsafe(_deliver, session, reply)


def _deliver(session: PolicySession, reply: PolicyReply) -> None:
    # On the loop, where close() runs too: nothing reaches a closed session's sink.
    if not session.closed:
        session.sink(reply)
