"""The engine side of a remote pool: one in-process :class:`EnginePool` behind the stream and control messages.

:class:`ReplicaCore` knows no Ray; the Serve deployment in :mod:`omnigate.engines.remote.deployment` only forwards
its calls here. All methods run on the replica's event loop. Credit crosses the boundary as a cumulative limit and
becomes ``EnginePool.grant`` deltas, so the local pool's credit rule holds remotely too: with no credit from the
gateway the engine produces nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from omnigate.engines.admission import AdmissionSettings
from omnigate.engines.base import Engine, EngineError, EngineOutput, StreamDone, stream_failed
from omnigate.engines.pool import EnginePool, PoolClosed, PoolFull, PoolStream
from omnigate.engines.remote.protocol import (
    DrainResult,
    Opened,
    Outputs,
    Refused,
    ReplicaReport,
    ReplicaStats,
    ReserveSession,
    decode_control,
    decode_open,
    encode,
)
from omnigate.engines.step_stats import BusyWindow, StepCounts

log = logging.getLogger(__name__)

DRAIN_CUT = stream_failed("shutting_down", "the engine replica was drained; retry the utterance")
FREE_COUNT_MAX_AGE_S = 0.02  # a step of a loaded engine or less
LEASE_LOST = stream_failed("gateway_lost", "the gateway stopped renewing its streams")


@dataclass(eq=False)
class _Served:
    """One admitted stream: the outputs the pool delivered and not yet sent, and the credit granted so far.

    ``pending`` holds at most what the stream's credit allowed the engine to produce plus its markers, because
    the pool never produces beyond credit.
    """

    ps: PoolStream
    gateway: str
    granted_ms: float
    pending: list[EngineOutput] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class _Held:
    """A session's place in the pool (:meth:`EnginePool.reserve`), held until its call ends."""

    ticket: int
    gateway: str
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class ReplicaCore:
    """Serves streams of one engine to any number of gateways."""

    def __init__(
        self,
        engine: Engine,
        replica: str,
        *,
        ttfa_target_s: float = 0.25,
        retry_after_s: float = 1.0,
        gateway_lease_s: float = 30.0,
        step_timeout_s: float = 60.0,
        failure_threshold: int = 3,
        admission: AdmissionSettings | None = None,
    ) -> None:
        """Streams of a gateway not heard from for ``gateway_lease_s`` are ended (gateways renew every second).
        ``step_timeout_s`` and ``failure_threshold`` are the local pool's fault limits, ``admission`` its policy."""
        self.replica = replica
        self.retry_after_s = retry_after_s
        self.gateway_lease_s = gateway_lease_s
        self._heard: dict[str, float] = {}
        self._reaper: asyncio.Task[None] | None = None
        self.step_counts = StepCounts()
        self._busy = BusyWindow(workers=engine.info.workers)
        self.pool = EnginePool(
            engine,
            step_observer=self.step_counts.observe,
            ttfa_target_s=ttfa_target_s,
            retry_after_s=retry_after_s,
            step_timeout_s=step_timeout_s,
            failure_threshold=failure_threshold,
            admission=admission,
        )
        self.pool.start()
        self.draining = False
        # the last count of the pool's free slots, and the state it was counted in (see _free_slots)
        self._counted_for: tuple[int, ...] = ()
        self._counted_at = -math.inf
        self._counted_free = 0
        self._streams: dict[str, _Served] = {}
        self._held: dict[str, _Held] = {}
        self._emptied: asyncio.Event | None = None

    # ---- calls ------------------------------------------------------------------------------------------------

    async def stream(self, data: bytes) -> AsyncGenerator[bytes, None]:
        """One utterance: ``Opened`` or ``Refused``, then ``Outputs`` until a ``StreamDone``; or a session's place
        (:class:`ReserveSession`): ``Opened`` or ``Refused``, then nothing until the call ends."""
        request = decode_open(data)
        self._renew(request.gateway)
        if isinstance(request, ReserveSession):
            async for message in self._hold(request):
                yield message
            return
        if self.draining:
            yield self._refusal("draining", "the engine replica is draining")
            return
        served: _Served | None = None

        def sink(outputs: list[EngineOutput]) -> None:
            assert served is not None
            served.pending.extend(outputs)
            served.wake.set()

        try:
            held = self._held.get(request.held) if request.held else None
            ps = self.pool.open(
                request.params,
                sink,
                initial_credit_ms=request.credit_limit_ms,
                held=held.ticket if held is not None else None,
            )
        except PoolFull:
            yield self._refusal("engine_busy", "every slot of the engine replica is taken")
            return
        except PoolClosed:
            yield self._refusal("shutting_down", "the engine replica is shutting down")
            return
        except EngineError as exc:
            # The engine's own refusal (a bad voice, a stalled engine): the pool may have room.
            yield self._refusal(exc.code, exc.message, 0 if self.draining else self._free_slots())
            return
        served = _Served(ps, request.gateway, request.credit_limit_ms)
        self._streams[request.stream_id] = served
        try:
            yield encode(Opened(self.replica, self._free_slots()))
            self._apply(served, request.texts, request.tokens, request.input_done, request.credit_limit_ms)
            while True:
                await served.wake.wait()
                served.wake.clear()
                items, served.pending = served.pending, []
                yield encode(Outputs(items, time.monotonic()))
                if any(isinstance(item, StreamDone) for item in items):
                    return
        finally:
            # Cancelled by the gateway (abort), cut by a drain, or finished: the slot is freed either way.
            self._streams.pop(request.stream_id, None)
            self.pool.abort(served.ps)
            if not self._streams and self._emptied is not None:
                self._emptied.set()

    async def _hold(self, request: ReserveSession) -> AsyncGenerator[bytes, None]:
        if self.draining:
            yield self._refusal("draining", "the engine replica is draining")
            return
        try:
            ticket = self.pool.reserve()
        except PoolFull:
            yield self._refusal("engine_busy", "the engine replica has no room for another session")
            return
        except PoolClosed:
            yield self._refusal("shutting_down", "the engine replica is shutting down")
            return
        held = self._held[request.reservation_id] = _Held(ticket, request.gateway)
        try:
            yield encode(Opened(self.replica, self._free_slots()))
            await held.ended.wait()  # the gateway cancels the call when the session ends
        finally:
            self._held.pop(request.reservation_id, None)
            self.pool.release(ticket)

    async def control(self, data: bytes) -> bytes:
        """Apply a batch of stream operations; answers with a :class:`ReplicaReport`."""
        batch = decode_control(data)
        self._renew(batch.gateway)
        for op in batch.ops:
            served = self._streams.get(op.stream_id)
            if served is not None:  # otherwise finished, aborted or never admitted here: nothing to do
                self._apply(served, op.texts, op.tokens, op.input_done, op.credit_limit_ms)
        return encode(self.report())

    async def stats(self, gateway: str = "") -> bytes:
        """The replica's state; a gateway's periodic call also renews its streams' lease."""
        if gateway:
            self._renew(gateway)
        pool = self.pool
        return encode(
            ReplicaStats(
                report=self.report(),
                info=pool.info,
                pid=os.getpid(),
                queue_depth=pool.queue_depth,
                healthy=pool.healthy,
                health_problem=pool.health_problem,
                steps=pool.steps,
                step_seconds_total=pool.step_seconds_total,
                last_batch_size=pool.last_batch_size,
                generated_ms_total=pool.generated_ms_total,
                failed_steps_total=pool.failed_steps_total,
                worker_restarts_total=pool.worker_restarts_total,
                step_timeouts_total=pool.step_timeouts_total,
                step_counts=list(self.step_counts.step_counts),
                batch_counts=list(self.step_counts.batch_counts),
                batch_total=self.step_counts.batch_total,
                busy_fraction=self._busy.sample(time.monotonic(), pool.step_seconds_total),
                stage_seconds=pool.engine.stage_seconds(),
            )
        )

    async def drain(self, deadline_s: float) -> bytes:
        """Admit nothing more, let live streams finish for up to ``deadline_s``, then end the rest with a typed
        ``shutting_down`` error. Answers with a :class:`DrainResult`."""
        self.draining = True
        live = len(self._streams)
        if self._streams:
            self._emptied = asyncio.Event()
            try:
                async with asyncio.timeout(deadline_s):
                    await self._emptied.wait()
            except TimeoutError:
                pass
        cut = 0
        for served in list(self._streams.values()):
            self._cut(served, DRAIN_CUT)
            cut += 1
        for held in self._held.values():
            held.ended.set()
        log.info("drained: %d streams finished, %d cut at the deadline", live - cut, cut)
        return encode(DrainResult(self.replica, finished=live - cut, cut=cut))

    def report(self) -> ReplicaReport:
        return ReplicaReport(
            replica=self.replica,
            free_slots=0 if self.draining else self._free_slots(),
            max_sessions=self.pool.info.max_sessions,
            active=len(self._streams),
            draining=self.draining,
        )

    def health_problem(self) -> str | None:
        return self.pool.health_problem

    def shutdown(self) -> None:
        """Stop the pool. Blocking: the replica calls it when it is torn down."""
        if self._reaper is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self._reaper.get_loop().call_soon_threadsafe(self._reaper.cancel)
        self.pool.stop()

    # ---- internals --------------------------------------------------------------------------------------------

    def _renew(self, gateway: str) -> None:
        self._heard[gateway] = time.monotonic()
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever(), name="gateway-leases")

    async def _reap_forever(self) -> None:
        """End the streams of gateways whose lease ran out; forget gateways with no streams left."""
        while True:
            await asyncio.sleep(self.gateway_lease_s / 4)
            expired = {g for g, heard in self._heard.items() if time.monotonic() - heard > self.gateway_lease_s}
            if not expired:
                continue
            for served in list(self._streams.values()):
                if served.gateway in expired:
                    log.warning("ending a stream of a gateway silent for %.0f s", self.gateway_lease_s)
                    self._cut(served, LEASE_LOST)
            for held in self._held.values():
                if held.gateway in expired:
                    held.ended.set()
            for gateway in expired:
                del self._heard[gateway]

    def _cut(self, served: _Served, done: StreamDone) -> None:
        """End a stream now with a typed error; nothing the engine still produces for it is sent."""
        self.pool.abort(served.ps)
        served.pending.append(done)
        served.wake.set()

    def _apply(
        self, served: _Served, texts: list[str], tokens: list[list[int]], input_done: bool, credit_limit_ms: float
    ) -> None:
        # The gateway's token ids, unit for unit, or none at all (then the engine tokenizes).
        units: list[list[int] | None] = list(tokens) if len(tokens) == len(texts) else [None] * len(texts)
        for text, ids in zip(texts, units, strict=True):
            self.pool.push_text(served.ps, text, ids)
        if input_done:
            self.pool.end_input(served.ps)
        if credit_limit_ms > served.granted_ms:
            self.pool.grant(served.ps, credit_limit_ms - served.granted_ms)
            served.granted_ms = credit_limit_ms

    def _free_slots(self) -> int:
        """The pool's free slots, counted again only after an engine step, a change in what admission carries, or
        :data:`FREE_COUNT_MAX_AGE_S` (what admission decides also changes with time): the count takes the pool's
        lock, which the stepping thread needs, and scans every stream (about a millisecond at a thousand), and every
        control reply to every gateway carries it."""
        admission = self.pool.admission
        now = time.monotonic()
        key = (self.pool.steps, admission.active, admission.held, admission.young)
        if key != self._counted_for or now - self._counted_at > FREE_COUNT_MAX_AGE_S:
            self._counted_for = key
            self._counted_at = now
            self._counted_free = self.pool.free_slots
        return self._counted_free

    def _refusal(self, code: str, message: str, free_slots: int = 0) -> bytes:
        """A ``Refused`` message. A refusal by the pool (no room, draining, closed) reports no free slot without
        counting them: the count takes the pool's lock, which the stepping thread needs before and after every step,
        and scans every stream, and under overload the core answers thousands of refusals a second."""
        return encode(Refused(self.replica, code, message, self.retry_after_s, free_slots))
