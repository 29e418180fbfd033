"""Which implementation a kernel call runs: the Triton kernel for CUDA tensors where Triton is installed, else the
plain-torch reference (the CPU fallback).

``OMNIGATE_KERNELS=reference`` forces the references everywhere; ``OMNIGATE_KERNELS=triton`` forces the Triton
kernels for CPU tensors too, which runs them in Triton's interpreter when ``TRITON_INTERPRET=1`` (slow; for tests
on machines without a GPU)."""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType

import torch


@functools.cache
def triton_installed() -> bool:
    """Whether the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def triton_kernels() -> ModuleType:
    """The Triton kernel module (imports Triton on first use)."""
    from omnigate.kernels import triton_kernels as module

    return module


def use_triton(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` lives on a CUDA device, Triton is installed and the references are not forced."""
    choice = os.environ.get("OMNIGATE_KERNELS")
    if choice == "reference" or not triton_installed():
        return False
    return tensor.is_cuda or choice == "triton"
