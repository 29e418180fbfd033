"""The gated MLP activation ``silu(gate) * up`` over a fused gate/up projection."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from omnigate.kernels.backend import triton_kernels, use_triton


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` is ``[..., 2 * n]``: gate then up. Returns ``silu(gate) * up`` ``[..., n]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul_reference` in one Triton kernel on CUDA."""
    if use_triton(gate_up) and gate_up.stride(-1) == 1:
        out: torch.Tensor = triton_kernels().silu_mul(gate_up)
        return out
    return silu_mul_reference(gate_up)
