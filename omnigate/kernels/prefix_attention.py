"""Attention of a few query rows over a cached prefix with only key padding masked: the robot policy's action tokens
(each of their heads a row, over one key-value head) against the prefix's keys and values and the suffix's own."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from omnigate.kernels.backend import use_triton

log = logging.getLogger(__name__)


def key_bias(valid: torch.Tensor, extra: int) -> torch.Tensor:
    """The additive mask of :func:`prefix_attention`: 0 for the valid prefix keys (``valid``, (B, P) bool) and for
    ``extra`` keys after them that every row sees, -inf for the prefix's padding. (B, P + extra) float32."""
    bias = torch.zeros(valid.shape[0], valid.shape[1] + extra, device=valid.device, dtype=torch.float32)
    bias[:, : valid.shape[1]].masked_fill_(~valid, float("-inf"))
    return bias


@contextlib.contextmanager
def _efficient_backend(query: torch.Tensor) -> Iterator[None]:
    # On CUDA the memory-efficient kernel takes an additive mask at ~60 % of the cuDNN kernel's time for these shapes
    # (benchmarks/robot_attention_probe.py); elsewhere SDPA chooses.
    if query.is_cuda:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            yield
    else:
        yield


def prefix_attention_reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_bias: torch.Tensor
) -> torch.Tensor:
    """Softmax attention (scale ``D ** -0.5``) of ``query`` (B, T, H, D) over ``keys``/``values`` (B, S, D), one
    key-value head for all H query heads, with ``key_bias`` (B, S) added to every row's scores (0 or -inf: the
    padding). Every row must see at least one key. Returns (B, T, H * D)."""
    batch, tokens, heads, head_dim = query.shape
    mask = key_bias[:, None, None, :].to(query.dtype)
    with _efficient_backend(query):
        out = F.scaled_dot_product_attention(
            query.reshape(batch, 1, tokens * heads, head_dim), keys[:, None], values[:, None], attn_mask=mask
        )
    return out.reshape(batch, tokens, heads * head_dim)


def prefix_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_bias: torch.Tensor
) -> torch.Tensor:
    """:func:`prefix_attention_reference` as a split-KV Triton kernel on CUDA (two launches, no host sync: safe in a
    CUDA graph). For a few hundred rows over several hundred keys a library's flash kernel fills a handful of
    multiprocessors and runs its key blocks one after another; this one spreads the keys over the whole GPU.

    A GPU the kernel does not fit (too little shared memory for its blocks) gets the reference, said once in the log:
    the first call of each shape is made before any CUDA graph capture, so the choice is settled by then."""
    head_dim = query.shape[-1]
    aligned = query.stride(-1) == 1 and keys.stride(-1) == 1 and values.stride(-1) == 1 and key_bias.stride(-1) == 1
    unfit = (query.device, query.dtype, head_dim) in _UNFIT
    if use_triton(query) and aligned and not unfit and head_dim >= 16 and head_dim & (head_dim - 1) == 0:
        from omnigate.kernels import triton_policy_kernels

        try:
            out: torch.Tensor = triton_policy_kernels.prefix_attention(query, keys, values, key_bias)
        except triton_policy_kernels.KERNEL_UNFIT as exc:
            log.warning("prefix attention kernel does not fit this GPU (%s); using SDPA", exc)
            _UNFIT.add((query.device, query.dtype, head_dim))
        else:
            return out
    return prefix_attention_reference(query, keys, values, key_bias)


# (device, dtype, head size) the Triton kernel could not be compiled or launched for
_UNFIT: set[tuple[torch.device, torch.dtype, int]] = set()
