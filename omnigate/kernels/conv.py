"""Transposed 1-d convolution without padding, fast for the short inputs of streaming decoders."""

from __future__ import annotations

import torch

# Below this many input elements at batch 1, PyTorch's CPU backend leaves oneDNN for a native path whose cost
# does not shrink with the input (tens of ms for a 2-step, 1024-channel input); the written-out form is faster.
_SMALL_CPU_INPUT = 20480


def conv_transpose1d(x: torch.Tensor, weight: torch.Tensor, stride: int, groups: int) -> torch.Tensor:
    """``torch.nn.functional.conv_transpose1d(x, weight, stride=stride, groups=groups)`` (no bias, no padding)."""
    if x.device.type == "cpu" and x.shape[0] == 1 and x.numel() <= _SMALL_CPU_INPUT:
        return conv_transpose1d_overlap_add(x, weight, stride, groups)
    return torch.nn.functional.conv_transpose1d(x, weight, None, stride, 0, 0, groups)


def conv_transpose1d_overlap_add(x: torch.Tensor, weight: torch.Tensor, stride: int, groups: int) -> torch.Tensor:
    """The transposed convolution as one matrix product plus an overlap-add.

    ``x`` is ``[B, Cin, T]`` and ``weight`` ``[Cin, Cout / groups, K]``; returns ``[B, Cout, (T - 1) * stride + K]``.
    """
    batch, in_channels, steps = x.shape
    _, out_per_group, kernel = weight.shape
    in_per_group = in_channels // groups
    # Every input step contributes a K-long kernel-weighted burst: [B, G, Cout/G, T, K].
    bursts = torch.einsum(
        "bgct,gcok->bgotk",
        x.reshape(batch, groups, in_per_group, steps),
        weight.reshape(groups, in_per_group, out_per_group, kernel),
    ).reshape(batch, groups * out_per_group, steps, kernel)
    blocks = -(-kernel // stride)
    if blocks * stride != kernel:
        bursts = torch.nn.functional.pad(bursts, (0, blocks * stride - kernel))
    out = bursts.new_zeros(batch, groups * out_per_group, (steps + blocks - 1) * stride)
    for block in range(blocks):
        # Burst samples [block*stride, (block+1)*stride) of step t land at t*stride + block*stride.
        part = bursts[..., block * stride : (block + 1) * stride].reshape(batch, -1, steps * stride)
        out[..., block * stride : (block + steps) * stride] += part
    return out[..., : (steps - 1) * stride + kernel]
