"""Block-causal Wan: a diffusers ``WanTransformer3DModel`` run chunk by chunk over latent frames, with a KV cache.

The weights and sub-modules are Wan 2.1's; only the self-attention differs from diffusers' forward. Latent frames
are grouped in chunks; a token sees every token of its own chunk and of the chunks before it (block-causal), never a
later one. Generating chunk by chunk, the keys and values of past chunks come from a per-stream
:class:`ChunkKvCache`, so each denoising forward only computes the new chunk's tokens. As in Self-Forcing, the cache
is written by one more forward over the *clean* chunk at timestep 0, after its last denoising step.

Keys are cached before the rotary embedding and rotated at attention time by their frame's place in the window, so
the cache can drop its oldest chunks (a rolling window) while positions stay those a full recompute of the window's
chunks would use. Timesteps are per latent frame, so one forward can hold clean and noisy frames (the full
recompute that tests hold the cache equal to) and several streams at different steps (batching).

A cache's past keys are rotated once per cache state (they keep their positions for all the forwards of the next
chunk) instead of at every forward, and the elementwise work around attention and the feed-forward takes fewer
passes over memory than diffusers' modules (rotary as one complex product, residuals without copies); what a block
computes is Wan's, in the same precisions (float32 norms, modulation and residuals).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

KeyValue = tuple[torch.Tensor, torch.Tensor]  # (batch, tokens, heads, head_dim) each


@dataclass
class ChunkKvCache:
    """One stream's keys and values of its last clean chunks, per layer, oldest first, at most ``window`` frames."""

    window: int  # latent frames kept
    layers: list[KeyValue] = field(default_factory=list)
    chunk_frames: deque[int] = field(default_factory=deque)
    # per layer, the keys above rotated at their place in the window: the same for every forward until the next
    # append, so they are rotated once per chunk (filled by the first forward after an append)
    rotated_keys: list[torch.Tensor] = field(default_factory=list)

    @property
    def frames(self) -> int:
        return sum(self.chunk_frames)

    @property
    def tokens(self) -> int:
        return int(self.layers[0][0].shape[1]) if self.layers else 0

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in self.layers for t in pair] + self.rotated_keys
        return sum(t.numel() * t.element_size() for t in tensors)

    def append(self, chunk: Sequence[KeyValue], frames: int) -> None:
        """Add a clean chunk's keys and values (one ``(1, tokens, heads, head_dim)`` pair per layer), then drop the
        oldest chunks while more than ``window`` frames are kept."""
        self.rotated_keys = []
        if self.layers:
            self.layers = [
                (torch.cat([k, new_k], dim=1), torch.cat([v, new_v], dim=1))
                for (k, v), (new_k, new_v) in zip(self.layers, chunk, strict=True)
            ]
        else:
            self.layers = [(k.clone(), v.clone()) for k, v in chunk]  # not views holding a whole batch's keys
        tokens_per_frame = int(chunk[0][0].shape[1]) // frames
        self.chunk_frames.append(frames)
        dropped = 0
        while self.frames > self.window and len(self.chunk_frames) > 1:
            dropped += self.chunk_frames.popleft()
        if dropped:
            start = dropped * tokens_per_frame
            self.layers = [(k[:, start:].contiguous(), v[:, start:].contiguous()) for k, v in self.layers]

    def clear(self) -> None:
        self.layers = []
        self.rotated_keys = []
        self.chunk_frames.clear()


def few_step_sigmas(steps: int, shift: float) -> list[float]:
    """Noise levels of a ``steps``-step flow sampler: 1000, 750, 500, 250 (for 4) on the training timestep scale,
    warped by the scheduler's shift as Self-Forcing's ``denoising_step_list`` is."""
    levels = [1.0 - i / steps for i in range(steps)]
    return [shift * s / (1.0 + (shift - 1.0) * s) for s in levels]


def _rotary_tables(transformer: Any, frame_index: torch.Tensor, tokens_hw: int, pph: int, ppw: int) -> torch.Tensor:
    """Wan's 3D rotary split (time, height, width) as complex ``cos + i sin`` ``(batch, tokens, 1, head_dim / 2)``
    for tokens whose latent frame is ``frame_index`` (batch, tokens), laid out frame-major like Wan's patches."""
    rope = transformer.rope
    sizes = [rope.t_dim, rope.h_dim, rope.w_dim]
    tables = []
    for freqs in (rope.freqs_cos, rope.freqs_sin):
        t, h, w = freqs.float().split(sizes, dim=1)
        hw = torch.cat(
            [
                h[:pph].view(pph, 1, -1).expand(pph, ppw, -1),
                w[:ppw].view(1, ppw, -1).expand(pph, ppw, -1),
            ],
            dim=-1,
        ).reshape(tokens_hw, -1)
        batch, tokens = frame_index.shape
        position_hw = hw.repeat(tokens // tokens_hw, 1).expand(batch, -1, -1)
        tables.append(torch.cat([t[frame_index], position_hw], dim=-1).unsqueeze(2))
    cos, sin = tables
    return torch.complex(cos[..., 0::2], sin[..., 1::2])  # the tables repeat each pair's angle: take one of each


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on interleaved pairs (diffusers' ``apply_rotary_emb``: each pair times cos and sin in
    float32), as one complex product, back in ``x``'s dtype."""
    pairs = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def _norm_modulate(hidden: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """Wan's float32 LayerNorm (no affine), modulated per latent frame (``scale``, ``shift``: (batch, frames, 1,
    dim)), back in ``hidden``'s dtype."""
    batch, tokens, dim = hidden.shape
    normed = F.layer_norm(hidden.float(), (dim,), eps=eps).view(batch, scale.shape[1], -1, dim)
    return torch.addcmul(shift, normed, 1 + scale).view(batch, tokens, dim).to(hidden.dtype)


def _gated_residual(hidden: torch.Tensor, out: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``hidden + out * gate`` in float32 with a gate per latent frame, in ``dtype``."""
    batch, tokens, dim = hidden.shape
    frames = gate.shape[1]
    summed = (out.view(batch, frames, -1, dim) * gate).add_(hidden.view(batch, frames, -1, dim))
    return summed.view(batch, tokens, dim).to(dtype)


@torch.no_grad()
def causal_forward(
    transformer: Any,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    context: torch.Tensor,
    caches: Sequence[ChunkKvCache | None] | None = None,
    chunk_frames: int | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, list[KeyValue]]:
    """One forward of the Wan transformer over ``latents`` ``(batch, C, frames, h, w)``.

    ``timesteps`` ``(batch, frames)``: each latent frame's timestep. ``context``: the text embeddings
    ``(batch, L, text_dim)``. With ``caches`` (one per sample, all holding the same number of frames), the latents
    are each sample's next chunk and attend to their cache and to themselves. Without, ``chunk_frames`` splits the
    latents into chunks that attend block-causally (the full recompute), each to at most ``window`` latent frames of
    earlier chunks (whole chunks, as the cache keeps them); None means one chunk (all bidirectional, as Wan itself).

    Returns the flow prediction (like ``latents``) and, per layer, the new tokens' keys (before rotation) and values:
    what :meth:`ChunkKvCache.append` takes once the chunk is clean.
    """
    batch, _, frames, height, width = latents.shape
    p_t, p_h, p_w = transformer.config.patch_size
    if p_t != 1:
        raise ValueError("chunk-causal generation needs a temporal patch of 1")
    pph, ppw = height // p_h, width // p_w
    tokens_hw = pph * ppw
    tokens = frames * tokens_hw
    device = latents.device

    # Where each token sits in time: new frames follow the frames in the sample's cache. A batch's caches hold the
    # same number of frames, so no key is padding (a mask would cost a (batch, heads, queries, keys) bias), and the
    # queries of a chunk attend to [cached keys + their own chunk's keys] with no mask at all.
    lengths = {(0, 0) if cache is None or not cache.layers else (cache.frames, cache.tokens) for cache in caches or []}
    if len(lengths) > 1:
        raise ValueError("the caches of one batch must hold the same number of frames")
    cached, prefix = lengths.pop() if lengths else (0, 0)
    query_frame = (cached + torch.arange(frames, device=device)).repeat_interleave(tokens_hw).view(1, -1)
    rotation = _rotary_tables(transformer, query_frame, tokens_hw, pph, ppw)
    past: _PastKeys | None = None
    mask: torch.Tensor | None = None
    if prefix:
        key_frame = torch.arange(cached, device=device).repeat_interleave(tokens_hw).view(1, -1)
        past = _PastKeys([cache for cache in caches or [] if cache is not None], key_frame, (tokens_hw, pph, ppw))
    elif chunk_frames is not None and chunk_frames < frames:
        chunk_of = torch.arange(frames, device=device).repeat_interleave(tokens_hw) // chunk_frames
        earlier = chunk_of.view(1, -1) <= chunk_of.view(-1, 1)
        if window is not None:
            earlier &= chunk_of.view(1, -1) >= chunk_of.view(-1, 1) - window // chunk_frames
        mask = earlier.view(1, 1, tokens, tokens)

    hidden = transformer.patch_embedding(latents.to(transformer.dtype)).flatten(2).transpose(1, 2).contiguous()
    temb, projection, text, _ = transformer.condition_embedder(
        timesteps.flatten(), context, None, timestep_seq_len=frames
    )
    modulation = projection.unflatten(2, (6, -1)).unsqueeze(2)  # (batch, frames, 1, 6, dim): per frame
    new_kv: list[KeyValue] = []
    for index, block in enumerate(transformer.blocks):
        hidden = _block(block, hidden, text, modulation, _Layer(transformer, index, rotation, past, mask), new_kv)
    shift, scale = (transformer.scale_shift_table.view(1, 1, 2, -1) + temb.unsqueeze(2)).unsqueeze(2).unbind(3)
    per_frame = transformer.norm_out(hidden.float()).view(batch, frames, tokens_hw, -1)
    hidden = (per_frame * (1 + scale) + shift).flatten(1, 2).type_as(hidden)
    hidden = transformer.proj_out(hidden)
    hidden = hidden.reshape(batch, frames, pph, ppw, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3), new_kv


@dataclass
class _PastKeys:
    """The batch's caches and where their keys sit: each layer's keys are rotated once per cache state."""

    caches: list[ChunkKvCache]
    key_frame: torch.Tensor  # (1, cached tokens): each cached token's frame in the window
    layout: tuple[int, int, int]  # tokens per frame, patches high, patches wide
    rotation: torch.Tensor | None = None

    def keys_values(self, transformer: Any, index: int) -> list[KeyValue]:
        """Each sample's rotated past keys and its values at layer ``index``."""
        for cache in self.caches:
            if len(cache.rotated_keys) <= index:
                if self.rotation is None:
                    self.rotation = _rotary_tables(transformer, self.key_frame, *self.layout)
                key, _ = cache.layers[index]
                cache.rotated_keys.append(_rotate(key, self.rotation))
        return [(cache.rotated_keys[index], cache.layers[index][1]) for cache in self.caches]


@dataclass(frozen=True)
class _Layer:
    """What one block's self-attention needs besides its input."""

    transformer: Any
    index: int
    rotation: torch.Tensor  # of the new tokens
    past: _PastKeys | None
    mask: torch.Tensor | None


def _with_past(past: list[torch.Tensor], new: torch.Tensor) -> torch.Tensor:
    """``(batch, past + new tokens, heads, head_dim)``: each sample's past tokens, then its new ones (one copy)."""
    if len(past) == 1:
        return torch.cat([past[0], new], dim=1)
    prefix = past[0].shape[1]
    joined = new.new_empty((new.shape[0], prefix + new.shape[1], *new.shape[2:]))
    for row, tensor in enumerate(past):
        joined[row : row + 1, :prefix] = tensor
    joined[:, prefix:] = new
    return joined


def _block(
    block: Any,
    hidden: torch.Tensor,
    text: torch.Tensor,
    modulation: torch.Tensor,
    layer: _Layer,
    new_kv: list[KeyValue],
) -> torch.Tensor:
    """``WanTransformerBlock.forward`` with per-frame modulation and cached keys and values in self-attention."""
    shift, scale, gate, c_shift, c_scale, c_gate = (
        block.scale_shift_table.view(1, 1, 1, 6, -1) + modulation.float()
    ).unbind(3)
    normed = _norm_modulate(hidden, scale, shift, block.norm1.eps)
    attn = block.attn1
    query = _rotate(attn.norm_q(attn.to_q(normed)).unflatten(2, (attn.heads, -1)), layer.rotation)
    key = attn.norm_k(attn.to_k(normed)).unflatten(2, (attn.heads, -1))
    value = attn.to_v(normed).unflatten(2, (attn.heads, -1))
    new_kv.append((key, value))
    rotated = _rotate(key, layer.rotation)
    if layer.past is not None:
        past = layer.past.keys_values(layer.transformer, layer.index)
        rotated = _with_past([k for k, _ in past], rotated)
        value = _with_past([v for _, v in past], value)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), rotated.transpose(1, 2), value.transpose(1, 2), attn_mask=layer.mask
    )
    out = attn.to_out[0](out.transpose(1, 2).flatten(2, 3).type_as(hidden))
    hidden = _gated_residual(hidden, out, gate, hidden.dtype)

    normed = block.norm2(hidden.float()).type_as(hidden)
    hidden = hidden + block.attn2(normed, text, None, None)

    normed = _norm_modulate(hidden, c_scale, c_shift, block.norm3.eps)
    out = block.ffn(normed)
    return _gated_residual(hidden, out, c_gate, out.dtype)
