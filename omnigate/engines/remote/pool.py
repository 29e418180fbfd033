"""The gateway side of a remote engine pool: :class:`RemoteEnginePool` implements the engine-pool contract over
engine replicas reached through a :class:`ReplicaTransport` (Ray Serve in production).

Per utterance stream: one streaming call to the replica the session is pinned to. Text, end of input and credit
that exist before the call leaves ride in :class:`OpenStream`; later ones wait for the replica's ``Opened`` and then
go through the replica's control channel, one call in flight per replica, coalescing whatever accumulates
meanwhile. Credit is granted in media time as the session's outbox drains and sent as a cumulative limit, so a
replica never produces beyond what the client has room for.

Sessions: a gateway serving a session for its whole life (the speech stream route) first asks a replica to hold a
place for it (:meth:`RemoteEnginePool.reserve_session`): the replica's answer admits or refuses the session, so
admission is exact however many gateway processes share a replica, and the session's streams open on its place.

Failures: a replica that refuses (full, draining) before admitting a stream sends it to another replica, else to
the client as a typed refusal with a retry hint; a replica that dies ends its live streams with a typed
``engine_unavailable`` error and loses its pinned sessions, which move on their next utterance. Other sessions
see nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from omnigate.engines.base import (
    AudioChunk,
    EngineError,
    EngineInfo,
    EngineOutput,
    StreamDone,
    SynthesisParams,
    stream_failed,
)
from omnigate.engines.pool import PoolClosed, PoolFull
from omnigate.engines.pool_api import OutputSink
from omnigate.engines.remote.protocol import (
    ControlBatch,
    Opened,
    OpenStream,
    Outputs,
    Refused,
    ReplicaStats,
    ReserveSession,
    StreamOps,
    decode_report,
    decode_stats,
    decode_stream_message,
    encode,
)
from omnigate.engines.remote.router import SessionRouter
from omnigate.engines.remote.transport import ReplicaDirectory, ReplicaTransport, ReplicaUnavailable
from omnigate.engines.unit_tokens import UnitEncoder, load_unit_encoder

log = logging.getLogger(__name__)

LOST = stream_failed("engine_unavailable", "the engine replica serving this utterance stopped; retry the utterance")
UNREACHABLE = stream_failed("engine_unavailable", "no engine replica is reachable; retry shortly")
# Refusals that say "not here": the stream tries another replica.
_REROUTABLE = frozenset({"engine_busy", "draining", "shutting_down"})


@dataclass(eq=False)
class RemoteStream:
    """The gateway's handle for one remote utterance stream."""

    id: str
    params: SynthesisParams
    sink: OutputSink
    session: Hashable | None
    credit_limit_ms: float
    texts: list[str] = field(default_factory=list)  # pushed before the replica admitted the stream
    tokens: list[list[int] | None] = field(default_factory=list)  # their ids, where this gateway made them
    input_done: bool = False
    acked: bool = False
    closed: bool = False
    aborted: bool = False
    replica: str | None = None
    held: SessionPlace | None = None  # the session's place the stream opens on, if it holds one
    tried: set[str] = field(default_factory=set)
    task: asyncio.Task[None] | None = None
    # what the open call carried, so that after the admission only the rest is sent
    sent_texts: int = 0
    sent_input_done: bool = False
    sent_limit_ms: float = 0.0


@dataclass(eq=False)
class SessionPlace:
    """A place a replica holds for one session, for as long as ``task`` (its call) runs."""

    id: str
    replica: str
    task: asyncio.Task[None]

    @property
    def held(self) -> bool:
        return not self.task.done()


@dataclass(eq=False)
class _Ops:
    texts: list[str] = field(default_factory=list)
    tokens: list[list[int] | None] = field(default_factory=list)
    input_done: bool = False
    credit_limit_ms: float = 0.0


class ControlChannel:
    """Stream operations for one replica: merged per stream, at most one call in flight.

    Holds at most one entry per live stream on the replica; a stream's texts are bounded by its session's input
    limits.
    """

    def __init__(self, name: str, transport: ReplicaTransport, pool: RemoteEnginePool) -> None:
        self._name = name
        self._transport = transport
        self._pool = pool
        self._ops: dict[str, _Ops] = {}
        self._task: asyncio.Task[None] | None = None

    def add(
        self,
        stream_id: str,
        texts: list[str],
        input_done: bool,
        credit_limit_ms: float,
        tokens: list[list[int] | None] | None = None,
    ) -> None:
        ops = self._ops.get(stream_id)
        if ops is None:
            ops = self._ops[stream_id] = _Ops()
        ops.texts.extend(texts)
        ops.tokens.extend(tokens if tokens is not None and len(tokens) == len(texts) else [None] * len(texts))
        ops.input_done = ops.input_done or input_done
        ops.credit_limit_ms = max(ops.credit_limit_ms, credit_limit_ms)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush(), name=f"engine-control-{self._name}")

    def forget(self, stream_id: str) -> None:
        self._ops.pop(stream_id, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _flush(self) -> None:
        try:
            while self._ops:
                ops, self._ops = self._ops, {}
                batch = ControlBatch(
                    self._pool.gateway_id,
                    [
                        StreamOps(sid, o.texts, _unit_ids(o.tokens), o.input_done, o.credit_limit_ms)
                        for sid, o in ops.items()
                    ],
                )
                try:
                    reply = await self._transport.control(encode(batch))
                except ReplicaUnavailable as exc:
                    # Its streams learn it from their own calls; here the router stops choosing it.
                    log.warning("engine replica %s did not take control messages: %s", self._name, exc)
                    self._pool.router.lost(self._name)
                    return
                except Exception:  # an error raised inside the replica: its streams will stall, not the gateway
                    log.exception("engine replica %s failed a control batch", self._name)
                    continue
                self._pool.router.report(self._name, decode_report(reply))
        finally:
            self._task = None


@dataclass(eq=False)
class ReplicaLink:
    name: str
    transport: ReplicaTransport
    control: ControlChannel
    stats: ReplicaStats | None = None


class RemoteEnginePool:
    """The engine-pool contract over remote engine replicas, with per-session pinning."""

    def __init__(
        self,
        directory: ReplicaDirectory,
        *,
        retry_after_s: float = 1.0,
        poll_interval_s: float = 1.0,
        observe_hop: Callable[[float], None] | None = None,
    ) -> None:
        """``observe_hop`` receives, per message carrying outputs, the seconds from the replica handing it over to
        its arrival here (meaningful only when both run on one host, as in benchmarks)."""
        self.router = SessionRouter()
        self.gateway_id = uuid.uuid4().hex  # renews this process's streams on the replicas
        self._directory = directory
        self._retry_after_s = retry_after_s
        self._poll_interval_s = poll_interval_s
        self._observe_hop = observe_hop
        self._links: dict[str, ReplicaLink] = {}
        self._streams: dict[str, RemoteStream] = {}
        self._info: EngineInfo | None = None
        # makes text units' token ids here, so that the engine does not (None: the text crosses alone)
        self._encoder: UnitEncoder | None = None
        self._poller: asyncio.Task[None] | None = None
        self._places: set[asyncio.Task[None]] = set()  # the calls holding sessions' places
        self._closing = False
        self.aborted_total = 0
        self.failed_total = 0
        self.generated_ms_total = 0.0

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self, ready_timeout_s: float = 60.0) -> None:
        """Find the engine replicas and wait until one answers (its engine info is this pool's), then keep polling
        them in the background. Raises ``TimeoutError``."""
        async with asyncio.timeout(ready_timeout_s):
            while True:
                await self.refresh()
                if self._info is not None:
                    break
                await asyncio.sleep(self._poll_interval_s)
        self._encoder = await asyncio.to_thread(load_unit_encoder, self._info.unit_tokens)
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever(), name="engine-replica-poller")

    async def close(self) -> None:
        """Stop polling and end every stream; no output is delivered after this."""
        self._closing = True
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        tasks = [rs.task for rs in self._streams.values() if rs.task is not None]
        for rs in list(self._streams.values()):
            self.abort(rs)
        places = list(self._places)
        for place in places:
            place.cancel()
        await asyncio.gather(*tasks, *places, return_exceptions=True)
        for link in self._links.values():
            await link.control.close()

    async def refresh(self) -> None:
        """Follow the deployed replicas and ask each for its state."""
        names = await self._directory.names()
        for name in [n for n in self._links if n not in names]:
            link = self._links.pop(name)
            await link.control.close()
            self.router.remove(name)
        for name in names:
            if name not in self._links:
                transport = await self._directory.connect(name)
                self._links[name] = ReplicaLink(name, transport, ControlChannel(name, transport, self))
        await asyncio.gather(*(self._poll(link) for link in list(self._links.values())))

    # ---- the pool contract ------------------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("the remote engine pool has not found a replica yet")
        return self._info

    def pin_session(self) -> PinnedView:
        return PinnedView(self)

    def open(self, params: SynthesisParams, sink: OutputSink, *, initial_credit_ms: float) -> RemoteStream:
        """Open a stream on the replica with the most free slots, pinned to no session."""
        return self.open_for(None, params, sink, initial_credit_ms)

    async def reserve_session(self) -> PinnedView:
        """A view for one session whose place a replica holds (until :meth:`PinnedView.unpin`): the replica
        decided, so no report seen here can over-admit. Raises ``PoolFull`` (with the replicas' retry hint) when
        every replica refused, ``PoolClosed``, or ``EngineError`` when none is reachable."""
        if self._closing:
            raise PoolClosed()
        names = self.router.reserving_order()
        if not names:
            raise EngineError("engine_unavailable", "no engine replica is reachable; retry shortly")
        loop = asyncio.get_running_loop()
        retry_after_s = self._retry_after_s
        refused = False
        for name in names:
            link = self._links.get(name)
            if link is None:
                continue
            place_id = uuid.uuid4().hex
            self.router.asking(name)
            answer: asyncio.Future[Opened | Refused | None] = loop.create_future()
            task = loop.create_task(self._hold(link, place_id, answer), name="engine-session-place")
            self._places.add(task)
            task.add_done_callback(self._places.discard)
            try:
                message = await answer
            except BaseException:
                task.cancel()  # the session went away while asking: the replica frees the place
                raise
            if isinstance(message, Opened):
                view = PinnedView(self, SessionPlace(place_id, name, task))
                self.router.pin(view, name)
                self.router.note_free(name, message.free_slots)
                return view
            task.cancel()
            if isinstance(message, Refused):
                refused = True
                busy = message.code == "engine_busy"
                self.router.refused(name, None, free_slots=message.free_slots, draining=not busy)
                retry_after_s = message.retry_after_s
        if not refused:  # none answered: each was lost on the way (a restarted core, before the next poll)
            raise EngineError("engine_unavailable", "no engine replica is reachable; retry shortly")
        raise PoolFull(retry_after_s)

    async def _hold(self, link: ReplicaLink, place_id: str, answer: asyncio.Future[Opened | Refused | None]) -> None:
        """The call holding a session's place: its answer, then nothing until cancelled or ended by the replica."""
        messages = link.transport.open_stream(encode(ReserveSession(place_id, self.gateway_id)))
        try:
            async for data in messages:
                message = decode_stream_message(data)
                if not answer.done() and not isinstance(message, Outputs):
                    answer.set_result(message)
        except ReplicaUnavailable as exc:
            log.warning("engine replica %s lost: %s", link.name, exc)
            self.router.lost(link.name)
        except Exception:
            log.exception("engine replica %s failed a session's place", link.name)
        finally:
            if not answer.done():
                answer.set_result(None)
            await messages.aclose()

    def open_for(
        self,
        session: Hashable | None,
        params: SynthesisParams,
        sink: OutputSink,
        initial_credit_ms: float,
        place: SessionPlace | None = None,
    ) -> RemoteStream:
        """Open a stream for ``session`` on its replica: on the session's ``place`` while the replica holds it,
        whatever the replica last reported. Raises ``PoolFull``, ``PoolClosed`` or ``EngineError``."""
        if self._closing:
            raise PoolClosed()
        state = self.router.state(place.replica) if place is not None and place.held else None
        if place is not None and state is not None and state.up:
            name: str | None = place.replica
        else:
            place = None
            name = self.router.route(session)
        if name is None:
            if self.router.replicas_up == 0:
                raise EngineError("engine_unavailable", "no engine replica is reachable; retry shortly")
            raise PoolFull(self._retry_after_s)
        rs = RemoteStream(
            uuid.uuid4().hex, params, sink, session, credit_limit_ms=initial_credit_ms, replica=name, held=place
        )
        self._streams[rs.id] = rs
        # Started on the next loop turn, so text the caller pushes right after opening travels with the open call.
        rs.task = asyncio.get_running_loop().create_task(self._run(rs, name), name="engine-stream")
        return rs

    def push_text(self, ps: RemoteStream, text: str) -> None:
        if ps.closed or ps.input_done:
            return
        ids = None if self._encoder is None else self._encoder.encode(ps.params.voice, text)
        if ps.acked:
            self._send(ps, texts=[text], tokens=[ids])
        else:
            ps.texts.append(text)
            ps.tokens.append(ids)

    def end_input(self, ps: RemoteStream) -> None:
        if ps.closed or ps.input_done:
            return
        ps.input_done = True
        if ps.acked:
            self._send(ps, input_done=True)

    def grant(self, ps: RemoteStream, ms: float) -> None:
        if ps.closed:
            return
        ps.credit_limit_ms += ms
        if ps.acked:
            self._send(ps)

    def abort(self, ps: RemoteStream) -> None:
        """Cancel the stream's call (the replica frees the slot). Idempotent; nothing reaches the sink after."""
        if ps.closed:
            return
        ps.closed = ps.aborted = True
        self.aborted_total += 1
        self._forget(ps)
        if ps.task is not None:
            ps.task.cancel()

    @property
    def active(self) -> int:
        return len(self._streams)

    @property
    def free_slots(self) -> int:
        return self.router.free_slots

    def has_free_slot(self) -> bool:
        return self.free_slots > 0

    @property
    def replicas_up(self) -> int:
        return self.router.replicas_up

    @property
    def queue_depth(self) -> int:
        return sum(s.queue_depth for s in self._stats())

    @property
    def healthy(self) -> bool:
        return self.health_problem is None

    @property
    def health_problem(self) -> str | None:
        if self.router.replicas_up == 0:
            return "no engine replica is reachable"
        stats = self._stats()
        problems = [s.health_problem for s in stats]
        if stats and all(problems):
            return problems[0]  # every replica's engine is failing: nothing here can serve
        return None

    # The engine tier's counters, summed over the replicas' last stats (they count every gateway's streams).
    @property
    def steps(self) -> int:
        return sum(s.steps for s in self._stats())

    @property
    def step_seconds_total(self) -> float:
        return sum(s.step_seconds_total for s in self._stats())

    @property
    def last_batch_size(self) -> int:
        return max((s.last_batch_size for s in self._stats()), default=0)

    @property
    def failed_steps_total(self) -> int:
        return sum(s.failed_steps_total for s in self._stats())

    @property
    def worker_restarts_total(self) -> int:
        return sum(s.worker_restarts_total for s in self._stats())

    @property
    def step_timeouts_total(self) -> int:
        return sum(s.step_timeouts_total for s in self._stats())

    def replica_stats(self) -> dict[str, ReplicaStats]:
        """The last stats of each replica that answered."""
        return {name: link.stats for name, link in self._links.items() if link.stats is not None}

    # ---- streams ----------------------------------------------------------------------------------------------

    async def _run(self, rs: RemoteStream, name: str) -> None:
        try:
            replica: str | None = name
            while replica is not None:
                refusal = await self._serve_on(rs, replica)
                if refusal is None:
                    return
                replica = self.router.route(rs.session, exclude=rs.tried)
                if replica is None:
                    self._deliver(rs, [refusal])
        finally:
            rs.closed = True
            self._forget(rs)

    async def _serve_on(self, rs: RemoteStream, name: str) -> StreamDone | None:
        """Run the stream on ``name``. Returns a refusal, as the stream's typed end (the stream may try elsewhere
        first), or None when it ended."""
        rs.tried.add(name)
        link = self._links.get(name)
        if link is None:
            return UNREACHABLE
        rs.replica = name
        held = rs.held.id if rs.held is not None and rs.held.replica == name else ""
        request = OpenStream(
            rs.id,
            self.gateway_id,
            rs.params,
            rs.credit_limit_ms,
            list(rs.texts),
            _unit_ids(rs.tokens),
            rs.input_done,
            held=held,
        )
        rs.sent_texts, rs.sent_input_done, rs.sent_limit_ms = len(rs.texts), rs.input_done, rs.credit_limit_ms
        messages = link.transport.open_stream(encode(request))
        try:
            async for data in messages:
                message = decode_stream_message(data)
                if isinstance(message, Outputs):
                    if self._observe_hop is not None:
                        self._observe_hop(time.monotonic() - message.handed_at)
                    if self._deliver(rs, message.items):
                        return None
                elif isinstance(message, Opened):
                    self._on_opened(rs, link, message)
                else:
                    reroute = message.code in _REROUTABLE
                    self.router.refused(name, rs.session, free_slots=message.free_slots, draining=reroute)
                    if reroute:
                        hint = f"{message.message}; retry after {message.retry_after_s:g} s"
                        return stream_failed(message.code, hint)
                    self._deliver(rs, [stream_failed(message.code, message.message)])
                    return None
            self._deliver(rs, [stream_failed("engine_unavailable", "the engine stream ended before finishing")])
            return None
        except ReplicaUnavailable as exc:
            log.warning("engine replica %s lost: %s", name, exc)
            self.router.lost(name)
            if not rs.acked:
                return UNREACHABLE
            self._deliver(rs, [LOST])
            return None
        except Exception as exc:  # an error raised inside the replica, surfaced by the transport
            log.exception("engine stream failed on replica %s", name)
            # An engine failure, not the engine tier's: no code of its own (the client gets generation_failed).
            self._deliver(rs, [StreamDone(reason="error", error=f"engine_error: {type(exc).__name__}")])
            return None
        finally:
            await messages.aclose()

    def _on_opened(self, rs: RemoteStream, link: ReplicaLink, message: Opened) -> None:
        rs.acked = True
        self.router.note_free(link.name, message.free_slots)
        late_texts, rs.texts = rs.texts[rs.sent_texts :], []
        late_tokens, rs.tokens = rs.tokens[rs.sent_texts :], []
        late_end = rs.input_done and not rs.sent_input_done
        if late_texts or late_end or rs.credit_limit_ms > rs.sent_limit_ms:
            link.control.add(rs.id, late_texts, late_end, rs.credit_limit_ms, late_tokens)

    def _deliver(self, rs: RemoteStream, items: list[EngineOutput]) -> bool:
        """Hand outputs to the session; True when the stream ended."""
        if rs.aborted:
            return True
        delivered: list[EngineOutput] = []
        ended = False
        for item in items:
            delivered.append(item)
            if isinstance(item, AudioChunk):
                self.generated_ms_total += item.duration_ms
            elif isinstance(item, StreamDone):
                ended = True
                if item.reason == "error":
                    self.failed_total += 1
                break
        if ended:
            rs.closed = True
        if delivered:
            rs.sink(delivered)
        return ended

    def _send(
        self,
        rs: RemoteStream,
        texts: list[str] | None = None,
        input_done: bool = False,
        tokens: list[list[int] | None] | None = None,
    ) -> None:
        link = self._links.get(rs.replica) if rs.replica is not None else None
        if link is not None:
            link.control.add(rs.id, texts or [], input_done, rs.credit_limit_ms, tokens)

    def _forget(self, rs: RemoteStream) -> None:
        self._streams.pop(rs.id, None)
        link = self._links.get(rs.replica) if rs.replica is not None else None
        if link is not None:
            link.control.forget(rs.id)

    # ---- replicas ---------------------------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            try:
                await self.refresh()
            except Exception:
                log.warning("engine replica discovery failed", exc_info=True)

    async def _poll(self, link: ReplicaLink) -> None:
        try:
            stats = decode_stats(await link.transport.stats(self.gateway_id))
        except ReplicaUnavailable:
            link.stats = None
            self.router.lost(link.name)
            return
        link.stats = stats
        self.router.report(link.name, stats.report)
        if self._info is None:
            self._info = stats.info
        elif stats.info != self._info:
            log.warning("engine replica %s serves %s, not %s", link.name, stats.info.model, self._info.model)

    def _stats(self) -> list[ReplicaStats]:
        return [link.stats for link in self._links.values() if link.stats is not None]


class PinnedView:
    """The pool as one session sees it: all its streams go to the replica the router pinned it to, on the place
    that replica holds for the session if it holds one (:meth:`RemoteEnginePool.reserve_session`)."""

    def __init__(self, pool: RemoteEnginePool, place: SessionPlace | None = None) -> None:
        self._pool = pool
        self._place = place

    @property
    def info(self) -> EngineInfo:
        return self._pool.info

    def open(self, params: SynthesisParams, sink: OutputSink, *, initial_credit_ms: float) -> RemoteStream:
        return self._pool.open_for(self, params, sink, initial_credit_ms, self._place)

    def push_text(self, ps: RemoteStream, text: str) -> None:
        self._pool.push_text(ps, text)

    def end_input(self, ps: RemoteStream) -> None:
        self._pool.end_input(ps)

    def grant(self, ps: RemoteStream, ms: float) -> None:
        self._pool.grant(ps, ms)

    def abort(self, ps: RemoteStream) -> None:
        self._pool.abort(ps)

    def unpin(self) -> None:
        """The session ended: its replica frees its place."""
        self._pool.router.unpin(self)
        if self._place is not None:
            self._place.task.cancel()

    @property
    def replica(self) -> str | None:
        """The replica this session is pinned to now."""
        return self._pool.router.pinned(self)

    @property
    def active(self) -> int:
        return self._pool.active

    @property
    def free_slots(self) -> int:
        return self._pool.free_slots

    def has_free_slot(self) -> bool:
        return self.free_slots > 0

    @property
    def queue_depth(self) -> int:
        return self._pool.queue_depth

    @property
    def healthy(self) -> bool:
        return self._pool.healthy

    @property
    def health_problem(self) -> str | None:
        return self._pool.health_problem

    @property
    def steps(self) -> int:
        return self._pool.steps

    @property
    def aborted_total(self) -> int:
        return self._pool.aborted_total

    @property
    def failed_total(self) -> int:
        return self._pool.failed_total

    @property
    def generated_ms_total(self) -> float:
        return self._pool.generated_ms_total

    @property
    def last_batch_size(self) -> int:
        return self._pool.last_batch_size

    @property
    def step_seconds_total(self) -> float:
        return self._pool.step_seconds_total

    @property
    def failed_steps_total(self) -> int:
        return self._pool.failed_steps_total

    @property
    def worker_restarts_total(self) -> int:
        return self._pool.worker_restarts_total

    @property
    def step_timeouts_total(self) -> int:
        return self._pool.step_timeouts_total


def _unit_ids(tokens: list[list[int] | None]) -> list[list[int]]:
    """The units' ids for a message: every unit's, or none (the engine then tokenizes them all)."""
    ids = [unit for unit in tokens if unit is not None]
    return ids if len(ids) == len(tokens) else []
