"""Streaming Wan VAE decode equals diffusers' whole-clip decode, bit for bit (also interleaved and tiled)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers import AutoencoderKLWan

from omnigate.engines.video.presets import TINY
from omnigate.engines.video.vae_stream import StreamingVaeDecoder, VaeTiling, causal_conv_count


@pytest.fixture(scope="module")
def vae() -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: Any = AutoencoderKLWan(**TINY.vae)
    return model.eval()


def latents(frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn((1, 16, frames, height, width), generator=torch.Generator().manual_seed(seed))


def stream(vae: Any, z: torch.Tensor, chunk: int = 1, tiling: VaeTiling | None = None) -> torch.Tensor:
    decoder = StreamingVaeDecoder(vae, tiling)
    pieces = [decoder.decode(z[:, :, i : i + chunk]) for i in range(0, z.shape[2], chunk)]
    return torch.cat(pieces, dim=2)


@torch.no_grad()
def test_streamed_frames_equal_a_whole_clip_decode_exactly(vae: Any) -> None:
    z = latents(4, 4, 4, seed=1)
    decoder = StreamingVaeDecoder(vae)
    pieces = [decoder.decode(z[:, :, i : i + 1]) for i in range(4)]
    assert [p.shape[2] for p in pieces] == [1, 4, 4, 4]
    full = vae.decode(z).sample
    assert full.shape == (1, 3, 13, 32, 32)
    assert torch.equal(torch.cat(pieces, dim=2), full)


@torch.no_grad()
def test_chunks_of_several_latent_frames_give_the_same_video(vae: Any) -> None:
    z = latents(4, 4, 4, seed=2)
    assert torch.equal(stream(vae, z, chunk=2), vae.decode(z).sample)


@torch.no_grad()
def test_two_interleaved_streams_on_one_vae_each_equal_their_own_decode(vae: Any) -> None:
    za, zb = latents(3, 4, 4, seed=3), latents(3, 4, 4, seed=4)
    a, b = StreamingVaeDecoder(vae), StreamingVaeDecoder(vae)
    out_a, out_b = [], []
    for i in range(3):
        out_a.append(a.decode(za[:, :, i : i + 1]))
        out_b.append(b.decode(zb[:, :, i : i + 1]))
    assert torch.equal(torch.cat(out_a, dim=2), vae.decode(za).sample)
    assert torch.equal(torch.cat(out_b, dim=2), vae.decode(zb).sample)


@torch.no_grad()
def test_tiled_streaming_equals_diffusers_tiled_decode_exactly(vae: Any) -> None:
    z = latents(2, 6, 7, seed=5)  # 48 x 56 pixels: a 2 x 3 grid of 32-pixel tiles every 24 pixels
    tiling = VaeTiling(tile=32, stride=24)
    streamed = stream(vae, z, tiling=tiling)
    vae.enable_tiling(
        tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24, tile_sample_stride_width=24
    )
    try:
        reference = vae.tiled_decode(z).sample
    finally:
        vae.disable_tiling()
    assert streamed.shape == (1, 3, 5, 48, 56)
    assert torch.equal(streamed, reference)
    assert not torch.equal(streamed, vae.decode(z).sample)  # tiles cross-fade: not the untiled decode


@torch.no_grad()
def test_caches_are_per_stream_and_dropped_on_close(vae: Any) -> None:
    decoder = StreamingVaeDecoder(vae)
    assert decoder.cache_bytes == 0
    decoder.decode(latents(1, 4, 4, seed=6))
    assert decoder.cache_bytes > 0
    assert decoder.latent_frames_decoded == 1
    decoder.close()
    assert decoder.cache_bytes == 0
    with pytest.raises(RuntimeError):
        decoder.decode(latents(1, 4, 4, seed=7))


def test_one_cache_slot_per_causal_convolution(vae: Any) -> None:
    vae.clear_cache()
    assert causal_conv_count(vae) == vae._conv_num


def test_bad_latents_are_refused(vae: Any) -> None:
    decoder = StreamingVaeDecoder(vae)
    with pytest.raises(ValueError, match="frames"):
        decoder.decode(torch.zeros(1, 16, 0, 4, 4))
    decoder.decode(latents(1, 4, 4, seed=8))
    with pytest.raises(ValueError, match="same size"):
        decoder.decode(latents(1, 4, 6, seed=9))
