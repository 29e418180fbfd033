"""EnginePool with the synthetic engine: completion, credit, abort, admission, deadline order, step failures.

Synchronisation is by events only: outputs reach the test through the pool's sink on the event loop, and
where a test must know what a scheduler thread is doing, the engine itself signals it.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest

from omnigate.engines.admission import AdmissionSettings
from omnigate.engines.base import (
    AudioChunk,
    EngineError,
    EngineOutput,
    EngineStream,
    SegmentDone,
    SegmentStarted,
    StreamDone,
    SynthesisParams,
)
from omnigate.engines.pool import EnginePool, PoolFull, PoolStream
from omnigate.engines.remote import replica
from omnigate.engines.remote.protocol import (
    ControlBatch,
    Opened,
    Refused,
    ReserveSession,
    decode_report,
    decode_stream_message,
    encode,
)
from omnigate.engines.remote.replica import ReplicaCore
from omnigate.engines.synthetic import SyntheticConfig, SyntheticEngine
from tests.engine_outputs import TIMEOUT_S, Collector

TONE = SynthesisParams(voice="tone")


class GatedEngine(SyntheticEngine):
    """Holds its scheduler thread in the first step until released, and records every batch it steps."""

    def __init__(self, config: SyntheticConfig) -> None:
        super().__init__(config)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.batches: list[list[EngineStream]] = []

    def step(self, streams: Sequence[EngineStream], budget_ms: Sequence[float]) -> list[list[EngineOutput]]:
        self.batches.append(list(streams))
        if not self.release.is_set():
            self.entered.set()
            if not self.release.wait(TIMEOUT_S):
                raise RuntimeError("the test never released the gate")
        return super().step(streams, budget_ms)


class FailingEngine(SyntheticEngine):
    """Raises from a step whose batch holds the text ``boom``."""

    def __init__(self, config: SyntheticConfig, error: Exception) -> None:
        super().__init__(config)
        self.error = error

    def step(self, streams: Sequence[EngineStream], budget_ms: Sequence[float]) -> list[list[EngineOutput]]:
        if any("boom" in text for stream in streams for text in stream.pending_text):
            raise self.error
        return super().step(streams, budget_ms)


@asynccontextmanager
async def running(engine: SyntheticEngine, *, retry_after_s: float = 1.0) -> AsyncIterator[EnginePool]:
    # Scheduling is under test here, so admission is by slots; headroom admission has tests of its own.
    pool = EnginePool(engine, retry_after_s=retry_after_s, admission=AdmissionSettings(policy="slots"))
    pool.start()
    try:
        yield pool
    finally:
        await asyncio.to_thread(pool.stop)


def submit(pool: EnginePool, units: Sequence[str], *, credit_ms: float = 60_000.0) -> tuple[PoolStream, Collector]:
    collector = Collector()
    ps = pool.open(TONE, collector, initial_credit_ms=credit_ms)
    for unit in units:
        pool.push_text(ps, unit)
    pool.end_input(ps)
    return ps, collector


async def test_stream_runs_to_completion_on_the_loop_thread() -> None:
    async with running(SyntheticEngine.from_spec(None)) as pool:
        _, collector = submit(pool, ["abcde", "fgh"])
        assert await collector.finished() == StreamDone(reason="completed")
        events = [o for o in collector.outputs if not isinstance(o, AudioChunk)]
        assert events == [
            SegmentStarted(index=0, text="abcde"),
            SegmentDone(index=0),
            SegmentStarted(index=1, text="fgh"),
            SegmentDone(index=1),
            StreamDone(reason="completed"),
        ]
        assert collector.audio_ms == pytest.approx(480.0)
        assert collector.threads == {threading.get_ident()}
        assert pool.active == 0
        assert pool.generated_ms_total == pytest.approx(480.0)


async def test_credit_bounds_production_until_more_is_granted() -> None:
    async with running(SyntheticEngine.from_spec("chunk_ms=40")) as pool:
        # 20 characters at 60 ms each: 1200 ms of audio behind 200 ms of credit.
        ps, collector = submit(pool, ["abcdefghijklmnopqrst"], credit_ms=200.0)

        await collector.audio_reaches(200.0)
        # The pool subtracts credit before it hands outputs over, so the stream is provably parked here.
        assert collector.audio_ms == pytest.approx(200.0)
        assert ps.credit_ms == pytest.approx(0.0)
        assert not ps.runnable()
        assert not collector.done.is_set()

        pool.grant(ps, 100.0)
        await collector.audio_reaches(300.0)
        assert collector.audio_ms == pytest.approx(300.0)
        assert not ps.runnable()

        pool.grant(ps, 5000.0)
        assert await collector.finished() == StreamDone(reason="completed")
        assert collector.audio_ms == pytest.approx(1200.0)


async def test_abort_of_a_parked_stream_frees_the_slot_and_silences_it() -> None:
    async with running(SyntheticEngine.from_spec("chunk_ms=40")) as pool:
        ps, collector = submit(pool, ["abcdefghij"], credit_ms=80.0)
        await collector.audio_reaches(80.0)

        pool.abort(ps)
        pool.abort(ps)
        assert pool.active == 0
        assert pool.aborted_total == 1
        delivered = len(collector.outputs)
        pool.grant(ps, 5000.0)
        pool.push_text(ps, "more")

        # A later stream running to its end shows the worker went on without touching the aborted one.
        _, probe = submit(pool, ["probe"])
        await probe.finished()
        assert len(collector.outputs) == delivered
        assert pool.active == 0


async def test_abort_during_a_step_discards_that_steps_output() -> None:
    engine = GatedEngine(SyntheticConfig())
    async with running(engine) as pool:
        ps, collector = submit(pool, ["abcdef"])
        assert await asyncio.to_thread(engine.entered.wait, TIMEOUT_S)
        pool.abort(ps)
        engine.release.set()

        _, probe = submit(pool, ["probe"])
        await probe.finished()
        assert collector.outputs == []
        assert pool.active == 0


async def test_pool_full_when_every_slot_is_taken() -> None:
    async with running(SyntheticEngine.from_spec("max_sessions=2"), retry_after_s=2.5) as pool:
        first = pool.open(TONE, Collector(), initial_credit_ms=100.0)
        pool.open(TONE, Collector(), initial_credit_ms=100.0)
        with pytest.raises(PoolFull) as caught:
            pool.open(TONE, Collector(), initial_credit_ms=100.0)
        assert caught.value.retry_after_s == 2.5
        assert pool.free_slots == 0

        pool.abort(first)
        assert pool.free_slots == 1
        pool.open(TONE, Collector(), initial_credit_ms=100.0)


async def test_earlier_deadline_is_stepped_first() -> None:
    engine = GatedEngine(SyntheticConfig(max_batch=1))
    async with running(engine) as pool:
        # Hold the only worker in a step while both contenders queue up.
        gate, gate_collector = submit(pool, ["..."], credit_ms=0.0)
        pool.grant(gate, 100.0)
        assert await asyncio.to_thread(engine.entered.wait, TIMEOUT_S)

        early, early_collector = submit(pool, ["abcd"], credit_ms=0.0)
        late, late_collector = submit(pool, ["abcd"], credit_ms=0.0)
        pool.grant(late, 5000.0)
        pool.grant(early, 5000.0)
        engine.release.set()

        for collector in (gate_collector, early_collector, late_collector):
            assert await collector.finished() == StreamDone(reason="completed")
        assert all(len(batch) == 1 for batch in engine.batches)
        order = [batch[0] for batch in engine.batches]
        assert order[0] is gate.stream
        assert order.index(early.stream) < order.index(late.stream)


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (RuntimeError("kaput"), "engine_error: RuntimeError"),
        (EngineError("bad_input", "cannot say boom"), "bad_input: cannot say boom"),
    ],
)
async def test_failing_step_fails_only_its_batch(error: Exception, message: str) -> None:
    async with running(FailingEngine(SyntheticConfig(max_batch=1), error)) as pool:
        parked, parked_collector = submit(pool, ["abcdef"], credit_ms=40.0)
        await parked_collector.audio_reaches(40.0)

        _, failing = submit(pool, ["boom"])
        assert await failing.finished() == StreamDone(reason="error", error=message)
        assert pool.failed_total == 1

        # The pool keeps working: the parked stream and a new one both complete.
        pool.grant(parked, 5000.0)
        assert await parked_collector.finished() == StreamDone(reason="completed")
        _, later = submit(pool, ["later"])
        assert await later.finished() == StreamDone(reason="completed")
        assert pool.active == 0


async def test_a_stream_aborted_mid_step_stops_counting_for_headroom_at_once() -> None:
    engine = GatedEngine(SyntheticConfig(max_sessions=4))
    pool = EnginePool(engine, admission=AdmissionSettings(policy="headroom"))
    pool.start()
    try:
        ps, _ = submit(pool, ["abcdef"])
        assert await asyncio.to_thread(engine.entered.wait, TIMEOUT_S)
        assert pool.admission.active == 1
        pool.abort(ps)  # its step still runs: the client that left is not what holds admission now
        assert pool.admission.active == 0
        engine.release.set()
        _, probe = submit(pool, ["probe"])
        assert await probe.finished() == StreamDone(reason="completed")
        assert pool.admission.active == 0 and pool.active == 0
    finally:
        await asyncio.to_thread(pool.stop)


async def test_a_slow_first_chunk_alone_does_not_close_admission() -> None:
    # The first chunk comes 400 ms after opening, past the 250 ms TTFA target: nobody was listening yet, so the next
    # client is still admitted beside it.
    engine = SyntheticEngine.from_spec("first_chunk_delay_ms=400,max_sessions=4")
    pool = EnginePool(engine, ttfa_target_s=0.25, admission=AdmissionSettings(policy="headroom"))
    pool.start()
    try:
        _, first = submit(pool, ["abcdef"])
        assert await first.finished() == StreamDone(reason="completed")
        assert pool.admission.late_total == 0
        _, second = submit(pool, ["abcdef"])
        assert await second.finished() == StreamDone(reason="completed")
    finally:
        await asyncio.to_thread(pool.stop)


async def test_a_stream_is_young_until_its_audio_runs_ahead_of_its_playback() -> None:
    engine = GatedEngine(SyntheticConfig(max_sessions=4, chunk_ms=500))
    pool = EnginePool(engine, admission=AdmissionSettings(policy="headroom"))
    pool.start()
    try:
        # 40 characters (2.4 s of audio) behind 1.5 s of credit: it parks 1.5 s ahead of its first chunk's playback.
        ps, collector = submit(pool, ["abcdefghijklmnopqrstuvwxyzabcdefghijklmn"], credit_ms=1500.0)
        assert await asyncio.to_thread(engine.entered.wait, TIMEOUT_S)
        assert pool.admission.young == 1  # its first chunk is still being made: it is priced at its burst
        engine.release.set()
        await collector.audio_reaches(1500.0)
        assert pool.active == 1 and not ps.runnable()
        assert pool.admission.young == 0  # ahead of its playback by more than young_lead_s: its steady share only
        pool.grant(ps, 5000.0)
        assert await collector.finished() == StreamDone(reason="completed")
        assert pool.admission.young == 0 and pool.admission.active == 0
    finally:
        await asyncio.to_thread(pool.stop)


def test_a_place_refused_by_its_cost_is_refused_without_scanning_the_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = EnginePool(SyntheticEngine(SyntheticConfig(max_sessions=8)), admission=AdmissionSettings())
    pool.admission.observe_step(0.0, 10.0, 1000.0)  # ten worker seconds per second of audio: nothing more fits
    assert pool.reserve() is not None  # an idle pool takes one session whatever it costs

    def scan(now: float) -> float | None:
        raise AssertionError("the slack of every stream was computed for a refusal the cost decides")

    monkeypatch.setattr(pool, "_slack_locked", scan)
    with pytest.raises(PoolFull):
        pool.reserve()
    assert pool.admission.refused_total == 1


async def test_the_core_refuses_a_session_without_counting_its_room_under_the_pools_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Under overload the core's event loop answers thousands of refusals a second; the stepping thread needs the
    # pool's lock before and after each step, so a refusal must not scan every stream under it.
    core = ReplicaCore(SyntheticEngine(SyntheticConfig(max_sessions=8)), "core", admission=AdmissionSettings())
    try:
        core.pool.admission.observe_step(0.0, 10.0, 1000.0)  # ten worker seconds per second of audio
        first = core.stream(encode(ReserveSession("first", "gateway")))
        assert isinstance(decode_stream_message(await anext(first)), Opened)  # an idle pool takes one session

        def scan(now: float) -> float | None:
            raise AssertionError("every stream was scanned to answer a refusal")

        monkeypatch.setattr(core.pool, "_slack_locked", scan)
        refused = decode_stream_message(await anext(core.stream(encode(ReserveSession("second", "gateway")))))
        assert isinstance(refused, Refused) and refused.code == "engine_busy" and refused.free_slots == 0
        assert core.pool.admission.refused_total == 1
        await first.aclose()
    finally:
        await asyncio.to_thread(core.shutdown)


async def test_the_cores_control_replies_count_the_free_slots_once_between_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every control reply to every gateway carries the free slots; counting them scans every stream under the pool's
    # lock. Between engine steps, and while admission carries the same, one count serves them all.
    monkeypatch.setattr(replica, "FREE_COUNT_MAX_AGE_S", math.inf)  # the age limit out of the way: deterministic
    core = ReplicaCore(SyntheticEngine(SyntheticConfig(max_sessions=8)), "core", admission=AdmissionSettings())
    counted = 0
    scan = core.pool._slack_locked

    def counting(now: float) -> float | None:
        nonlocal counted
        counted += 1
        return scan(now)

    monkeypatch.setattr(core.pool, "_slack_locked", counting)
    held = core.stream(encode(ReserveSession("place", "gateway")))
    try:
        batch = encode(ControlBatch("gateway", []))
        reports = [decode_report(await core.control(batch)) for _ in range(3)]
        assert [report.free_slots for report in reports] == [8, 8, 8] and counted == 1
        assert isinstance(decode_stream_message(await anext(held)), Opened)  # a session holds a place now
        assert decode_report(await core.control(batch)).free_slots == 7  # counted again: admission carries more
    finally:
        await held.aclose()
        await asyncio.to_thread(core.shutdown)
