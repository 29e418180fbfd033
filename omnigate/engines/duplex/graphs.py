"""CUDA graphs of a tick's model work: launching a 7B step op by op costs far more host time than the GPU needs.

A tick's temporal transformer, text sampling and depth sampling run as one captured graph per batch size, for
batches of the slots ``0..B-1`` (their caches are then one contiguous range, read as a fixed view). The step's
inputs are copied into the graph's buffers and the graph is replayed. Capturing runs the work (warm-up and capture)
with the real inputs, and every write it makes (the step's keys and values) is the one the replay makes again, so
capturing on a live tick leaves the caches exactly as an eager step would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from omnigate.engines.duplex.ring_cache import RingStep

Think = Callable[[torch.Tensor, RingStep, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(step input ``[B, hidden]``, ring step, draw counters ``[B]``, seeds ``[B]``) -> (text ids, audio codes)."""

_WARMUP = 2


class CapturedTick:
    """One batch size's captured graph and the buffers it reads and writes."""

    def __init__(self, think: Think, x: torch.Tensor, step: RingStep, steps: torch.Tensor, seeds: torch.Tensor) -> None:
        self.x = x.clone()
        self.steps = steps.clone()
        self.seeds = seeds.clone()
        self.step = replace(
            step,
            index=step.index.clone(),
            positions=step.positions.clone(),
            ring=step.ring.clone(),
            allowed=step.allowed.clone(),
        )
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP):  # compiles kernels and settles allocations outside the capture
                think(self.x, self.step, self.steps, self.seeds)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.text, self.codes = think(self.x, self.step, self.steps, self.seeds)

    def run(
        self, x: torch.Tensor, step: RingStep, steps: torch.Tensor, seeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay with new inputs; the outputs are overwritten by the next replay."""
        self.x.copy_(x)
        self.steps.copy_(steps)
        self.seeds.copy_(seeds)
        self.step.positions.copy_(step.positions)
        self.step.ring.copy_(step.ring)
        self.step.allowed.copy_(step.allowed)
        self.graph.replay()
        return self.text, self.codes


def prefix_batch(slots: tuple[int, ...]) -> bool:
    """Whether ``slots`` are ``0..B-1`` in order: the batches a captured graph serves."""
    return slots == tuple(range(len(slots)))
