"""The policy scheduler: deadline order, batch limits, one observation in flight, latest-wins, faults. A fake engine
and a virtual clock make the order checks exact; one test runs the scheduler thread on the tiny preset."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from omnigate.engines.base import EngineError
from omnigate.engines.policy.engine import PolicyEngine
from omnigate.engines.policy.pool import ObservationBusy, PolicyPool, PolicyReply
from omnigate.engines.policy.spec import Observation, PolicyInfo, PolicyResult, PolicyStream
from omnigate.engines.pool import PoolFull

INFO = PolicyInfo(
    model="fake",
    random_weights=True,
    image_keys=("observation/image",),
    state_key="observation/state",
    prompt_key="prompt",
    image_size=8,
    state_dim=2,
    max_state_dim=4,
    action_horizon=3,
    action_dim=2,
    flow_steps=1,
    control_rate_hz=10.0,
    max_sessions=4,
    max_batch=2,
)


def observation(tag: str = "") -> Observation:
    return Observation(images=[np.zeros((8, 8, 3), np.uint8)], state=np.zeros(2, np.float32), prompt=tag)


class FakeEngine:
    """Answers each observation with actions filled with the length of its prompt; records the batches."""

    info = INFO

    def __init__(self, fail: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.fail = fail
        self.closed = 0

    def open(self) -> PolicyStream:
        return PolicyStream()

    def close(self, stream: PolicyStream) -> None:
        self.closed += 1

    def step(self, streams: Sequence[PolicyStream]) -> list[PolicyResult]:
        prompts = [s.observation.prompt for s in streams if s.observation is not None]
        self.batches.append(prompts)
        if self.fail:
            raise EngineError("engine_error", "the model fell over")
        return [PolicyResult(np.full((3, 2), len(p), np.float32), 1.0, len(streams)) for p in prompts]

    def shutdown(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_pool(engine: FakeEngine | None = None) -> tuple[PolicyPool, Clock]:
    clock = Clock()
    return PolicyPool(engine or FakeEngine(), clock=clock), clock  # type: ignore[arg-type]


async def test_the_earliest_deadline_goes_first_and_a_batch_is_bounded() -> None:
    pool, clock = make_pool()
    slow = pool.open(lambda r: None, rate_hz=10.0)  # due 100 ms after it sends
    fast = pool.open(lambda r: None, rate_hz=50.0)  # due 20 ms after
    late = pool.open(lambda r: None, rate_hz=10.0)
    clock.now = 1.00
    pool.submit(late, observation("late"))  # due 1.10
    clock.now = 1.05
    pool.submit(slow, observation("slow"))  # due 1.15
    pool.submit(fast, observation("fast"))  # due 1.07
    assert [s.pending.prompt for s in pool.pick_locked() if s.pending] == ["fast", "late"]  # max_batch 2


async def test_an_undeclared_rate_is_measured_from_the_observations() -> None:
    pool, clock = make_pool()
    measured = pool.open(lambda r: None)
    assert measured.period_s == pytest.approx(0.1)  # the policy's default rate until measured
    for t in (0.0, 0.02, 0.04):
        clock.now = t
        measured.pending = None  # answered (the scheduler's part, done by hand here)
        pool.submit(measured, observation())
    assert measured.period_s == pytest.approx(0.02)


async def test_one_observation_in_flight_unless_latest_wins() -> None:
    pool, _ = make_pool()
    strict = pool.open(lambda r: None)
    pool.submit(strict, observation("first"))
    with pytest.raises(ObservationBusy):
        pool.submit(strict, observation("second"))
    latest = pool.open(lambda r: None, latest_wins=True)
    pool.submit(latest, observation("old"))
    pool.submit(latest, observation("new"))
    assert latest.pending is not None and latest.pending.prompt == "new"
    assert pool.replaced_total == 1 and pool.observations_total == 3


async def test_admission_is_bounded_by_slots() -> None:
    pool, _ = make_pool()
    for _ in range(INFO.max_sessions):
        pool.open(lambda r: None)
    with pytest.raises(PoolFull):
        pool.open(lambda r: None)
    with pytest.raises(ValueError, match="control rate"):
        make_pool()[0].open(lambda r: None, rate_hz=0.0)


async def run_until_replies(pool: PolicyPool, count: int, *sessions_and_prompts: tuple[int, str]) -> list[PolicyReply]:
    loop = asyncio.get_running_loop()
    replies: list[PolicyReply] = []
    done = loop.create_future()

    def sink(reply: PolicyReply) -> None:
        replies.append(reply)
        if len(replies) == count and not done.done():
            done.set_result(None)

    sessions = [pool.open(sink) for _ in range(count)]
    pool.start()
    try:
        for session, (_, prompt) in zip(sessions, sessions_and_prompts, strict=True):
            pool.submit(session, observation(prompt))
        await asyncio.wait_for(done, 30)
    finally:
        await asyncio.to_thread(pool.stop)
    return replies


async def test_the_scheduler_thread_answers_every_session() -> None:
    engine = FakeEngine()
    replies = await run_until_replies(PolicyPool(engine), 3, (0, "a"), (1, "bb"), (2, "ccc"))  # type: ignore[arg-type]
    assert sorted(float(r.result.actions[0, 0]) for r in replies if r.result) == [1.0, 2.0, 3.0]
    assert sum(len(b) for b in engine.batches) == 3 and max(len(b) for b in engine.batches) <= INFO.max_batch


async def test_a_failed_step_answers_its_batch_with_an_error_and_marks_the_pool_unhealthy() -> None:
    pool = PolicyPool(FakeEngine(fail=True), failure_threshold=1)  # type: ignore[arg-type]
    replies = await run_until_replies(pool, 1, (0, "a"))
    assert replies[0].result is None and replies[0].error == "engine_error: the model fell over"
    assert pool.health_problem is not None and pool.failed_steps_total == 1


async def test_the_tiny_policy_serves_through_the_scheduler() -> None:
    engine = PolicyEngine.load("preset:tiny", threads="1")
    info = engine.info
    pool = PolicyPool(engine)
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[PolicyReply] = loop.create_future()
    session = pool.open(answered.set_result)
    pool.start()
    try:
        size = info.image_size
        obs = Observation(
            images=[np.zeros((size, size, 3), np.uint8)] * len(info.image_keys),
            state=np.zeros(8, np.float32),
            prompt="x",
        )
        pool.submit(session, obs)
        reply = await asyncio.wait_for(answered, 30)
    finally:
        await asyncio.to_thread(pool.stop)
    assert reply.result is not None and reply.result.actions.shape == (info.action_horizon, info.action_dim)
