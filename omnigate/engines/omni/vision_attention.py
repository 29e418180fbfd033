"""The vision encoder's attention as one batched SDPA call per distinct segment length.

Qwen2.5-Omni's vision encoder attends within segments of its packed sequence (windows of 8x8 patches in most
layers, a whole frame in the full-attention ones), given as ``cu_seqlens``. Unless a flash attention is requested,
transformers runs one attention call per segment in a Python loop: for 336 px frames ~256 small calls per frame,
which bounds the encoder by launch overhead rather than by arithmetic. Segments of one length (every full window of
a frame size; every frame in the full-attention layers) are independent sequences of the same shape, so they run
as one ``scaled_dot_product_attention`` over ``[segments, heads, L, head_dim]``; only the edge windows of frame sizes
that are not a multiple of the window make further groups.

The function is registered in transformers' attention registry and chosen on the vision encoder's config only. Its
name contains "flash" because that word is what sends the encoder's attention down its varlen branch (the one that
hands the attention function ``cu_seq_lens_q`` instead of splitting the sequence itself); the model's
``set_attn_implementation`` would try to import a flash kernel for such a name, hence the config is set directly.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.utils.generic import is_flash_attention_requested

SEGMENTED_SDPA = "omnigate_flash_varlen_segmented_sdpa"


@dataclass(frozen=True)
class _Group:
    """``count`` segments of ``length`` rows each; ``rows`` their row indices in order, or None when the group is
    the whole sequence in order (no gather needed)."""

    count: int
    length: int
    rows: torch.Tensor | None


@lru_cache(maxsize=64)
def _plan(lengths: tuple[int, ...], device: torch.device) -> tuple[_Group, ...]:
    starts: list[int] = []
    at = 0
    for length in lengths:
        starts.append(at)
        at += length
    if len(set(lengths)) == 1:
        return (_Group(len(lengths), lengths[0], None),)
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts, lengths, strict=True):
        by_length.setdefault(length, []).append(start)
    groups = []
    for length, group_starts in by_length.items():
        rows = (torch.tensor(group_starts)[:, None] + torch.arange(length)[None, :]).reshape(-1)
        groups.append(_Group(len(group_starts), length, rows.to(device)))
    return tuple(groups)


class _RecentSegments:
    """The groups of the last few ``cu_seqlens`` tensors, by identity: the encoder passes the same two tensors (windows,
    whole frames) to every layer of a call, so their lengths are read from the device (a sync) once per call, not once
    per layer. Holding each tensor keeps its ``id`` from being reused while it is a key."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: dict[int, tuple[torch.Tensor, tuple[_Group, ...]]] = {}
        self._lock = threading.Lock()

    def __call__(self, cu_seqlens: torch.Tensor) -> tuple[_Group, ...]:
        with self._lock:
            entry = self._entries.get(id(cu_seqlens))
        if entry is not None and entry[0] is cu_seqlens:
            return entry[1]
        lengths = tuple(int(n) for n in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist() if n > 0)
        groups = _plan(lengths, cu_seqlens.device)
        with self._lock:
            while len(self._entries) >= self._size:
                del self._entries[next(iter(self._entries))]
            self._entries[id(cu_seqlens)] = (cu_seqlens, groups)
        return groups


_segments = _RecentSegments(size=8)


def segmented_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    is_causal: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each segment of a packed sequence: ``query``/``key``/``value`` ``[1, heads, S, head_dim]``,
    segments given by ``cu_seq_lens_q`` (the same as ``cu_seq_lens_k``); returns ``[1, S, heads, head_dim]`` like
    transformers' flash interface."""
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError("segmented attention takes one packed sequence and no mask")
    # The encoder passes one tensor as both; anything else is compared (a device sync) to refuse a mismatch.
    if cu_seq_lens_k is not cu_seq_lens_q and (
        cu_seq_lens_k is None or cu_seq_lens_q is None or not torch.equal(cu_seq_lens_k, cu_seq_lens_q)
    ):
        raise ValueError("segmented attention needs the same segments for queries and keys")
    heads, total, dim = query.shape[1:]
    groups = _plan((total,), query.device) if cu_seq_lens_q is None else _segments(cu_seq_lens_q)
    q, k, v = query[0], key[0], value[0]  # [heads, S, dim]

    def attend(group: _Group, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        # [heads, n*L, dim] -> [n, heads, L, dim] -> attention -> [n*L, heads, dim]
        shape = (heads, group.count, group.length, dim)
        out = F.scaled_dot_product_attention(
            qs.view(shape).transpose(0, 1),
            ks.view(shape).transpose(0, 1),
            vs.view(shape).transpose(0, 1),
            dropout_p=dropout,
            is_causal=is_causal,
            scale=scaling,
        )
        return out.transpose(1, 2).reshape(group.count * group.length, heads, dim)

    if len(groups) == 1 and groups[0].rows is None:
        return attend(groups[0], q, k, v).unsqueeze(0), None
    result = query.new_empty(total, heads, dim)
    for group in groups:
        assert group.rows is not None
        picked = (t.index_select(1, group.rows) for t in (q, k, v))
        result.index_copy_(0, group.rows, attend(group, *picked))
    return result.unsqueeze(0), None


AttentionInterface.register(SEGMENTED_SDPA, segmented_sdpa)


def use_segmented_attention(vision_config: Any) -> bool:
    """Choose :func:`segmented_sdpa` for the vision encoder configured by ``vision_config`` (the encoder reads
    its config on every call), unless a flash attention is already requested; whether it was chosen."""
    if is_flash_attention_requested(vision_config):
        return bool(vision_config._attn_implementation == SEGMENTED_SDPA)
    vision_config._attn_implementation = SEGMENTED_SDPA
    return True
