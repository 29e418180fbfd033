"""Streaming decode of Wan's causal video VAE: latent frames in, video frames out, one latent frame at a time.

``AutoencoderKLWan.decode`` already walks the latent frames in order, carrying a cache of the last input frames of
every causal 3D convolution (``feat_cache``), but it clears that cache on every call. Keeping the cache per
generation instead makes decoding incremental, and the result equals one whole-clip ``decode`` exactly: the first
latent frame gives one video frame, each later one ``scale_factor_temporal`` (4) frames.

This reaches into diffusers' Wan decoder (``WanDecoder3d.forward(x, feat_cache=, feat_idx=, first_chunk=)`` and the
``WanCausalConv3d`` count), which is internal API: diffusers is pinned to 0.42.1 and a test compares the streamed
output with ``decode`` bit for bit.

Optional spatial tiling bounds activation memory at high resolution. It reproduces diffusers' ``tiled_decode``
exactly (the same overlapping tiles, each with its own caches, blended the same way), and like it is *not* equal to
an untiled decode: tiles do not see across their borders, and the overlaps are cross-faded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import diffusers
import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

log = logging.getLogger(__name__)

TESTED_DIFFUSERS = "0.42.1"
if diffusers.__version__ != TESTED_DIFFUSERS:
    log.warning(
        "streaming Wan VAE decoding relies on diffusers internals tested with %s; this is diffusers %s",
        TESTED_DIFFUSERS,
        diffusers.__version__,
    )

FeatureCache = list[Any]  # one slot per causal convolution: a tensor, the marker "Rep", or None


@dataclass(frozen=True)
class VaeTiling:
    """Spatial tiles in video pixels (diffusers' defaults: 256-pixel tiles every 192 pixels)."""

    tile: int = 256
    stride: int = 192

    def __post_init__(self) -> None:
        if not 0 < self.stride <= self.tile:
            raise ValueError("the tile stride must be positive and at most the tile size")


def causal_conv_count(vae: Any) -> int:
    """How many feature-cache slots one decode needs: the decoder's causal convolutions."""
    return sum(isinstance(module, WanCausalConv3d) for module in vae.decoder.modules())


class StreamingVaeDecoder:
    """Decodes one video's latents in order, keeping its own feature caches; the VAE's weights are shared.

    The VAE object is not re-entrant: run one decode at a time per VAE (one worker thread per model instance).
    Feed :meth:`decode` the next latent frames (any number at a time); :meth:`close` drops the caches.
    """

    def __init__(self, vae: Any, tiling: VaeTiling | None = None) -> None:
        if vae.config.patch_size is not None:
            raise ValueError("streaming decode supports Wan 2.1 VAEs (no output patchify)")
        self.vae = vae
        self.tiling = tiling
        self.latent_frames_decoded = 0
        self._slots = causal_conv_count(vae)
        self._caches: dict[tuple[int, int], FeatureCache] = {}
        self._shape: tuple[int, int] | None = None

    @property
    def cache_bytes(self) -> int:
        """Memory the feature caches hold now."""
        return sum(
            slot.numel() * slot.element_size()
            for cache in self._caches.values()
            for slot in cache
            if isinstance(slot, torch.Tensor)
        )

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``(B, z, n, h, w)`` next latent frames → ``(B, 3, f, 8h, 8w)`` video in [-1, 1] (f = 1 + 4(n-1) at first,
        then 4n)."""
        if latents.ndim != 5 or latents.shape[2] == 0:
            raise ValueError("expected latents shaped (batch, channels, frames, height, width) with frames > 0")
        shape = (int(latents.shape[3]), int(latents.shape[4]))
        if self._shape is None:
            self._shape = shape
        elif shape != self._shape:
            raise ValueError("latent frames of one video must all have the same size")
        latents = latents.to(device=self.vae.device, dtype=self.vae.dtype)
        outputs = [self._decode_frame(latents[:, :, i : i + 1]) for i in range(latents.shape[2])]
        return torch.clamp(torch.cat(outputs, dim=2), min=-1.0, max=1.0)

    def close(self) -> None:
        """Drop the caches (idempotent); the decoder cannot continue afterwards."""
        self._caches.clear()

    def _decode_frame(self, z: torch.Tensor) -> torch.Tensor:
        first = self.latent_frames_decoded == 0
        tiling = self.tiling
        height, width = z.shape[3], z.shape[4]
        scale = int(self.vae.config.scale_factor_spatial)
        if tiling is not None and (height > tiling.tile // scale or width > tiling.tile // scale):
            out = self._decode_tiled(z, tiling, scale, first)
        else:
            out = self._decode_tile(z, (0, 0), first)
        self.latent_frames_decoded += 1
        return out

    def _decode_tile(self, z: torch.Tensor, key: tuple[int, int], first: bool) -> torch.Tensor:
        cache = self._caches.get(key)
        if cache is None:
            if not first:
                raise RuntimeError("the decoder was closed; a streamed video cannot resume")
            cache = self._caches[key] = [None] * self._slots
        x = self.vae.post_quant_conv(z)  # a 1x1x1 convolution: frame by frame is exact
        out: torch.Tensor = self.vae.decoder(x, feat_cache=cache, feat_idx=[0], first_chunk=first)
        return out

    def _decode_tiled(self, z: torch.Tensor, tiling: VaeTiling, scale: int, first: bool) -> torch.Tensor:
        """One latent frame through diffusers' ``tiled_decode`` arithmetic, each tile with its own caches."""
        height, width = z.shape[3], z.shape[4]
        tile_latent, stride_latent = tiling.tile // scale, tiling.stride // scale
        blend = tiling.tile - tiling.stride
        rows: list[list[torch.Tensor]] = []
        for i in range(0, height, stride_latent):
            rows.append(
                [
                    self._decode_tile(z[:, :, :, i : i + tile_latent, j : j + tile_latent], (i, j), first)
                    for j in range(0, width, stride_latent)
                ]
            )
        result_rows = []
        for i, row in enumerate(rows):
            pieces = []
            for j, tile in enumerate(row):
                # In place, in the same order as diffusers, so later tiles blend with already-blended neighbours.
                if i > 0:
                    tile = self.vae.blend_v(rows[i - 1][j], tile, blend)
                if j > 0:
                    tile = self.vae.blend_h(row[j - 1], tile, blend)
                pieces.append(tile[:, :, :, : tiling.stride, : tiling.stride])
            result_rows.append(torch.cat(pieces, dim=-1))
        return torch.cat(result_rows, dim=3)[:, :, :, : height * scale, : width * scale]


def decode_together(decoders: list[StreamingVaeDecoder], latents: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each decoder's next latent frames (``(1, z, n, h, w)`` each) through the VAE in one batched call.

    The decoders' feature caches are concatenated along the batch axis, decoded as one video of batch ``len``, and
    split back, so each decoder continues as if it had decoded alone. They must be at the same point of their videos:
    the same latent size and the same cache layout (all first frames, or all past their first two).
    """
    if len(decoders) != len(latents) or not decoders:
        raise ValueError("one batch of latent frames per decoder")
    if len(decoders) == 1:
        return [decoders[0].decode(latents[0])]
    lead = decoders[0]
    if any(d.vae is not lead.vae or d.tiling != lead.tiling or d._shape != lead._shape for d in decoders):
        raise ValueError("decoders decoded together must share the VAE, the tiling and the latent size")
    merged = StreamingVaeDecoder(lead.vae, lead.tiling)
    merged.latent_frames_decoded = lead.latent_frames_decoded
    merged._shape = lead._shape
    for key in lead._caches:
        merged._caches[key] = [
            _joined([decoder._caches[key][slot] for decoder in decoders]) for slot in range(merged._slots)
        ]
    video = merged.decode(torch.cat(latents))
    for row, decoder in enumerate(decoders):
        decoder._caches = {
            key: [s[row : row + 1] if isinstance(s, torch.Tensor) else s for s in cache]
            for key, cache in merged._caches.items()
        }
        decoder._shape = merged._shape
        decoder.latent_frames_decoded = merged.latent_frames_decoded
    return [video[row : row + 1] for row in range(len(decoders))]


def _joined(slots: list[Any]) -> Any:
    """One feature-cache slot of several decoders, batched: their tensors concatenated, or the marker they share."""
    if all(isinstance(slot, torch.Tensor) for slot in slots):
        return torch.cat(slots)
    if any(isinstance(slot, torch.Tensor) or slot != slots[0] for slot in slots):
        raise ValueError("decoders decoded together must be at the same point of their videos")
    return slots[0]
