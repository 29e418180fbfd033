"""The block-causal Wan forward, its KV cache, the live engine's chunks, and Self-Forcing checkpoints (tiny preset).

The cache is held equal to a full recompute: the same chunks in one forward with a block-causal mask, earlier
chunks clean (timestep 0) and the last one noisy, which is how Self-Forcing's training sees them. Float32 on the
CPU; the tolerance (2e-5 absolute on outputs of unit scale) covers summation order only.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from omnigate.engines.base import EngineError
from omnigate.engines.video.causal import ChunkKvCache, causal_forward, few_step_sigmas
from omnigate.engines.video.checkpoint import save_generator_checkpoint, to_original_names
from omnigate.engines.video.engine import VideoEngine
from omnigate.engines.video.live import LiveVideoEngine
from omnigate.engines.video.model import ModelSpecError, build_preset
from omnigate.engines.video.outputs import FrameGroup, PromptUpdated, VideoDone

TOLERANCE = 2e-5
CHUNK = 3


@pytest.fixture(scope="module")
def transformer() -> Any:
    return build_preset("tiny-causal", seed=1).transformer


def random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def chunked(transformer: Any, chunks: list[torch.Tensor], t: float, context: torch.Tensor, window: int) -> Any:
    """Generate-style: each earlier chunk written into the cache by a clean (t=0) forward, then the last at ``t``."""
    cache = ChunkKvCache(window)
    for chunk in chunks[:-1]:
        _, kv = causal_forward(transformer, chunk, torch.zeros(1, chunk.shape[2]), context, [cache])
        cache.append(kv, chunk.shape[2])
    last = chunks[-1]
    out, _ = causal_forward(transformer, last, torch.full((1, last.shape[2]), t), context, [cache])
    return out, cache


def test_one_chunk_without_a_cache_is_wan_itself(transformer: Any) -> None:
    latents, context = random(1, 16, 3, 8, 8, seed=0), random(1, 16, 32, seed=1)
    expected = transformer(
        hidden_states=latents, timestep=torch.tensor([500.0]), encoder_hidden_states=context, return_dict=False
    )[0]
    out, _ = causal_forward(transformer, latents, torch.full((1, 3), 500.0), context)
    assert (out - expected).abs().max() < TOLERANCE


def test_the_kv_cache_equals_a_block_causal_recompute_of_the_same_chunks(transformer: Any) -> None:
    chunks = [random(1, 16, CHUNK, 8, 8, seed=10 + i) for i in range(3)]
    context = random(1, 16, 32, seed=2)
    out, cache = chunked(transformer, chunks, 750.0, context, window=12)
    assert cache.frames == 2 * CHUNK
    timesteps = torch.tensor([[0.0] * 2 * CHUNK + [750.0] * CHUNK])
    full, _ = causal_forward(transformer, torch.cat(chunks, dim=2), timesteps, context, chunk_frames=CHUNK)
    assert (out - full[:, :, 2 * CHUNK :]).abs().max() < TOLERANCE
    # The mask matters: with full attention, the clean chunks would see the noisy one and differ.
    bidirectional, _ = causal_forward(transformer, torch.cat(chunks, dim=2), timesteps, context)
    assert (bidirectional[:, :, 2 * CHUNK :] - full[:, :, 2 * CHUNK :]).abs().max() > 1e-3


def test_the_rolling_window_equals_a_recompute_that_sees_only_the_window(transformer: Any) -> None:
    chunks = [random(1, 16, CHUNK, 8, 8, seed=20 + i) for i in range(4)]
    context = random(1, 16, 32, seed=3)
    out, cache = chunked(transformer, chunks, 500.0, context, window=2 * CHUNK)
    assert list(cache.chunk_frames) == [CHUNK, CHUNK]  # chunk 0 was dropped
    # Each chunk sees itself and the two chunks before it; rotary positions are relative, so the cache's frames
    # renumbered from the window's start give what absolute positions give.
    timesteps = torch.tensor([[0.0] * 3 * CHUNK + [500.0] * CHUNK])
    full, _ = causal_forward(
        transformer, torch.cat(chunks, dim=2), timesteps, context, chunk_frames=CHUNK, window=2 * CHUNK
    )
    assert (out - full[:, :, 3 * CHUNK :]).abs().max() < TOLERANCE
    unbounded, _ = causal_forward(transformer, torch.cat(chunks, dim=2), timesteps, context, chunk_frames=CHUNK)
    assert (unbounded[:, :, 3 * CHUNK :] - full[:, :, 3 * CHUNK :]).abs().max() > 1e-3


def test_streams_batched_in_one_forward_get_what_each_gets_alone(transformer: Any) -> None:
    contexts = [random(1, 16, 32, seed=4), random(1, 16, 32, seed=5)]
    streams = [[random(1, 16, CHUNK, 8, 8, seed=30 + 10 * s + i) for i in range(3)] for s in range(2)]
    alone = [
        chunked(transformer, chunks, t, context, window=12)
        for chunks, t, context in zip(streams, (250.0, 1000.0), contexts, strict=True)
    ]
    batch = torch.cat([chunks[-1] for chunks in streams])
    timesteps = torch.tensor([[250.0] * CHUNK, [1000.0] * CHUNK])
    together, _ = causal_forward(transformer, batch, timesteps, torch.cat(contexts), [cache for _, cache in alone])
    for row, (out, _) in enumerate(alone):
        assert (together[row : row + 1] - out).abs().max() < TOLERANCE
    with pytest.raises(ValueError, match="same number of frames"):
        causal_forward(transformer, batch, timesteps, torch.cat(contexts), [alone[0][1], ChunkKvCache(12)])


def test_the_past_keys_are_rotated_once_per_cache_state_and_reused_by_every_forward(transformer: Any) -> None:
    chunks = [random(1, 16, CHUNK, 8, 8, seed=40 + i) for i in range(3)]
    context = random(1, 16, 32, seed=6)
    first, cache = chunked(transformer, chunks, 750.0, context, window=12)
    layers = len(transformer.blocks)
    assert len(cache.rotated_keys) == layers  # made by that forward, for the cache as it is now
    made = list(cache.rotated_keys)
    again, _ = causal_forward(transformer, chunks[-1], torch.full((1, CHUNK), 750.0), context, [cache])
    assert all(a is b for a, b in zip(cache.rotated_keys, made, strict=True))  # reused, not rotated again
    assert torch.equal(again, first)
    # A cache of other keys at the same positions gives other rotated keys: nothing is kept across cache states.
    _, kv = causal_forward(transformer, chunks[-1], torch.zeros(1, CHUNK), context, [cache])
    cache.append(kv, CHUNK)
    assert cache.rotated_keys == []
    causal_forward(transformer, chunks[0], torch.full((1, CHUNK), 750.0), context, [cache])
    assert len(cache.rotated_keys) == layers and cache.rotated_keys[0].shape[1] == cache.tokens
    assert cache.nbytes == sum(3 * k.numel() * k.element_size() for k, _ in cache.layers)


def test_few_step_sigmas_are_self_forcings_warped_timesteps() -> None:
    sigmas = few_step_sigmas(4, 5.0)
    assert sigmas[0] == 1.0 and all(a > b for a, b in itertools.pairwise(sigmas))
    assert sigmas[2] == pytest.approx(5 * 0.5 / (1 + 4 * 0.5))


def test_a_self_forcing_checkpoint_round_trips_through_disk(tmp_path: Path) -> None:
    source = build_preset("tiny-causal", seed=7).transformer
    path = tmp_path / "self_forcing_dmd.pt"
    save_generator_checkpoint(source, path)
    saved = torch.load(path, weights_only=True)
    assert set(saved) == {"generator", "generator_ema"}
    assert "model.blocks.0.self_attn.q.weight" in saved["generator"]
    assert "model.head.modulation" in saved["generator"] and "model.blocks.1.norm3.weight" in saved["generator"]
    engine = VideoEngine.load(str(path), causal_base="preset:tiny-causal", seed=99)
    assert isinstance(engine, LiveVideoEngine) and engine.info.model == str(path)
    loaded = engine.model.transformer.state_dict()
    assert all(torch.equal(tensor, loaded[name]) for name, tensor in source.state_dict().items())
    other = build_preset("tiny-causal", seed=99).transformer.state_dict()
    assert not torch.equal(other["blocks.0.attn1.to_q.weight"], loaded["blocks.0.attn1.to_q.weight"])
    # On a whole-clip base (its text encoder and VAE), the generator still runs chunk-causal: few steps, unguided.
    on_clip_base = VideoEngine.load(str(path), causal_base="preset:tiny")
    assert isinstance(on_clip_base, LiveVideoEngine)
    assert (on_clip_base.model.defaults.steps, on_clip_base.model.defaults.guidance_scale) == (4, 1.0)
    on_clip_base.validate(on_clip_base.resolve("a fox", live=True))


def test_a_checkpoint_that_does_not_fit_the_base_is_refused(tmp_path: Path) -> None:
    weights = to_original_names(build_preset("tiny-causal").transformer.state_dict())
    del weights["model.blocks.1.ffn.0.weight"]
    path = tmp_path / "broken.pt"
    torch.save({"generator": weights}, path)
    with pytest.raises(ModelSpecError, match="do not fit"):
        VideoEngine.load(str(path), causal_base="preset:tiny-causal")
    with pytest.raises(ModelSpecError, match="generator_ema"):
        VideoEngine.load(str(path), causal_base="preset:tiny-causal", checkpoint_key="generator_ema")


def drain(engine: LiveVideoEngine, job: Any) -> list[Any]:
    outputs: list[Any] = []
    while True:
        output = job.wait_output(120)
        outputs.append(output)
        if isinstance(output, FrameGroup):
            job.consumed(output.count)
        if isinstance(output, VideoDone):
            return outputs


def test_a_live_stream_runs_in_chunks_switches_prompt_and_ends_at_its_duration_limit() -> None:
    engine = VideoEngine.load("preset:tiny-causal", max_live_seconds="5", max_sessions="2")
    assert isinstance(engine, LiveVideoEngine)
    engine.start()
    try:
        job = engine.submit(engine.resolve("a fox", live=True, seed=1))
        clip = engine.submit(engine.resolve("a cat", num_frames=17, seed=1))
        prompt_id = job.set_prompt("a dog")
        outputs, clip_outputs = drain(engine, job), drain(engine, clip)
    finally:
        engine.stop()
    groups = [o for o in outputs if isinstance(o, FrameGroup)]
    assert [g.chunk_index for g in groups] == list(range(len(groups)))
    assert [g.count for g in groups] == [9, 12, 12, 7]  # 40 frames = 5 s at 8 fps
    update = next(o for o in outputs if isinstance(o, PromptUpdated))
    assert update.prompt_id == prompt_id and update.chunk_index <= 1
    assert outputs.index(update) < outputs.index(groups[update.chunk_index])
    assert all(g.prompt_id == (prompt_id if g.chunk_index >= update.chunk_index else 0) for g in groups)
    done = outputs[-1]
    assert (done.status, done.code, done.frames) == ("completed", "max_duration", 40)
    assert [g.count for g in clip_outputs if isinstance(g, FrameGroup)] == [9, 8]
    assert engine.batched_samples > engine.forwards_run  # the two streams shared forwards


def test_live_requests_outside_the_limits_are_refused_before_any_work() -> None:
    engine = VideoEngine.load("preset:tiny-causal", max_frame_pixels=str(64 * 64), cache_budget_bytes="1")
    bad = [
        (engine.resolve("x", live=True, steps=9), "invalid_value", "steps"),
        (engine.resolve("x", live=True, chunk_frames=5), "invalid_value", "chunk_frames"),
        (engine.resolve("x", live=True, width=128), "too_large", "width"),
        (engine.resolve("x", live=True, guidance_scale=5.0), "invalid_value", "guidance_scale"),
        (engine.resolve("x", live=True), "server_busy", None),  # no headroom for one KV cache
    ]
    for request, code, param in bad:
        with pytest.raises(EngineError) as refused:
            engine.submit(request)
        assert (refused.value.code, refused.value.param) == (code, param)
    assert engine.active == 0 and engine.forwards_run == 0
    whole_clip = VideoEngine.load("preset:tiny")
    with pytest.raises(EngineError) as refused:
        whole_clip.submit(whole_clip.resolve("x", live=True))
    assert refused.value.code == "live_unsupported"


def wait_until(predicate: Any, limit_s: float = 60.0) -> None:
    """Poll the worker's state; the deadline only bounds a failing run."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "the engine never reached the expected state"
        time.sleep(0.01)


@pytest.mark.parametrize("overlap", ["true", "false"])
def test_a_live_stream_nobody_reads_parks_on_its_frame_credit(overlap: str) -> None:
    engine = VideoEngine.load("preset:tiny-causal", max_frames_in_flight="12", overlap_decode=overlap)
    assert isinstance(engine, LiveVideoEngine)
    engine.start()
    try:
        job = engine.submit(engine.resolve("a fox", live=True, seed=1))
        wait_until(lambda: job.parked)
        # The first chunk (9 frames) is out and unread: the next (12) does not fit 12 frames of credit.
        assert (engine.chunks_decoded, job.in_flight) == (1, 9)
        first = job.wait_output(1)
        assert isinstance(first, FrameGroup) and first.chunk_index == 0
        job.consumed(first.count)
        second = job.wait_output(60)
        assert isinstance(second, FrameGroup) and second.chunk_index == 1
        wait_until(lambda: job.parked)
        assert engine.chunks_decoded == 2
        job.cancel()
        assert isinstance(job.wait_output(60), VideoDone)
    finally:
        engine.stop()
