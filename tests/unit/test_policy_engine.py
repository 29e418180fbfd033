"""The policy engine on the tiny preset: batched steps, transforms, and a LeRobot-layout checkpoint round trip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from omnigate.engines.policy.checkpoint import CheckpointError, Normalization, load_checkpoint, save_checkpoint
from omnigate.engines.policy.engine import PolicyEngine
from omnigate.engines.policy.model import Pi0Policy, build_random, tiny_dims
from omnigate.engines.policy.spec import Observation, PolicyStream


def observation(seed: int, size: int = 32, prompt: str = "pick up the cup") -> Observation:
    rng = np.random.default_rng(seed)
    return Observation(
        images=[rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(2)],
        state=rng.standard_normal(8).astype(np.float32),
        prompt=prompt,
    )


def streams_for(*observations: Observation) -> list[PolicyStream]:
    streams = []
    for obs in observations:
        stream = PolicyStream()
        stream.observation = obs
        streams.append(stream)
    return streams


@pytest.fixture(scope="module")
def engine() -> PolicyEngine:
    return PolicyEngine.load("preset:tiny", threads="1")


def test_a_batched_step_answers_each_stream_with_a_chunk(engine: PolicyEngine) -> None:
    info = engine.info
    results = engine.step(streams_for(*(observation(i) for i in range(3))))
    assert len(results) == 3
    for result in results:
        assert result.actions.shape == (info.action_horizon, info.action_dim)
        assert result.actions.dtype == np.float32
        assert np.isfinite(result.actions).all()
        assert result.batch_size == 3


def test_batching_does_not_change_an_observations_actions(engine: PolicyEngine) -> None:
    """Same weights, same noise: a row of a batch equals the observation sampled alone."""
    inputs = engine._inputs([observation(1), observation(2, prompt="open the drawer")])
    noise = torch.randn(
        2, engine.dims.action_horizon, engine.dims.max_action_dim, generator=torch.Generator().manual_seed(0)
    )
    pixels = inputs["images"].permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0
    with torch.inference_mode():
        both = engine.policy.sample_actions(pixels, inputs["tokens"], inputs["mask"], inputs["state"], noise)
        alone = engine.policy.sample_actions(
            pixels[1:], inputs["tokens"][1:], inputs["mask"][1:], inputs["state"][1:], noise[1:]
        )
    assert torch.allclose(both[1], alone[0], atol=1e-5)


def _varied_inputs(batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random images, state and noise, and prompts of several lengths (padding masked) for the tiny preset."""
    dims, generator = tiny_dims(), torch.Generator().manual_seed(seed)
    images = torch.rand(batch, dims.cameras, 3, 32, 32, generator=generator) * 2 - 1
    tokens = torch.randint(3, 259, (batch, dims.max_prompt_tokens), generator=generator)
    mask = torch.zeros(batch, dims.max_prompt_tokens, dtype=torch.bool)
    for i in range(batch):
        mask[i, : 3 + (5 * i) % (dims.max_prompt_tokens - 2)] = True
    state = torch.randn(batch, dims.max_state_dim, generator=generator)
    noise = torch.randn(batch, dims.action_horizon, dims.max_action_dim, generator=generator)
    return images, tokens, mask, state, noise


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def packed_policy() -> Pi0Policy:
    """Random weights with non-zero norm weights (so the norms' ``1 + weight`` scales are exercised), packed."""
    policy = build_random(tiny_dims(), torch.device("cpu"), torch.float32, seed=7)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(8)
        for name, parameter in policy.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    policy.pack()
    return policy


def test_the_fused_layers_sample_what_the_reference_layers_sample(packed_policy: Pi0Policy) -> None:
    """Merged QKV and gate-up GEMMs, one-kernel norms, folded heads: the same function (float32 rounding apart)."""
    for seed in (0, 1):
        inputs = _varied_inputs(3, seed)
        with torch.inference_mode():
            reference = packed_policy.sample_actions(*inputs)
            fused = packed_policy.sample_actions(*inputs, fused=True)
        assert torch.isfinite(fused).all()
        assert _relative_error(fused, reference) < 1e-5  # float32 on the CPU; seen 4e-8


def test_a_fused_batch_equals_its_observations_one_by_one(packed_policy: Pi0Policy) -> None:
    inputs = _varied_inputs(4, seed=2)
    with torch.inference_mode():
        batched = packed_policy.sample_actions(*inputs, fused=True)
        for i in range(4):
            alone = packed_policy.sample_actions(*(t[i : i + 1] for t in inputs), fused=True)
            assert _relative_error(batched[i], alone[0]) < 1e-5  # float32; seen 3e-8


def test_the_state_cache_samples_what_the_reference_layers_sample(packed_policy: Pi0Policy) -> None:
    """The state token's keys and values computed once per observation, the action tokens alone at each flow step over
    the expert's caches: the same function as pi0's masked suffix (the state token never sees the actions)."""
    for seed in (3, 4):
        inputs = _varied_inputs(3, seed)
        with torch.inference_mode():
            reference = packed_policy.sample_actions(*inputs)
            cached = packed_policy.sample_actions(*inputs, fused=True, state_cache=True)
        assert torch.isfinite(cached).all()
        assert _relative_error(cached, reference) < 1e-5  # float32 on the CPU; seen 4e-8


def test_a_state_cached_batch_equals_its_observations_one_by_one(packed_policy: Pi0Policy) -> None:
    inputs = _varied_inputs(4, seed=5)
    with torch.inference_mode():
        batched = packed_policy.sample_actions(*inputs, fused=True, state_cache=True)
        for i in range(4):
            alone = packed_policy.sample_actions(*(t[i : i + 1] for t in inputs), fused=True, state_cache=True)
            assert _relative_error(batched[i], alone[0]) < 1e-5


def test_the_state_cache_needs_the_fused_layers(packed_policy: Pi0Policy) -> None:
    with pytest.raises(ValueError, match="fused"), torch.inference_mode():
        packed_policy.sample_actions(*_varied_inputs(1, seed=6), state_cache=True)


def test_the_engine_serves_with_and_without_the_state_cache_alike() -> None:
    cached = PolicyEngine.load("preset:tiny", threads="1", seed="5")
    recomputed = PolicyEngine.load("preset:tiny", threads="1", seed="5", state_cache="off")
    assert cached.state_cache and not recomputed.state_cache
    assert not PolicyEngine.load("preset:tiny", threads="1", fused="off").state_cache
    observations = [observation(8), observation(9, prompt="stack the blocks")]
    for a, b in zip(cached.step(streams_for(*observations)), recomputed.step(streams_for(*observations)), strict=True):
        assert np.allclose(a.actions, b.actions, rtol=1e-4, atol=1e-5)


def test_the_engine_serves_the_fused_layers_and_the_reference_ones_alike() -> None:
    fused = PolicyEngine.load("preset:tiny", threads="1", seed="4")
    reference = PolicyEngine.load("preset:tiny", threads="1", seed="4", fused="off")
    assert fused.fused and not reference.fused
    observations = [observation(6), observation(7, prompt="open the drawer and take the cup out")]
    for a, b in zip(fused.step(streams_for(*observations)), reference.step(streams_for(*observations)), strict=True):
        assert np.allclose(a.actions, b.actions, rtol=1e-4, atol=1e-5)


def test_images_of_any_size_are_resized_with_padding(engine: PolicyEngine) -> None:
    wide = np.full((30, 60, 3), 200, np.uint8)
    out = engine._image(wide)
    assert out.shape == (32, 32, 3)
    assert out[0].max() == 0 and out[-1].max() == 0  # black bars above and below: aspect kept
    assert out[16, 16, 0] == 200
    assert engine.step(streams_for(observation(3, size=100)))[0].actions.shape == (10, 7)


def test_the_state_is_padded_and_the_prompt_tokenized(engine: PolicyEngine) -> None:
    short = observation(4)
    short.state = np.ones(3, np.float32)
    inputs = engine._inputs([short])
    assert inputs["state"].shape == (1, 32)
    assert inputs["state"][0, :3].tolist() == [1.0, 1.0, 1.0] and inputs["state"][0, 3:].abs().sum() == 0
    assert inputs["mask"][0].sum() == min(16, 2 + len("pick up the cup"))


def test_unknown_presets_and_options_are_refused() -> None:
    with pytest.raises(ValueError, match="preset"):
        PolicyEngine.load("preset:pi9")
    with pytest.raises(ValueError, match="option"):
        PolicyEngine.load("preset:tiny", colour="red")


def test_a_saved_checkpoint_loads_and_samples_the_same_actions(tmp_path: Path) -> None:
    dims = tiny_dims(cameras=2)
    policy = build_random(dims, torch.device("cpu"), torch.float32, seed=3)
    norm = Normalization(
        state_mean=torch.full((8,), 0.5), state_std=torch.full((8,), 2.0),
        action_mean=torch.full((7,), 10.0), action_std=torch.full((7,), 3.0),
    )  # fmt: skip
    features = ("observation.images.top", "observation.images.wrist")
    save_checkpoint(tmp_path, policy, image_features=features, state_dim=8, action_dim=7, normalization=norm)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["type"] == "pi0" and config["chunk_size"] == dims.action_horizon
    assert "model.paligemma_with_expert.gemma_expert.model.layers.0.self_attn.q_proj.weight" in load_file(
        str(tmp_path / "model.safetensors")
    )

    loaded = load_checkpoint(tmp_path, torch.device("cpu"), torch.float32)
    assert loaded.image_keys == ("observation/images/top", "observation/images/wrist")
    assert (loaded.state_dim, loaded.action_dim) == (8, 7)
    assert loaded.normalization.action_mean is not None
    images = torch.rand(1, 2, 3, 32, 32) * 2 - 1
    tokens, mask = torch.ones(1, 16, dtype=torch.long), torch.ones(1, 16, dtype=torch.bool)
    state, noise = torch.randn(1, 32), torch.randn(1, dims.action_horizon, 32)
    with torch.inference_mode():
        expected = policy.sample_actions(images, tokens, mask, state, noise)
        assert torch.allclose(loaded.policy.sample_actions(images, tokens, mask, state, noise), expected, atol=1e-5)

    served = PolicyEngine.load(str(tmp_path))
    assert served.info.image_keys == loaded.image_keys and not served.info.random_weights
    result = served.step(streams_for(observation(5)))[0]
    assert result.actions.shape == (dims.action_horizon, 7)
    assert abs(float(result.actions.mean()) - 10.0) < 5.0  # un-normalized around the action mean


def test_the_newer_lerobot_spelling_loads_and_a_broken_checkpoint_is_refused(tmp_path: Path) -> None:
    policy = build_random(tiny_dims(), torch.device("cpu"), torch.float32)
    save_checkpoint(tmp_path, policy, image_features=("observation.images.top",) * 1, state_dim=8, action_dim=7)
    # one camera in the config, two in the weights' dims do not matter: the vision tower is shared by cameras
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    renamed = {
        k.replace("paligemma.language_model.model.", "paligemma.model.language_model."): v for k, v in tensors.items()
    }
    save_file(renamed, str(weights))
    assert load_checkpoint(tmp_path, torch.device("cpu"), torch.float32).dims.cameras == 1

    del renamed["model.state_proj.weight"]
    save_file(renamed, str(weights))
    with pytest.raises(CheckpointError, match="state_proj"):
        load_checkpoint(tmp_path, torch.device("cpu"), torch.float32)
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_checkpoint(tmp_path / "missing", torch.device("cpu"), torch.float32)
