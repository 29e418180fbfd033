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
chunk) instead of at every forward. :class:`ForwardKernels` chooses how the forward runs on the device without
changing what it computes: the elementwise work around attention and the feed-forward (norms, per-frame
modulation, gated residuals, rotary) fused by ``torch.compile``, and the order SDPA tries its backends in.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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


def _rotary_tables(
    transformer: Any, frame_index: torch.Tensor, tokens_hw: int, pph: int, ppw: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``(batch, tokens, 1, head_dim)`` for tokens whose latent frame is ``frame_index`` (batch, tokens),
    laid out frame-major like Wan's patches; Wan's 3D rotary split (time, height, width)."""
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
    return tables[0], tables[1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on interleaved pairs (diffusers' ``apply_rotary_emb``)."""
    x1, x2 = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


# The elementwise work of a block, as pure functions of tensors (one compiled graph serves every layer and shape).


def _norm_modulate(hidden: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """Wan's float32 LayerNorm (no affine), modulated per latent frame (``scale``, ``shift``: (batch, frames, 1,
    dim)), back in ``hidden``'s dtype."""
    batch, tokens, dim = hidden.shape
    normed = F.layer_norm(hidden.float(), (dim,), eps=eps).view(batch, scale.shape[1], -1, dim)
    return (normed * (1 + scale) + shift).view(batch, tokens, dim).to(hidden.dtype)


def _affine_norm(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Wan's float32 LayerNorm with its weight and bias, back in ``hidden``'s dtype."""
    dim = hidden.shape[-1]
    return F.layer_norm(hidden.float(), (dim,), weight.float(), bias.float(), eps).to(hidden.dtype)


def _gated_residual(hidden: torch.Tensor, out: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``hidden + out * gate`` in float32 with a gate per latent frame, in ``dtype``."""
    batch, tokens, dim = hidden.shape
    frames = gate.shape[1]
    summed = hidden.float().view(batch, frames, -1, dim) + out.view(batch, frames, -1, dim) * gate
    return summed.view(batch, tokens, dim).to(dtype)


def _norm_rotate(
    x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's RMSNorm of queries or keys over all heads, split into heads, and the result rotated (same dtype)."""
    normed = F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = normed.view(*normed.shape[:-1], heads, -1)
    return normed, _rotate(normed, cos, sin).to(normed.dtype)


def _rotate_as(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rotate(x, cos, sin).to(x.dtype)


@dataclass(frozen=True)
class _Elementwise:
    norm_modulate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    affine_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    gated_residual: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    norm_rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


_EAGER = _Elementwise(_norm_modulate, _affine_norm, _gated_residual, _norm_rotate, _rotate_as)


@functools.cache
def _compiled() -> _Elementwise:
    """The same functions through ``torch.compile`` (dynamic shapes: batch, tokens and cache length vary); each is
    compiled on its first call."""

    def compile_(fn: Any) -> Any:
        return torch.compile(fn, dynamic=True, fullgraph=True)

    return _Elementwise(*(compile_(fn) for fn in vars(_EAGER).values()))


# Attention backends by name, for options; "default" leaves SDPA's own order.
ATTENTION_BACKENDS: dict[str, tuple[SDPBackend, ...]] = {
    "default": (),
    "cudnn": (
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ),
    "flash": (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
}


@dataclass(frozen=True)
class ForwardKernels:
    """How :func:`causal_forward` runs on its device; what it computes is the same (up to rounding)."""

    compiled: bool = False  # the block's elementwise work through torch.compile (fused kernels)
    attention: str = "default"  # a key of ATTENTION_BACKENDS: the order SDPA tries its backends in

    @property
    def elementwise(self) -> _Elementwise:
        return _compiled() if self.compiled else _EAGER

    @contextmanager
    def attention_backends(self) -> Iterator[None]:
        backends = ATTENTION_BACKENDS[self.attention]
        if not backends:
            yield
            return
        with sdpa_kernel(list(backends), set_priority=True):
            yield


EAGER = ForwardKernels()


@torch.no_grad()
def causal_forward(
    transformer: Any,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    context: torch.Tensor,
    caches: Sequence[ChunkKvCache | None] | None = None,
    chunk_frames: int | None = None,
    window: int | None = None,
    kernels: ForwardKernels = EAGER,
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
    query_frame = (cached + torch.arange(frames, device=device)).repeat_interleave(tokens_hw).expand(batch, -1)
    rope = _rotary_tables(transformer, query_frame, tokens_hw, pph, ppw)
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
    ops = kernels.elementwise
    with kernels.attention_backends():
        for index, block in enumerate(transformer.blocks):
            layer = _Layer(transformer, index, rope, past, mask, frames)
            hidden = _block(block, hidden, text, modulation, layer, new_kv, ops)
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
    tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def keys_values(self, transformer: Any, index: int, ops: _Elementwise) -> list[KeyValue]:
        """Each sample's rotated past keys and its values at layer ``index``."""
        for cache in self.caches:
            if len(cache.rotated_keys) <= index:
                if self.tables is None:
                    self.tables = _rotary_tables(transformer, self.key_frame, *self.layout)
                key, _ = cache.layers[index]
                cache.rotated_keys.append(ops.rotate(key, *self.tables))
        return [(cache.rotated_keys[index], cache.layers[index][1]) for cache in self.caches]


@dataclass(frozen=True)
class _Layer:
    """What one block's self-attention needs besides its input."""

    transformer: Any
    index: int
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin of the new tokens
    past: _PastKeys | None
    mask: torch.Tensor | None
    frames: int


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
    ops: _Elementwise,
) -> torch.Tensor:
    """``WanTransformerBlock.forward`` with per-frame modulation and cached keys and values in self-attention."""
    shift, scale, gate, c_shift, c_scale, c_gate = (
        block.scale_shift_table.view(1, 1, 1, 6, -1) + modulation.float()
    ).unbind(3)
    normed = ops.norm_modulate(hidden, scale, shift, block.norm1.eps)
    attn = block.attn1
    _, query = ops.norm_rotate(attn.to_q(normed), attn.norm_q.weight, attn.norm_q.eps, attn.heads, *layer.rope)
    key, rotated = ops.norm_rotate(attn.to_k(normed), attn.norm_k.weight, attn.norm_k.eps, attn.heads, *layer.rope)
    value = attn.to_v(normed).unflatten(2, (attn.heads, -1))
    new_kv.append((key, value))
    if layer.past is not None:
        past = layer.past.keys_values(layer.transformer, layer.index, ops)
        rotated = _with_past([k for k, _ in past], rotated)
        value = _with_past([v for _, v in past], value)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), rotated.transpose(1, 2), value.transpose(1, 2), attn_mask=layer.mask
    )
    out = attn.to_out[0](out.transpose(1, 2).flatten(2, 3).type_as(hidden))
    hidden = ops.gated_residual(hidden, out, gate, hidden.dtype)

    if isinstance(block.norm2, torch.nn.LayerNorm):
        normed = ops.affine_norm(hidden, block.norm2.weight, block.norm2.bias, block.norm2.eps)
    else:
        normed = block.norm2(hidden.float()).type_as(hidden)
    hidden = hidden + block.attn2(normed, text, None, None)

    normed = ops.norm_modulate(hidden, c_scale, c_shift, block.norm3.eps)
    out = block.ffn(normed)
    return ops.gated_residual(hidden, out, c_gate, out.dtype)
