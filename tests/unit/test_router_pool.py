"""RemoteEnginePool against real ReplicaCores (each with its own EnginePool and synthetic engine), linked in this
process instead of through Ray: the wire protocol, credit across the boundary, pinning, refusals, replica loss and
drains. The Ray transport itself is covered by tests/integration/test_ray_pool.py.

Synchronisation is by events only: outputs reach the test through the pool's sink on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest

from omnigate.engines.base import EngineError, StreamDone, SynthesisParams
from omnigate.engines.pool import PoolFull
from omnigate.engines.remote.pool import RemoteEnginePool, RemoteStream
from omnigate.engines.remote.protocol import ReplicaReport, decode_drain
from omnigate.engines.remote.replica import ReplicaCore
from omnigate.engines.remote.transport import ReplicaUnavailable
from omnigate.engines.synthetic import SyntheticEngine
from tests.engine_outputs import TIMEOUT_S, Collector

TONE = SynthesisParams(voice="tone")


class LinkedReplica:
    """A ReplicaCore reached in-process; ``kill`` makes it fail like a dead Ray actor."""

    def __init__(self, name: str, spec: str, gateway_lease_s: float) -> None:
        self.core = ReplicaCore(SyntheticEngine.from_spec(spec), f"{name}-instance", gateway_lease_s=gateway_lease_s)
        self.dead = asyncio.Event()

    async def open_stream(self, request: bytes) -> AsyncGenerator[bytes, None]:
        if self.dead.is_set():
            raise ReplicaUnavailable("dead")
        messages = self.core.stream(request)
        step: asyncio.Future[bytes] | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(messages))
                death = asyncio.ensure_future(self.dead.wait())
                try:
                    done, _ = await asyncio.wait({step, death}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    death.cancel()
                if step not in done:
                    raise ReplicaUnavailable("killed")
                try:
                    message = step.result()
                except StopAsyncIteration:
                    return
                yield message
        finally:
            if step is not None and not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
            await messages.aclose()

    async def control(self, batch: bytes) -> bytes:
        if self.dead.is_set():
            raise ReplicaUnavailable("dead")
        return await self.core.control(batch)

    async def stats(self, gateway: str) -> bytes:
        if self.dead.is_set():
            raise ReplicaUnavailable("dead")
        return await self.core.stats(gateway)


class LinkedDirectory:
    def __init__(self, replicas: dict[str, LinkedReplica]) -> None:
        self.replicas = replicas

    async def names(self) -> list[str]:
        return sorted(self.replicas)

    async def connect(self, name: str) -> LinkedReplica:
        return self.replicas[name]


@asynccontextmanager
async def remote(
    specs: dict[str, str], *, gateway_lease_s: float = 30.0
) -> AsyncIterator[tuple[RemoteEnginePool, dict[str, LinkedReplica]]]:
    replicas = {name: LinkedReplica(name, spec, gateway_lease_s) for name, spec in specs.items()}
    pool = RemoteEnginePool(LinkedDirectory(replicas), poll_interval_s=3600.0)
    await pool.start(TIMEOUT_S)
    try:
        yield pool, replicas
    finally:
        await pool.close()
        for replica in replicas.values():
            await asyncio.to_thread(replica.core.shutdown)


def submit(
    pool: RemoteEnginePool, units: Sequence[str], *, credit_ms: float = 60_000.0, session: object | None = None
) -> tuple[RemoteStream, Collector]:
    collector = Collector()
    rs = pool.open_for(session, TONE, collector, credit_ms)
    for unit in units:
        pool.push_text(rs, unit)
    pool.end_input(rs)
    return rs, collector


async def settled(rs: RemoteStream) -> None:
    """The stream's call has ended on both sides."""
    assert rs.task is not None
    await asyncio.wait_for(asyncio.gather(rs.task, return_exceptions=True), TIMEOUT_S)


async def test_a_stream_crosses_the_boundary_with_the_local_pools_outputs() -> None:
    async with remote({"r0": "chunk_ms=40"}) as (pool, replicas):
        rs, collector = submit(pool, ["abcde", "fgh"])
        assert await collector.finished() == StreamDone(reason="completed")
        assert collector.audio_ms == pytest.approx(480.0)
        assert rs.closed
        await settled(rs)
        assert pool.active == 0
        assert replicas["r0"].core.report().active == 0
        assert pool.generated_ms_total == pytest.approx(480.0)
        assert pool.info.family == "synthetic"


async def test_the_replica_produces_only_what_the_gateway_granted() -> None:
    async with remote({"r0": "chunk_ms=40"}) as (pool, replicas):
        # 20 characters at 60 ms each: 1200 ms of audio behind 200 ms of credit.
        rs, collector = submit(pool, ["abcdefghijklmnopqrst"], credit_ms=200.0)
        await collector.audio_reaches(200.0)
        core = replicas["r0"].core
        # The stream is open and has work, but nothing is runnable: it waits for credit, costing no steps.
        assert core.report().active == 1
        assert core.pool.queue_depth == 0
        assert core.pool.generated_ms_total == pytest.approx(200.0)
        pool.grant(rs, 80.0)
        await collector.audio_reaches(280.0)
        assert core.pool.generated_ms_total == pytest.approx(280.0)
        pool.grant(rs, 10_000.0)
        await collector.finished()
        assert collector.audio_ms == pytest.approx(1200.0)


async def test_text_pushed_after_admission_goes_through_the_control_channel() -> None:
    async with remote({"r0": ""}) as (pool, _):
        collector = Collector()
        rs = pool.open_for(None, TONE, collector, 60_000.0)
        pool.push_text(rs, "ab")
        await collector.audio_reaches(120.0)
        assert rs.acked
        pool.push_text(rs, "cd")
        pool.end_input(rs)
        await collector.finished()
        assert collector.audio_ms == pytest.approx(240.0)


async def test_abort_cancels_the_call_and_frees_the_replicas_slot() -> None:
    async with remote({"r0": "chunk_ms=40"}) as (pool, replicas):
        rs, collector = submit(pool, ["abcdefghijklmnopqrst"], credit_ms=80.0)
        await collector.audio_reaches(80.0)
        pool.abort(rs)
        pool.abort(rs)
        await settled(rs)
        assert replicas["r0"].core.report().active == 0
        assert replicas["r0"].core.pool.aborted_total == 1
        assert pool.aborted_total == 1
        assert not any(isinstance(o, StreamDone) for o in collector.outputs)


async def test_a_session_stays_on_its_replica_and_is_forgotten_when_unpinned() -> None:
    async with remote({"r0": "", "r1": ""}) as (pool, _):
        view = pool.pin_session()
        first = Collector()
        rs = view.open(TONE, first, initial_credit_ms=60_000.0)
        view.push_text(rs, "ab")
        view.end_input(rs)
        await first.finished()
        home = view.replica
        assert home is not None
        for _ in range(3):
            _, collector = submit(pool, ["x"], session=view)
            await collector.finished()
            assert view.replica == home
        view.unpin()
        assert view.replica is None


async def test_when_every_replica_refuses_the_client_gets_engine_busy_with_a_retry_hint() -> None:
    async with remote({"r0": "max_sessions=1", "r1": "max_sessions=1"}) as (pool, replicas):
        hold, _ = submit(pool, ["abcdefghij"], credit_ms=40.0)
        # The router believes the other replica still has a slot; taking it behind the router's back makes it
        # refuse, and the first replica is full: nowhere to go.
        other = "r1" if hold.replica == "r0" else "r0"
        blocker = replicas[other].core.pool.open(TONE, lambda _: None, initial_credit_ms=0.0)
        _, collector = submit(pool, ["ab"])
        done = await collector.finished()
        assert done.reason == "error"
        assert done.error is not None and done.error.startswith("engine_busy:")
        assert "retry after 1 s" in done.error
        replicas[other].core.pool.abort(blocker)


async def test_a_refused_stream_lands_on_a_replica_with_room() -> None:
    async with remote({"r0": "max_sessions=1", "r1": "max_sessions=4"}) as (pool, replicas):
        # r0 reported one free slot; a local stream takes it, so r0 refuses and r1 serves.
        blocker = replicas["r0"].core.pool.open(TONE, lambda _: None, initial_credit_ms=0.0)
        pool.router.report("r0", ReplicaReport("r0-instance", free_slots=9, max_sessions=9, active=0))
        rs, collector = submit(pool, ["ab"])
        assert await collector.finished() == StreamDone(reason="completed")
        assert rs.tried == {"r0", "r1"}
        assert rs.replica == "r1"
        replicas["r0"].core.pool.abort(blocker)


async def test_no_free_slot_anywhere_is_refused_at_once_with_a_retry_hint() -> None:
    async with remote({"r0": "max_sessions=1"}) as (pool, _):
        hold, _ = submit(pool, ["abcdefghij"], credit_ms=40.0)
        with pytest.raises(PoolFull) as refused:
            submit(pool, ["ab"])
        assert refused.value.retry_after_s == 1.0
        pool.abort(hold)


async def test_the_engines_own_refusal_reaches_the_session_typed() -> None:
    async with remote({"r0": ""}) as (pool, _):
        collector = Collector()
        rs = pool.open_for(None, SynthesisParams(voice="nobody"), collector, 1000.0)
        pool.end_input(rs)
        done = await collector.finished()
        assert done.reason == "error"
        assert done.error is not None and done.error.startswith("unknown_voice:")


async def test_a_dead_replica_fails_only_its_streams_and_new_sessions_go_elsewhere() -> None:
    async with remote({"r0": "chunk_ms=40", "r1": "chunk_ms=40"}) as (pool, replicas):
        streams = [submit(pool, ["abcdefghijklmnopqrst"], credit_ms=80.0, session=object()) for _ in range(4)]
        for _, collector in streams:
            await collector.audio_reaches(80.0)
        victim = streams[0][0].replica
        assert victim is not None
        replicas[victim].dead.set()
        for rs, collector in streams:
            if rs.replica == victim:
                done = await collector.finished()
                assert done.reason == "error"
                assert done.error is not None and done.error.startswith("engine_unavailable:")
            else:
                pool.grant(rs, 10_000.0)
                assert await collector.finished() == StreamDone(reason="completed")
        assert pool.replicas_up == 1
        survivor = next(name for name in replicas if name != victim)
        rs, collector = submit(pool, ["ab"], session=object())
        assert await collector.finished() == StreamDone(reason="completed")
        assert rs.replica == survivor
        # A replica nobody can reach at all: refused typed, not queued.
        replicas[survivor].dead.set()
        await pool.refresh()
        with pytest.raises(EngineError) as unavailable:
            submit(pool, ["ab"])
        assert unavailable.value.code == "engine_unavailable"


async def test_a_draining_replica_lets_live_streams_finish_and_sends_new_ones_elsewhere() -> None:
    async with remote({"r0": "chunk_ms=40", "r1": "chunk_ms=40"}) as (pool, replicas):
        live, collector = submit(pool, ["abcdefghij"], credit_ms=40.0)
        await collector.audio_reaches(40.0)
        name = live.replica
        assert name is not None
        other = "r1" if name == "r0" else "r0"
        drain = asyncio.ensure_future(replicas[name].core.drain(TIMEOUT_S))
        # The router has not heard of the drain yet and believes the draining replica the emptiest: the replica's
        # refusal sends the new stream to the other one.
        pool.router.report(name, ReplicaReport(f"{name}-instance", free_slots=999, max_sessions=999, active=0))
        pool.router.report(other, ReplicaReport(f"{other}-instance", free_slots=5, max_sessions=999, active=0))
        fresh, fresh_collector = submit(pool, ["ab"])
        assert await fresh_collector.finished() == StreamDone(reason="completed")
        assert fresh.tried == {"r0", "r1"}
        assert fresh.replica == other
        state = pool.router.state(name)
        assert state is not None and state.draining
        pool.grant(live, 10_000.0)
        assert await collector.finished() == StreamDone(reason="completed")
        result = decode_drain(await asyncio.wait_for(drain, TIMEOUT_S))
        assert (result.finished, result.cut) == (1, 0)


async def test_a_drain_deadline_cuts_live_streams_with_a_typed_error() -> None:
    async with remote({"r0": "chunk_ms=40"}) as (pool, replicas):
        live, collector = submit(pool, ["abcdefghij"], credit_ms=40.0)
        await collector.audio_reaches(40.0)
        result = decode_drain(await replicas["r0"].core.drain(0.0))
        assert (result.finished, result.cut) == (0, 1)
        done = await collector.finished()
        assert done.reason == "error"
        assert done.error is not None and done.error.startswith("shutting_down:")
        await settled(live)
        assert replicas["r0"].core.report().active == 0


async def test_a_replica_ends_the_streams_of_a_gateway_that_stops_renewing() -> None:
    # The pool renewed its lease once, when it started; it polls again only in an hour.
    async with remote({"r0": "chunk_ms=40"}, gateway_lease_s=0.2) as (pool, replicas):
        live, collector = submit(pool, ["abcdefghij"], credit_ms=40.0)
        done = await collector.finished()
        assert done.reason == "error"
        assert done.error is not None and done.error.startswith("gateway_lost:")
        await settled(live)
        assert replicas["r0"].core.report().active == 0
