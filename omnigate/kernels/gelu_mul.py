"""Gemma's gated MLP activation ``gelu_tanh(gate) * up`` over a fused gate/up projection."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from omnigate.kernels.backend import use_triton


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` is ``[..., 2 * n]``: gate then up. Returns ``gelu(gate, approximate="tanh") * up`` ``[..., n]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`gelu_tanh_mul_reference` in one Triton kernel on CUDA (the reference is two)."""
    if use_triton(gate_up) and gate_up.stride(-1) == 1:
        from omnigate.kernels import triton_policy_kernels

        out: torch.Tensor = triton_policy_kernels.gelu_tanh_mul(gate_up)
        return out
    return gelu_tanh_mul_reference(gate_up)
