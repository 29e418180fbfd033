"""The vision encoder's batched window attention against transformers' own loop of one call per window."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniVisionEncoderConfig
from transformers.vision_utils import get_vision_window_index

from omnigate.engines.omni.model import OmniModel, build_preset, load_omni_model
from omnigate.engines.omni.vision_attention import SEGMENTED_SDPA, segmented_sdpa, use_segmented_attention


def _window_lengths(model: OmniModel) -> list[int]:
    vision = model.thinker.model.visual
    grid = model.frame_size // model.patch
    _, cu = get_vision_window_index(
        torch.tensor([[1, grid, grid]]), vision.spatial_merge_size, vision.window_size, vision.patch_size
    )
    return (cu[1:] - cu[:-1]).tolist()  # type: ignore[no-any-return]


def _stock_and_segmented(model: OmniModel, frames: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    rng = np.random.default_rng(seed)
    size = model.frame_size
    pixels = [rng.integers(0, 255, (size, size, 3), dtype=np.uint8) for _ in range(frames)]
    config = model.thinker.model.visual.config
    assert config._attn_implementation == SEGMENTED_SDPA
    segmented = model.encode_frames(pixels)
    config._attn_implementation = "sdpa"  # transformers' loop: one attention call per window
    try:
        stock = model.encode_frames(pixels)
    finally:
        config._attn_implementation = SEGMENTED_SDPA
    return stock, segmented


@pytest.mark.parametrize("frame_size", [56, 168])
def test_encode_frames_equals_the_one_call_per_window_path(frame_size: int) -> None:
    model = build_preset("tiny", seed=5)
    model.frame_size = frame_size
    lengths = _window_lengths(model)
    # 56 px is one window per frame; 168 px (12x12 patches, windows of 8x8) has edge windows of 8x4, 4x8 and 4x4.
    assert len(set(lengths)) == (1 if frame_size == 56 else 3)
    stock, segmented = _stock_and_segmented(model, frames=3, seed=frame_size)
    assert len(segmented) == 3
    for a, b in zip(stock, segmented, strict=True):
        assert a.shape == b.shape == (model.tokens_per_frame, 64)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # Different frames give different tokens: the comparison is not between constants.
    assert not torch.allclose(segmented[0], segmented[1])


def test_a_loaded_checkpoint_uses_it_too(tmp_path: Path) -> None:
    build_preset("tiny", seed=2).thinker.save_pretrained(tmp_path)
    loaded = load_omni_model(str(tmp_path), dtype="float32", frame_size=168)
    stock, segmented = _stock_and_segmented(loaded, frames=2, seed=1)
    for a, b in zip(stock, segmented, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lengths", [[5, 3, 5, 0, 7, 3, 5], [4, 4, 4, 4, 4, 4, 4]])
def test_segments_of_mixed_lengths_come_back_in_order(lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(1, 2, total, 8, generator=gen) for _ in range(3))
    expected = torch.cat(
        [
            F.scaled_dot_product_attention(qs, ks, vs, scale=0.3).transpose(1, 2)
            for qs, ks, vs in zip(*(t.split(lengths, dim=2) for t in (q, k, v)), strict=True)
        ],
        dim=1,
    )
    other = [total // 2, total - total // 2]  # another segmentation of the same rows, between uses of the first
    for segments in (lengths, other, lengths):
        cu = torch.tensor([0, *np.cumsum(segments).tolist()], dtype=torch.int32)
        for _ in range(2):  # the second call with the same tensor takes its groups from the recent ones
            out, _ = segmented_sdpa(torch.nn.Module(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
            assert out.shape == (1, total, 2, 8)
            if segments is lengths:
                torch.testing.assert_close(out, expected)
            else:
                assert not torch.allclose(out, expected)


def test_a_requested_flash_attention_is_left_alone() -> None:
    config = Qwen2_5OmniVisionEncoderConfig()
    config._attn_implementation = "flash_attention_2"
    assert not use_segmented_attention(config)
    assert config._attn_implementation == "flash_attention_2"
    config._attn_implementation = "sdpa"
    assert use_segmented_attention(config)
    assert config._attn_implementation == SEGMENTED_SDPA
