"""The thinker over a slot cache: the same logits as transformers' own forward, batched answers equal to answers
decoded alone, slots freed and reused, and the context limit as a typed error or a stop reason."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicCache

from omnigate.engines.omni.engine import OmniEngine, ThinkJob
from omnigate.engines.omni.model import OmniModel, build_preset
from omnigate.engines.omni.request import (
    CONTEXT_LENGTH_EXCEEDED,
    FrameInput,
    TextDelta,
    ThinkDone,
    ThinkOutput,
    ThinkRequest,
)
from omnigate.engines.omni.sampling import sample_rows


def reference_logits(model: OmniModel, cache: DynamicCache, embeds: torch.Tensor) -> torch.Tensor:
    """The transformers thinker's own forward after what ``cache`` holds, sequential positions in all three
    rotary sections: the next-token logits."""
    start = cache.get_seq_length()
    positions = torch.arange(start, start + embeds.shape[0]).view(1, 1, -1).expand(3, 1, -1)
    thinker = model.thinker
    out = thinker.model(inputs_embeds=embeds[None], position_ids=positions, cache=cache, use_cache=True)
    logits: torch.Tensor = thinker.lm_head(out.last_hidden_state[0, -1])[: model.vocab_limit]
    return logits


@torch.inference_mode()
def test_slot_forward_equals_the_thinkers_own_forward_while_other_slots_are_busy() -> None:
    model = build_preset("tiny", seed=1, slots=3, max_context=64)
    generator = torch.Generator().manual_seed(0)
    text = model.thinker.model.language_model
    # Fresh weights start with zero biases and unit norms: draw them, in place (the slot forward's fused tensors
    # are the same storage), so that the comparison covers them.
    for layer in text.layers:
        attn = layer.self_attn
        for param in (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias):
            param.data.normal_(0.0, 0.5, generator=generator)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data.uniform_(0.5, 1.5, generator=generator)
    text.norm.weight.data.uniform_(0.5, 1.5, generator=generator)
    prompt = torch.randn(11, 64, generator=generator)
    other = torch.randn(5, 64, generator=generator)
    model.prefill(0, other)  # a neighbour at another length shares every step
    cache = DynamicCache(config=model.thinker.config.text_config)
    torch.testing.assert_close(model.prefill(2, prompt), reference_logits(model, cache, prompt), atol=1e-5, rtol=1e-5)
    for token in (7, 42, 3, 90):
        batched = model.decode([0, 2], torch.tensor([11, token]))
        expected = reference_logits(model, cache, model.embed([token]))
        torch.testing.assert_close(batched[1], expected, atol=1e-5, rtol=1e-5)
    assert (model.cache.length(0), model.cache.length(2)) == (5 + 4, 11 + 4)


def test_the_rotary_table_is_the_one_dimensional_rope_of_the_text_config() -> None:
    model = build_preset("tiny", slots=1, max_context=32)
    config = model.thinker.config.text_config
    dim = config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(32, dtype=torch.float32)[:, None] * inv_freq[None]
    angles = torch.cat((angles, angles), dim=-1)
    torch.testing.assert_close(model.rope_cos, angles.cos())
    torch.testing.assert_close(model.rope_sin, angles.sin())


def test_inverse_cdf_sampling_picks_the_id_whose_interval_holds_the_draw() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.0, 0.6, 0.3]] * 4))
    temperature = torch.tensor([1.0, 1.0, 1.0, 0.0])
    uniforms = torch.tensor([0.05, 0.1, 0.95, 0.99])
    assert sample_rows(logits, temperature, uniforms).tolist() == [0, 2, 3, 2]  # the last row is greedy


class Collector:
    """Outputs of each query by name; an event set at its ThinkDone."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[ThinkOutput]] = {}
        self.finished: dict[str, asyncio.Event] = {}

    def sink(self, name: str):  # type: ignore[no-untyped-def]
        self.outputs[name] = []
        self.finished[name] = asyncio.Event()

        def take(batch: list[ThinkOutput]) -> None:
            self.outputs[name].extend(batch)
            if any(isinstance(o, ThinkDone) for o in batch):
                self.finished[name].set()

        return take

    async def done(self, name: str) -> ThinkDone:
        await asyncio.wait_for(self.finished[name].wait(), 60)
        dones = [o for o in self.outputs[name] if isinstance(o, ThinkDone)]
        assert len(dones) == 1 and self.outputs[name][-1] is dones[0]
        assert dones[0].text == "".join(o.text for o in self.outputs[name] if isinstance(o, TextDelta))
        return dones[0]


def requests() -> dict[str, ThinkRequest]:
    pixels = np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    frame = FrameInput(b"f", pixels)
    return {
        "short": ThinkRequest("", "hi?", max_new_tokens=24, temperature=0.8, seed=11),
        "framed": ThinkRequest("system: look\n", "what is it?", (frame,), max_new_tokens=24, temperature=1.0, seed=5),
        "long": ThinkRequest("history " * 6, "and now?", max_new_tokens=24, temperature=0.0, seed=2),
    }


def tiny_model() -> OmniModel:
    return build_preset("tiny", seed=4, slots=3, max_context=256)


async def answers(names: list[str], model: OmniModel | None = None) -> tuple[dict[str, ThinkDone], OmniEngine]:
    engine = OmniEngine(model or tiny_model())
    collector = Collector()
    for name in names:  # submitted before the worker starts: admitted together, decoded in the same steps
        engine.submit(requests()[name], collector.sink(name))
    engine.start()
    try:
        return {name: await collector.done(name) for name in names}, engine
    finally:
        await asyncio.to_thread(engine.stop)


async def test_answers_decoded_together_equal_each_answer_decoded_alone() -> None:
    names = list(requests())
    together, engine = await answers(names)
    assert engine.decode_rows_total > engine.steps  # some steps advanced several answers
    assert sum(d.tokens for d in together.values()) > 24  # enough tokens to compare
    for name in names:
        alone, _ = await answers([name])
        a, t = alone[name], together[name]
        assert (a.reason, a.text, a.tokens) == (t.reason, t.text, t.tokens)


async def test_the_warm_up_leaves_no_trace_in_the_answers() -> None:
    names = list(requests())
    cold, _ = await answers(names)
    model = tiny_model()
    model.warm_up()
    assert all(model.cache.length(slot) == 0 for slot in range(3))
    warm, _ = await answers(names, model)
    assert {n: (d.reason, d.text) for n, d in warm.items()} == {n: (d.reason, d.text) for n, d in cold.items()}


async def test_slots_are_returned_when_answers_end_and_are_reused() -> None:
    engine = OmniEngine(build_preset("tiny", slots=2, max_context=128))
    collector = Collector()
    engine.start()
    try:
        taken: list[int | None] = []
        for round_ in range(3):
            finished = engine.submit(ThinkRequest("", "q", max_new_tokens=3, seed=round_), collector.sink(f"f{round_}"))
            cancelled: list[ThinkJob] = []
            sink = collector.sink(f"c{round_}")

            def cancel_at_first_text(  # type: ignore[no-untyped-def]
                batch: list[ThinkOutput], sink=sink, cancelled: list[ThinkJob] = cancelled
            ) -> None:
                sink(batch)
                if any(isinstance(o, TextDelta) for o in batch):
                    cancelled[0].cancel()

            cancelled.append(engine.submit(ThinkRequest("", "q", max_new_tokens=10_000), cancel_at_first_text))
            assert (await collector.done(f"f{round_}")).reason in ("completed", "max_tokens")
            assert (await collector.done(f"c{round_}")).reason in ("cancelled", "completed")
            taken.extend((finished.slot, cancelled[0].slot))
        assert taken == [None] * 6  # an ended job holds no slot
        await asyncio.to_thread(engine.stop)
        assert engine.free_slots == 2
        assert len({s for s in range(2) if engine.model.cache.length(s) > 0}) == 2  # both slots were used
    finally:
        await asyncio.to_thread(engine.stop)


async def test_stopping_returns_the_slots_of_answers_in_flight() -> None:
    engine = OmniEngine(build_preset("tiny", slots=2, max_context=4096))
    collector = Collector()
    engine.submit(ThinkRequest("", "q", max_new_tokens=100_000, seed=1), collector.sink("a"))
    engine.start()
    await asyncio.to_thread(engine.stop)
    assert (await collector.done("a")).reason in ("cancelled", "completed", "max_context")
    assert engine.free_slots == 2


async def test_a_prompt_longer_than_the_context_ends_with_a_typed_error_and_frees_its_slot() -> None:
    engine = OmniEngine(build_preset("tiny", slots=1, max_context=24))
    collector = Collector()
    engine.start()
    try:
        engine.submit(ThinkRequest("a long history " * 3, "q?"), collector.sink("long"))
        done = await collector.done("long")
        assert (done.reason, done.code, done.tokens) == ("error", CONTEXT_LENGTH_EXCEEDED, 0)
        assert done.error is not None and "24 tokens" in done.error
        engine.submit(ThinkRequest("", "q?", max_new_tokens=2), collector.sink("next"))  # the slot is free again
        assert (await collector.done("next")).reason in ("completed", "max_tokens")
    finally:
        await asyncio.to_thread(engine.stop)


async def test_an_answer_that_fills_the_context_stops_with_max_context() -> None:
    engine = OmniEngine(build_preset("tiny", seed=4, slots=1, max_context=24))
    request = ThinkRequest("", "q?", max_new_tokens=1000, temperature=0.0)
    prompt = int(engine._prompt_embeds(request).shape[0])
    collector = Collector()
    engine.start()
    try:
        engine.submit(request, collector.sink("a"))
        done = await collector.done("a")
        # The last token sampled fills nothing: it had no place left in the cache.
        assert (done.reason, done.tokens) == ("max_context", 24 - prompt + 1)
    finally:
        await asyncio.to_thread(engine.stop)


def test_more_sessions_than_cache_slots_are_refused() -> None:
    with pytest.raises(ValueError, match="cache slots"):
        OmniEngine(build_preset("tiny", slots=2, max_context=16), max_sessions=3)


async def test_a_burst_of_questions_is_prefilled_over_several_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("omnigate.engines.omni.engine.PREFILL_TOKENS_PER_STEP", 1)  # one prefill per step
    engine = OmniEngine(build_preset("tiny", seed=4, slots=3, max_context=128))
    collector = Collector()
    for i in range(3):
        engine.submit(ThinkRequest("", f"q{i}?", max_new_tokens=4, seed=i), collector.sink(str(i)))
    engine.start()
    try:
        dones = [await collector.done(str(i)) for i in range(3)]
    finally:
        await asyncio.to_thread(engine.stop)
    assert [d.reason for d in dones] == ["max_tokens"] * 3
    # Answer i starts at step i + 1 and ends at step i + 4: 6 steps of 1, 2, 3, 3, 2, 1 answers.
    assert (engine.steps, engine.decode_rows_total) == (6, 12)
