"""RMSNorm as the Llama-style decoders compute it."""

from __future__ import annotations

import torch

from omnigate.kernels.backend import triton_kernels, use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))``, normalised in float32 and rounded to ``x``'s dtype before the weight."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: one Triton kernel on CUDA, the reference elsewhere."""
    if use_triton(x) and x.stride(-1) == 1:
        out: torch.Tensor = triton_kernels().rms_norm(x, weight, eps)
        return out
    return rms_norm_reference(x, weight, eps)
