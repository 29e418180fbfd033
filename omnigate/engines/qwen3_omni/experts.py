"""A mixture-of-experts block as grouped GEMMs: every (token, chosen expert) pair sorted by expert, then ONE grouped
matrix multiply per projection over all the experts' groups.

transformers' reference runs one pair of matmuls per expert that any token chose, in a Python loop (128 experts,
8 per token: up to 128 small GEMMs and a host read per layer). Here the routing, the sort and the group offsets stay
on the device and the shapes depend only on the number of rows, so a decode step with its MoE layers can be captured
in a CUDA graph. The weights are the transformers modules' own ``[experts, 2 * intermediate, hidden]`` and
``[experts, hidden, intermediate]`` tensors, read through transposed views (no copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from omnigate.kernels.activation import silu_mul


@dataclass(frozen=True)
class ExpertWeights:
    """One MoE block's router and experts (and the talker's shared expert with its sigmoid gate)."""

    router: torch.Tensor  # [E, hidden]
    gate_up: torch.Tensor  # [E, 2 * I, hidden]
    down: torch.Tensor  # [E, hidden, I]
    top_k: int
    norm_top_k: bool
    shared_gate_up: torch.Tensor | None = None  # [2 * Is, hidden]
    shared_down: torch.Tensor | None = None  # [hidden, Is]
    shared_gate: torch.Tensor | None = None  # [1, hidden]


def route(x: torch.Tensor, weights: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen experts ``[R, k]``, their weights ``[R, k]`` in ``x``'s dtype), as the reference router computes them:
    softmax in float32, top-k, renormalised when the block says so."""
    probs = torch.softmax((x @ weights.router.t()).float(), dim=-1)
    top, chosen = torch.topk(probs, weights.top_k, dim=-1)
    if weights.norm_top_k:
        top = top / top.sum(dim=-1, keepdim=True)
    return chosen, top.to(x.dtype)


def grouped_experts(x: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
    """The block's output ``[R, hidden]`` for rows ``x`` ``[R, hidden]``: routed experts (plus the shared expert)."""
    rows = x.shape[0]
    experts = weights.gate_up.shape[0]
    chosen, scale = route(x, weights)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // weights.top_k
    # Group ends by counting with a scatter (bincount reads its maximum on the host, which a graph cannot hold).
    counts = torch.zeros(experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    gathered = x.index_select(0, token)
    hidden = silu_mul(F.grouped_mm(gathered, weights.gate_up.transpose(1, 2), offs=offsets))
    out = F.grouped_mm(hidden, weights.down.transpose(1, 2), offs=offsets)
    out = out * scale.reshape(-1).index_select(0, order)[:, None]
    result = torch.zeros(rows, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, token, out.to(x.dtype))
    if weights.shared_gate_up is not None and weights.shared_down is not None and weights.shared_gate is not None:
        shared = silu_mul(x @ weights.shared_gate_up.t()) @ weights.shared_down.t()
        result = result + torch.sigmoid(x @ weights.shared_gate.t()) * shared
    return result
