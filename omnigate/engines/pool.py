"""The engine pool: admission by slots, credit-based flow, deadline-ordered batching on scheduler threads.

The event loop talks to the pool through thread-safe, non-blocking calls (``open``, ``push_text``, ``end_input``,
``grant``, ``abort``); scheduler threads step the engine and hand outputs back with
``loop.call_soon_threadsafe``. No polling: workers sleep on a condition that every state change notifies.

Credit: a stream may emit only as much media time as its consumer has room for. The session grants credit as its
transport drains; a stream with less credit than the engine's smallest emit (``EngineInfo.min_credit_ms``) is not
runnable, so a stalled client costs no engine time.

Deadlines: a stream's deadline is when its client would run out of audio: ``opened + ttfa_target`` before the first
chunk, ``first_chunk + produced`` after it. Each step serves the earliest deadlines first up to the batch size, so
under contention the engine generates just in time and with spare capacity everyone runs flat out.
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

from omnigate.engines.base import (
    AudioChunk,
    Engine,
    EngineError,
    EngineOutput,
    EngineStream,
    StreamDone,
    SynthesisParams,
)

log = logging.getLogger(__name__)

OutputSink = Callable[[list[EngineOutput]], None]


class PoolFull(Exception):
    """No free slot; the caller refuses the client with a retry hint."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("engine is at capacity")
        self.retry_after_s = retry_after_s


class PoolClosed(Exception):
    """The pool is shutting down and admits nothing."""


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
    busy: bool = False
    aborted: bool = False
    finished: bool = False
    closed: bool = False
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
            and self.credit_ms >= self.min_credit_ms
            and self.stream.has_work
        )


class EnginePool:
    """Runs one engine for many concurrent streams."""

    def __init__(self, engine: Engine, *, ttfa_target_s: float = 0.25, retry_after_s: float = 1.0) -> None:
        self.engine = engine
        self.info = engine.info
        self._ttfa_target_s = ttfa_target_s
        self._retry_after_s = retry_after_s
        self._cond = threading.Condition()
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

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        for i in range(self.info.workers):
            t = threading.Thread(target=self._worker, name=f"omnigate-{self.info.family}-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the workers, abort every stream and release the engine. Blocking: call from a thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
        with self._cond:
            for ps in list(self._streams.values()):
                self._close_locked(ps)
            self._streams.clear()
        self.engine.shutdown()

    # ---- event-loop side --------------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._streams)

    @property
    def free_slots(self) -> int:
        return max(0, self.info.max_sessions - self.active)

    @property
    def queue_depth(self) -> int:
        """Streams that could run now but are waiting for a worker."""
        with self._cond:
            return sum(1 for ps in self._streams.values() if ps.runnable())

    def open(self, params: SynthesisParams, sink: OutputSink, *, initial_credit_ms: float) -> PoolStream:
        """Admit one utterance stream. Raises :class:`PoolFull` or :class:`PoolClosed`."""
        loop = asyncio.get_running_loop()
        stream = self.engine.open(params)
        with self._cond:
            if self._closing:
                self.engine.close(stream)
                raise PoolClosed()
            if len(self._streams) >= self.info.max_sessions:
                self.engine.close(stream)
                raise PoolFull(self._retry_after_s)
            ps = PoolStream(
                id=next(self._ids),
                stream=stream,
                sink=sink,
                loop=loop,
                opened_at=time.monotonic(),
                ttfa_target_s=self._ttfa_target_s,
                credit_ms=initial_credit_ms,
                min_credit_ms=self.info.min_credit_ms,
            )
            self._streams[ps.id] = ps
            self._cond.notify()
            return ps

    def push_text(self, ps: PoolStream, text: str) -> None:
        with self._cond:
            if ps.closed or ps.stream.input_done:
                return
            ps.stream.pending_text.append(text)
            self._cond.notify()

    def end_input(self, ps: PoolStream) -> None:
        with self._cond:
            if ps.closed:
                return
            ps.stream.input_done = True
            self._cond.notify()

    def grant(self, ps: PoolStream, ms: float) -> None:
        """Give the stream ``ms`` more media time it may produce."""
        with self._cond:
            if ps.closed:
                return
            ps.credit_ms += ms
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

    # ---- scheduler side ----------------------------------------------------------------------------------------

    def _close_locked(self, ps: PoolStream) -> None:
        if ps.closed:
            return
        ps.closed = True
        self._streams.pop(ps.id, None)
        try:
            self.engine.close(ps.stream)
        except Exception:
            log.exception("engine close failed")
        self._cond.notify_all()

    def _pick_locked(self) -> list[PoolStream]:
        runnable = [ps for ps in self._streams.values() if ps.runnable()]
        runnable.sort(key=PoolStream.deadline)
        return runnable[: self.info.max_batch]

    def _worker(self) -> None:
        while True:
            with self._cond:
                batch = self._pick_locked()
                while not batch and not self._closing:
                    self._cond.wait()
                    batch = self._pick_locked()
                if self._closing:
                    return
                for ps in batch:
                    ps.busy = True
                budgets = [ps.credit_ms for ps in batch]
            self._run_step(batch, budgets)

    def _run_step(self, batch: Sequence[PoolStream], budgets: Sequence[float]) -> None:
        t0 = time.monotonic()
        try:
            outputs = self.engine.step([ps.stream for ps in batch], budgets)
        except EngineError as exc:
            outputs = [[StreamDone(reason="error", error=f"{exc.code}: {exc.message}")] for _ in batch]
        except Exception as exc:
            log.exception("engine step failed")
            outputs = [[StreamDone(reason="error", error=f"engine_error: {type(exc).__name__}")] for _ in batch]
        now = time.monotonic()
        with self._cond:
            self.steps += 1
            self.last_batch_size = len(batch)
            self.step_seconds_total += now - t0
            for ps, out in zip(batch, outputs, strict=True):
                ps.busy = False
                if ps.aborted:
                    self._close_locked(ps)
                    continue
                for item in out:
                    if isinstance(item, AudioChunk):
                        ms = item.duration_ms
                        ps.credit_ms -= ms
                        ps.produced_ms += ms
                        ps.stream.audio_ms += ms
                        self.generated_ms_total += ms
                        if ps.first_chunk_at is None:
                            ps.first_chunk_at = now
                    elif isinstance(item, StreamDone):
                        ps.finished = True
                        if item.reason == "error":
                            self.failed_total += 1
                if ps.finished:
                    self._close_locked(ps)
                if out:
                    # A closed loop has nobody left to receive the outputs.
                    with contextlib.suppress(RuntimeError):
                        ps.loop.call_soon_threadsafe(self._deliver, ps, out)
            self._cond.notify_all()

    def _deliver(self, ps: PoolStream, outputs: list[EngineOutput]) -> None:
        # Runs on the loop, where abort() runs too: nothing reaches a sink after its stream was aborted.
        if not ps.aborted:
            ps.sink(outputs)
