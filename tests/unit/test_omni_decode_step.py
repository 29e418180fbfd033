"""The thinker's padded decode step (what the GPU replays from a CUDA graph per batch bucket) against the eager step,
several prompts prefilled in one forward against one forward each, and the worker loop's rates."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omnigate.engines.omni.decode_step import pad_step_rows
from omnigate.engines.omni.engine import OmniEngine
from omnigate.engines.omni.model import build_preset
from omnigate.engines.omni.request import FrameInput, ThinkDone, ThinkOutput, ThinkRequest
from omnigate.engines.omni.stats import ThinkerStats


def test_a_step_fills_the_smallest_bucket_and_its_spare_and_ended_rows_write_at_the_scratch_slot() -> None:
    rows = pad_step_rows([0.7, 0.0, 1.0], [0.25, 0.5, 0.75], [(4, 10), None, (1, 3)], (1, 2, 4, 8), scratch=9)
    assert rows.bucket == 4
    assert rows.ints == [[4, 9, 1, 9], [10, 0, 3, 0]]
    assert rows.floats == [[0.7, 0.0, 1.0, 0.0], [0.25, 0.5, 0.75, 0.0]]
    assert pad_step_rows([0.0], [0.0], [(0, 0)], (1, 2), scratch=2).bucket == 1
    with pytest.raises(ValueError, match="does not fit"):
        pad_step_rows([0.0] * 3, [0.0] * 3, [(0, 0)] * 3, (1, 2), scratch=2)


@torch.inference_mode()
def test_three_prompts_prefilled_in_one_forward_equal_three_single_prefills() -> None:
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randn(n, 64, generator=generator) for n in (7, 12, 4)]
    single = build_preset("tiny", seed=2, slots=3, max_context=32)
    batched = build_preset("tiny", seed=2, slots=3, max_context=32)
    alone = torch.stack([single.prefill(slot, prompt) for slot, prompt in enumerate(prompts)])
    where = {0: 2, 1: 0, 2: 1}  # prompt -> its slot in the batched model; the forward takes prompts 2, 0, 1
    together = batched.prefill_many([where[2], where[0], where[1]], [prompts[2], prompts[0], prompts[1]])[[1, 2, 0]]
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert together.argmax(dim=-1).tolist() == alone.argmax(dim=-1).tolist()
    for slot, prompt in enumerate(prompts):
        batched_slot = where[slot]
        n = prompt.shape[0]
        assert batched.cache.length(batched_slot) == single.cache.length(slot) == n
        for cache_a, cache_b in ((single.cache.keys, batched.cache.keys), (single.cache.values, batched.cache.values)):
            torch.testing.assert_close(cache_b[:, batched_slot, :n], cache_a[:, slot, :n], atol=1e-5, rtol=1e-5)


def burst() -> list[ThinkRequest]:
    rng = np.random.default_rng(1)
    frames = [FrameInput(bytes([i]), rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)) for i in range(3)]
    return [
        ThinkRequest("", "hi?", max_new_tokens=30, temperature=0.0, seed=1),
        ThinkRequest("system: look\n", "what is it?", tuple(frames[:2]), max_new_tokens=30, temperature=0.9, seed=2),
        ThinkRequest("history " * 4, "and now?", (frames[2],), max_new_tokens=5, temperature=1.0, seed=3),
        ThinkRequest("", "more?", max_new_tokens=30, temperature=0.7, seed=4),
    ]


async def answer_burst(padded: bool) -> tuple[list[tuple[str, str, int]], OmniEngine]:
    model = build_preset("tiny", seed=4, slots=4, max_context=64)
    model.padded_decode = padded
    engine = OmniEngine(model)
    done: dict[int, ThinkDone] = {}
    finished = asyncio.Event()

    def sink(index: int):  # type: ignore[no-untyped-def]
        def take(batch: list[ThinkOutput]) -> None:
            for out in batch:
                if isinstance(out, ThinkDone):
                    done[index] = out
                    if len(done) == 4:
                        finished.set()

        return take

    for i, request in enumerate(burst()):  # submitted before the worker starts: one loop admits them all
        engine.submit(request, sink(i))
    engine.start()
    try:
        await asyncio.wait_for(finished.wait(), 60)
    finally:
        await asyncio.to_thread(engine.stop)
    return [(done[i].reason, done[i].text, done[i].tokens) for i in range(4)], engine


async def test_the_padded_step_gives_the_eager_steps_answers_and_a_burst_is_prefilled_in_one_forward() -> None:
    eager, eager_engine = await answer_burst(padded=False)
    padded, padded_engine = await answer_burst(padded=True)
    assert padded == eager
    # The answers end at different steps (the third at its 5th token, some at the context): the padded steps
    # masked the rows that ended and kept the others going exactly as the eager steps did.
    assert len({reason for reason, _, _ in eager}) > 1
    assert padded_engine.stats.padded_steps == padded_engine.steps > 0 and eager_engine.stats.padded_steps == 0
    for engine in (eager_engine, padded_engine):
        assert (engine.stats.prefill_forwards, engine.stats.prefilled_prompts) == (1, 4)
        assert engine.frames_encoded_total == 3


def test_the_worker_loops_rates_cover_the_recent_window() -> None:
    now = [100.0]
    stats = ThinkerStats(lambda: now[0], window_s=10.0)
    stats.record_loop(0, 1200, 3, padded=False)  # a loop that only prefilled
    for rows in (3, 3, 2, 4):
        stats.record_loop(rows, 0, 0, padded=True)
    rates = stats.rates()
    assert (rates.steps_per_s, rates.rows_per_step, rates.prefill_tokens_per_step) == (0.4, 3.0, 240.0)
    assert (stats.steps, stats.decode_rows, stats.prefill_forwards, stats.padded_steps) == (4, 12, 1, 4)
    now[0] += 10.5
    assert stats.rates().steps_per_s == 0.0
