"""The engine pool: admission by headroom, credit-based flow, deadline-ordered batching on scheduler threads.

The event loop talks to the pool through thread-safe, non-blocking calls (``open``, ``push_text``, ``end_input``,
``grant``, ``abort``); scheduler threads step the engine and hand outputs back with
``loop.call_soon_threadsafe``. No polling: workers sleep on a condition that every state change notifies.

Credit: a stream may emit only as much media time as its consumer has room for. The session grants credit as its
transport drains; a stream with less credit than the engine's smallest emit (``EngineInfo.min_credit_ms``) is not
runnable, so a stalled client costs no engine time.

Deadlines: a stream's deadline is when its client would run out of audio: ``opened + ttfa_target`` before the first
chunk, ``first_chunk + produced`` after it. Each step serves the earliest deadlines first up to the batch size, so
under contention the engine generates just in time and with spare capacity everyone runs flat out.

Admission: a stream is admitted while the pool has headroom (:mod:`omnigate.engines.admission`): its recent worker
time per second of audio, times the streams it carries plus one (a young stream, not yet ahead of its playback,
priced at its burst), must fit its workers, and no stream may have waited past its deadline lately. Past that,
:meth:`EnginePool.open` raises :class:`PoolFull` with a retry hint and :attr:`EnginePool.free_slots` is 0, so new
sessions go elsewhere and the admitted ones keep their deadlines. The ``slots`` policy admits up to the slot count
alone.

Faults: workers are supervised. A step that raises fails the streams of its batch with a typed ``StreamDone``; a
worker that dies (anything escaping the step or its bookkeeping) fails its in-flight batch the same way and restarts
after a short backoff; a step that runs past ``step_timeout_s`` has its streams failed at once by a watchdog thread
(their slots stay held until the engine returns). :attr:`EnginePool.healthy` turns false after
``failure_threshold`` failed steps in a row or while a step is overdue, and true again after a good step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from omnigate.engines.admission import AdmissionController, AdmissionSettings
from omnigate.engines.base import (
    AudioChunk,
    Engine,
    EngineError,
    EngineOutput,
    EngineStream,
    StreamDone,
    SynthesisParams,
)
from omnigate.os_threads import name_os_thread

log = logging.getLogger(__name__)

OutputSink = Callable[[list[EngineOutput]], None]


class PoolFull(Exception):
    """No free slot; the caller refuses the client with a retry hint."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("engine is at capacity")
        self.retry_after_s = retry_after_s


class PoolClosed(Exception):
    """The pool is shutting down and admits nothing."""


StepObserver = Callable[[float, int], None]
"""Called on the scheduler thread after each step with its duration in seconds and its batch size."""

# A crashed worker waits this long before serving again, doubling per crash in a row up to the cap.
_RESTART_BACKOFF_S = 0.05
_RESTART_BACKOFF_MAX_S = 2.0


@dataclass(eq=False)
class PoolStream:
    """The pool's handle for one engine stream."""

    id: int
    stream: EngineStream
    sink: OutputSink
    loop: asyncio.AbstractEventLoop
    opened_at: float
    ttfa_target_s: float
    credit_ms: float
    min_credit_ms: float = 20.0
    first_chunk_at: float | None = None
    produced_ms: float = 0.0
    # the last change that could have made the stream runnable (text, end of input, credit, a finished step):
    # lateness after it is the engine's, before it the client's or the text source's
    waiting_since: float = 0.0
    busy: bool = False
    aborted: bool = False
    finished: bool = False
    closed: bool = False
    # the stream no longer counts for admission (it ended, or was aborted while its last step still runs)
    released: bool = False
    # failed by the supervisor while the engine still held it: whatever that step returns is dropped
    faulted: bool = False
    # admission's ticket while the stream is young (not yet ``ahead_lead_s`` ahead of its playback), else None
    young_ticket: int | None = None
    # the place its session holds (:meth:`EnginePool.reserve`) that the stream runs on, else None
    held: int | None = None
    ahead_lead_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    def deadline(self) -> float:
        if self.first_chunk_at is None:
            return self.opened_at + self.ttfa_target_s
        return self.first_chunk_at + self.produced_ms / 1000.0

    def runnable(self) -> bool:
        return (
            not self.busy
            and not self.aborted
            and not self.finished
            and not self.faulted
            and self.credit_ms >= self.min_credit_ms
            and self.stream.has_work
        )


class EnginePool:
    """Runs one engine for many concurrent streams."""

    def __init__(
        self,
        engine: Engine,
        *,
        ttfa_target_s: float = 0.25,
        retry_after_s: float = 1.0,
        step_timeout_s: float = 60.0,
        failure_threshold: int = 3,
        step_observer: StepObserver | None = None,
        admission: AdmissionSettings | None = None,
    ) -> None:
        self.engine = engine
        self.info = engine.info
        self._ttfa_target_s = ttfa_target_s
        self._retry_after_s = retry_after_s
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # The watchdog waits on its own condition, so a notify() meant for a worker never wakes it instead.
        self._watch = threading.Condition(lock)
        self._streams: dict[int, PoolStream] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self._threads: list[threading.Thread] = []
        self.steps = 0
        self.aborted_total = 0
        self.failed_total = 0
        self.generated_ms_total = 0.0
        self.last_batch_size = 0
        self.step_seconds_total = 0.0
        self._step_timeout_s = step_timeout_s
        self._failure_threshold = failure_threshold
        self._step_observer = step_observer
        # per worker index: the batch it is stepping and when the step began
        self._in_flight: dict[int, tuple[Sequence[PoolStream], float]] = {}
        self._overdue: set[int] = set()
        self.consecutive_failures = 0
        self.failed_steps_total = 0
        self.worker_restarts_total = 0
        self.step_timeouts_total = 0
        self.admission = AdmissionController(self.info.workers, self.info.max_sessions, self.info.max_batch, admission)
        if self.info.rtf_hint is not None:
            self.admission.seed(self.info.rtf_hint)
        if self.info.step_profile:
            self.admission.profile(self.info.step_profile, self.info.min_credit_ms)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        for i in range(self.info.workers):
            t = threading.Thread(
                target=self._supervised_worker, args=(i,), name=f"omnigate-{self.info.family}-{i}", daemon=True
            )
            t.start()
            self._threads.append(t)
        watchdog = threading.Thread(target=self._watchdog, name=f"omnigate-{self.info.family}-watchdog", daemon=True)
        watchdog.start()
        self._threads.append(watchdog)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the workers, abort every stream and release the engine. Blocking: call from a thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            self._watch.notify_all()
        for t in self._threads:
            t.join(timeout)
        with self._cond:
            for ps in list(self._streams.values()):
                self._close_locked(ps)
            self._streams.clear()
        self.engine.shutdown()

    # ---- event-loop side --------------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False while the engine fails every step or a step is overdue; true again after a good step."""
        return self.health_problem is None

    @property
    def health_problem(self) -> str | None:
        with self._cond:
            if self._overdue:
                return f"an engine step has run for more than {self._step_timeout_s:g} s"
            if self.consecutive_failures >= self._failure_threshold:
                return f"the last {self.consecutive_failures} engine steps failed"
            return None

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._streams)

    @property
    def free_slots(self) -> int:
        """Streams the pool would admit now: free slots, or with headroom admission the streams that still fit."""
        with self._cond:
            now = time.monotonic()
            free = max(0, self.info.max_sessions - len(self._streams))
            return min(free, self.admission.headroom(now, self._slack_locked(now)))

    def has_free_slot(self) -> bool:
        """Whether the pool would admit one more stream now (:attr:`free_slots` > 0, without counting them all)."""
        with self._cond:
            now = time.monotonic()
            if len(self._streams) >= self.info.max_sessions:
                return False
            return self.admission.headroom(now, self._slack_locked(now), limit=1) > 0

    @property
    def queue_depth(self) -> int:
        """Streams that could run now but are waiting for a worker."""
        with self._cond:
            return len(self._runnable_locked())

    def reserve(self) -> int:
        """Hold a place for a session (admission decides as for a stream): its ticket, for :meth:`open` and
        :meth:`release`. Raises :class:`PoolFull` or :class:`PoolClosed`."""
        with self._cond:
            if self._closing:
                raise PoolClosed()
            now = time.monotonic()
            ticket = None
            if len(self._streams) < self.info.max_sessions:
                # The cost and a closed period first: under overload most asks are refused there, without the scan
                # of every stream that the slack takes (thousands of refusals a second would spend it each time).
                if self.admission.headroom(now, None, limit=1) > 0:
                    ticket = self.admission.reserve(now, self._slack_locked(now))
                else:
                    self.admission.refused_total += 1
            if ticket is None:
                raise PoolFull(self.admission.retry_after_s(now, self._retry_after_s))
            return ticket

    def release(self, ticket: int) -> None:
        """The session of the place ``ticket`` ended. Idempotent."""
        with self._cond:
            self.admission.release(ticket)

    def open(
        self, params: SynthesisParams, sink: OutputSink, *, initial_credit_ms: float, held: int | None = None
    ) -> PoolStream:
        """Admit one utterance stream: on the place ``held`` its session holds (:meth:`reserve`) while no other
        stream runs on it, else by admission. Raises :class:`PoolFull` or :class:`PoolClosed`."""
        loop = asyncio.get_running_loop()
        stream = self.engine.open(params)
        with self._cond:
            if self._closing:
                self.engine.close(stream)
                raise PoolClosed()
            if len(self._overdue) >= self.info.workers:
                self.engine.close(stream)
                raise EngineError("engine_unavailable", "the engine is not responding; retry shortly")
            now = time.monotonic()
            on_held = held is not None and self.admission.holds(held)
            if len(self._streams) >= self.info.max_sessions or not (
                on_held or self.admission.admits(now, self._slack_locked(now))
            ):
                self.engine.close(stream)
                raise PoolFull(self.admission.retry_after_s(now, self._retry_after_s))
            ps = PoolStream(
                id=next(self._ids),
                stream=stream,
                sink=sink,
                loop=loop,
                opened_at=now,
                ttfa_target_s=self._ttfa_target_s,
                credit_ms=initial_credit_ms,
                min_credit_ms=self.info.min_credit_ms,
                waiting_since=now,
            )
            self._streams[ps.id] = ps
            ps.held = held if on_held else None
            ps.young_ticket = self.admission.opened(now, ps.held)
            ps.ahead_lead_s = self.admission.ahead_lead_s(initial_credit_ms)
            self._cond.notify()
            return ps

    def push_text(self, ps: PoolStream, text: str, tokens: list[int] | None = None) -> None:
        """Queue a text unit, with its token ids where the caller made them (:attr:`EngineInfo.unit_tokens`)."""
        with self._cond:
            if ps.closed or ps.stream.input_done:
                return
            ps.stream.push_text(text, tokens)
            ps.waiting_since = time.monotonic()
            self._cond.notify()

    def end_input(self, ps: PoolStream) -> None:
        with self._cond:
            if ps.closed:
                return
            ps.stream.input_done = True
            ps.waiting_since = time.monotonic()
            self._cond.notify()

    def grant(self, ps: PoolStream, ms: float) -> None:
        """Give the stream ``ms`` more media time it may produce."""
        with self._cond:
            if ps.closed:
                return
            ps.credit_ms += ms
            ps.waiting_since = time.monotonic()
            self._cond.notify()

    def abort(self, ps: PoolStream) -> None:
        """Stop all work for the stream now and free its slot. Idempotent. No output follows."""
        with self._cond:
            if ps.closed:
                return
            ps.aborted = True
            self.aborted_total += 1
            if not ps.busy:
                self._close_locked(ps)
            else:
                # Its last step only finishes: the work is over for admission, so a client that hangs up and asks
                # again is not refused for the rest of a step it no longer wants.
                self._release_locked(ps)

    # ---- scheduler side ----------------------------------------------------------------------------------------

    def _close_locked(self, ps: PoolStream) -> None:
        if ps.closed:
            return
        ps.closed = True
        if self._streams.pop(ps.id, None) is not None:
            self._release_locked(ps)
        try:
            self.engine.close(ps.stream)
        except Exception:
            log.exception("engine close failed")
        self._cond.notify_all()

    def _release_locked(self, ps: PoolStream) -> None:
        if ps.released:
            return
        ps.released = True
        # An aborted stream frees its share at once (its client left or cancelled); a completed one keeps it for its
        # session's next utterance.
        completed = ps.finished and not ps.faulted and not ps.aborted
        self.admission.closed(time.monotonic(), keep_share=completed, ticket=ps.young_ticket, held=ps.held)
        ps.young_ticket = None

    def _slack_locked(self, now: float) -> float | None:
        """How far ahead of its deadline runs the most pressed stream that had got ahead and has waited for a worker
        for half the admission's slack floor (a stream that just became runnable with little lead is its text
        source's or its consumer's doing, not the workers')."""
        if self.admission.settings.policy != "headroom":
            return None
        waited_s = self.admission.settings.min_slack_s / 2
        slack: float | None = None
        for ps in self._streams.values():
            if ps.young_ticket is not None or ps.first_chunk_at is None or now - ps.waiting_since < waited_s:
                continue
            try:
                waiting = ps.runnable()
            except Exception:  # the engine's has_work raised: the next pick fails that stream
                continue
            if waiting and (slack is None or ps.deadline() - now < slack):
                slack = ps.deadline() - now
        return slack

    def _pick_locked(self) -> list[PoolStream]:
        return self._runnable_locked()[: self.info.max_batch]

    def _runnable_locked(self) -> list[PoolStream]:
        """Streams that could step now, earliest deadline first."""
        runnable = []
        for ps in list(self._streams.values()):
            try:
                if ps.runnable():
                    runnable.append(ps)
            except Exception as exc:  # the engine's has_work raised: that stream alone fails
                log.exception("engine stream state check failed")
                self._fail_locked(ps, f"engine_error: {type(exc).__name__}")
                self._close_locked(ps)
        runnable.sort(key=PoolStream.deadline)
        return runnable

    def _supervised_worker(self, index: int) -> None:
        """Serve until the pool closes; whatever kills the serving loop fails its batch, and the loop restarts."""
        name_os_thread()
        crashes_in_a_row = 0
        while True:
            try:
                self._worker(index)
                return
            except BaseException as exc:  # a worker must outlive anything an engine throws, SystemExit included
                crashes_in_a_row += 1
                log.error("engine worker %d crashed (%s); restarting", index, type(exc).__name__, exc_info=exc)
                self._fail_in_flight(index, f"engine_error: worker crashed ({type(exc).__name__})")
            backoff = min(_RESTART_BACKOFF_MAX_S, _RESTART_BACKOFF_S * 2 ** (crashes_in_a_row - 1))
            with self._cond:
                self.worker_restarts_total += 1
                if self._cond.wait_for(lambda: self._closing, timeout=backoff):
                    return

    def _worker(self, index: int) -> None:
        while True:
            with self._cond:
                batch = self._pick_locked()
                while not batch and not self._closing:
                    self._cond.wait()
                    batch = self._pick_locked()
                if self._closing:
                    return
                now = time.monotonic()
                for ps in batch:
                    ps.busy = True
                    # Late for want of a worker: the streams admitted are more than the workers carry.
                    self.admission.observe_late(now, now - max(ps.deadline(), ps.waiting_since))
                budgets = [ps.credit_ms for ps in batch]
                due = [max(ps.deadline(), ps.waiting_since) for ps in batch]
                self._in_flight[index] = (batch, now)
                self._watch.notify()  # the watchdog learns the new step deadline
            self._run_step(batch, budgets, due)
            with self._cond:
                self._in_flight.pop(index, None)
                self._overdue.discard(index)

    def _fail_in_flight(self, index: int, error: str) -> None:
        """A worker died: end every stream of its batch that is still open with a typed error."""
        with self._cond:
            batch, _ = self._in_flight.pop(index, ((), 0.0))
            self._overdue.discard(index)
            self.consecutive_failures += 1
            self.failed_steps_total += 1
            for ps in batch:
                ps.busy = False
                if ps.closed:
                    continue
                self._fail_locked(ps, error)
                self._close_locked(ps)
            self._cond.notify_all()

    def _fail_locked(self, ps: PoolStream, error: str) -> None:
        """Send the stream's consumer a terminal error now; nothing the engine produces for it later is delivered."""
        if ps.faulted or ps.aborted:
            return
        ps.faulted = True
        self.failed_total += 1
        outputs: list[EngineOutput] = [StreamDone(reason="error", error=error)]
        with contextlib.suppress(RuntimeError):
            ps.loop.call_soon_threadsafe(self._deliver, [(ps, outputs)])

    def _watchdog(self) -> None:
        """Fail the streams of a step that overruns ``step_timeout_s``; sleeps until the earliest step deadline."""
        name_os_thread()
        with self._cond:
            while not self._closing:
                now = time.monotonic()
                wait_s: float | None = None
                for index, (batch, started) in self._in_flight.items():
                    if index in self._overdue:
                        continue
                    left = started + self._step_timeout_s - now
                    if left <= 0:
                        self._on_overdue_locked(index, batch)
                    elif wait_s is None or left < wait_s:
                        wait_s = left
                self._watch.wait(wait_s)

    def _on_overdue_locked(self, index: int, batch: Sequence[PoolStream]) -> None:
        log.error("engine step on worker %d overran %.1f s; failing its streams", index, self._step_timeout_s)
        self._overdue.add(index)
        self.step_timeouts_total += 1
        for ps in batch:
            self._fail_locked(ps, "engine_timeout: the engine step did not finish in time")
        if len(self._overdue) >= self.info.workers:
            # No worker is left to serve anyone: waiting streams would wait forever.
            for ps in list(self._streams.values()):
                if not ps.busy:
                    self._fail_locked(ps, "engine_unavailable: the engine is not responding")
                    self._close_locked(ps)

    def _run_step(self, batch: Sequence[PoolStream], budgets: Sequence[float], due: Sequence[float]) -> None:
        """Step ``batch``; ``due[i]`` is when stream ``i`` needed its next output (its deadline, or when it became
        runnable if later): output that comes after it came too late for the listener."""
        t0 = time.monotonic()
        try:
            outputs = self.engine.step([ps.stream for ps in batch], budgets)
            failed = False
        except EngineError as exc:
            outputs = [[StreamDone(reason="error", error=f"{exc.code}: {exc.message}")] for _ in batch]
            failed = True
        except Exception as exc:
            log.exception("engine step failed")
            outputs = [[StreamDone(reason="error", error=f"engine_error: {type(exc).__name__}")] for _ in batch]
            failed = True
        now = time.monotonic()
        if self._step_observer is not None:
            self._step_observer(now - t0, len(batch))
        if len(outputs) != len(batch):
            raise RuntimeError(f"engine step returned {len(outputs)} output lists for a batch of {len(batch)}")
        with self._cond:
            self.steps += 1
            self.last_batch_size = len(batch)
            self.step_seconds_total += now - t0
            if failed:
                self.consecutive_failures += 1
                self.failed_steps_total += 1
            else:
                self.consecutive_failures = 0
            step_audio_ms = 0.0
            # every stream's outputs of this step, handed to each event loop in one call (one wake-up, not one per
            # stream: at hundreds of streams per step the hand-off is the loop's largest cost)
            handoff: dict[asyncio.AbstractEventLoop, list[tuple[PoolStream, list[EngineOutput]]]] = {}
            for ps, out, needed_at in zip(batch, outputs, due, strict=True):
                if not failed and ps.first_chunk_at is not None and any(isinstance(item, AudioChunk) for item in out):
                    # Too late for a listener already playing; a slow first chunk underruns nobody (the cost estimate
                    # accounts for it), and counting it would refuse the next client of a lone slow first unit.
                    self.admission.observe_late(now, now - needed_at)
                ps.busy = False
                ps.waiting_since = now
                if ps.aborted or ps.faulted:
                    self._close_locked(ps)
                    continue
                for item in out:
                    if isinstance(item, AudioChunk):
                        ms = item.duration_ms
                        ps.credit_ms -= ms
                        ps.produced_ms += ms
                        ps.stream.audio_ms += ms
                        self.generated_ms_total += ms
                        step_audio_ms += ms
                        if ps.first_chunk_at is None:
                            ps.first_chunk_at = now
                    elif isinstance(item, StreamDone):
                        ps.finished = True
                        if item.reason == "error":
                            self.failed_total += 1
                if (
                    ps.young_ticket is not None
                    and ps.first_chunk_at is not None
                    and ps.deadline() - now >= ps.ahead_lead_s
                ):
                    # Ahead of its playback: from now on it needs its steady share only.
                    self.admission.ahead(ps.young_ticket)
                    ps.young_ticket = None
                if ps.finished:
                    self._close_locked(ps)
                if out:
                    handoff.setdefault(ps.loop, []).append((ps, out))
            for loop, delivered in handoff.items():
                # A closed loop has nobody left to receive the outputs.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._deliver, delivered)
            if not failed:
                self.admission.observe_step(now, now - t0, step_audio_ms, len(batch))
            self._cond.notify_all()

    def _deliver(self, delivered: list[tuple[PoolStream, list[EngineOutput]]]) -> None:
        # Runs on the loop, where abort() runs too: nothing reaches a sink after its stream was aborted.
        for ps, outputs in delivered:
            if not ps.aborted:
                ps.sink(outputs)
