"""CUDA graphs of a tick's model work: launching a 7B step op by op costs far more host time than the GPU needs.

A tick's temporal transformer, text sampling and depth sampling run as one captured graph per batch size, for
batches of the slots ``0..B-1`` (their caches are then one contiguous range, read as a fixed view). Every tick is
planned as such a batch of a few bucket sizes (:func:`bucket_rows`), whichever sessions step in it. The step's
inputs are copied into the graph's buffers and the graph is replayed. Capturing runs the work (warm-up and capture)
with the real inputs, and every write it makes (the step's keys and values) is the one the replay makes again, so
capturing on a live tick leaves the caches exactly as an eager step would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


class CapturedCall:
    """A captured graph of ``call(*inputs)`` (device work only, outputs a tuple of tensors), replayed with new inputs
    of the same shapes copied into its buffers. Capturing runs ``call`` three times, so its inputs at capture must
    be ones whose writes harm nothing (the codec's scratch slot)."""

    def __init__(self, call: Callable[..., tuple[torch.Tensor, ...]], inputs: tuple[torch.Tensor, ...]) -> None:
        self.inputs = tuple(tensor.clone() for tensor in inputs)
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP):
                call(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = call(*self.inputs)

    def run(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Replay with new inputs; the outputs are overwritten by the next replay."""
        for buffer, tensor in zip(self.inputs, inputs, strict=True):
            buffer.copy_(tensor)
        self.graph.replay()
        return self.outputs


def batch_buckets(slots: int, sizes: Sequence[int] = ()) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: ``sizes`` (default: the powers of two below ``slots``) and
    ``slots`` itself, so any set of slots fits one bucket, padded at most 2x by default."""
    chosen = {size for size in sizes if 1 <= size <= slots}
    if not sizes:
        size = 1
        while size < slots:
            chosen.add(size)
            size *= 2
    return tuple(sorted(chosen | {slots}))


def bucket_rows(slots: Sequence[int], buckets: Sequence[int]) -> tuple[int, ...]:
    """The rows a tick computes for ``slots``: ``0..B-1`` for the smallest bucket ``B`` that holds them all.

    Whatever slots step (sessions without credit sit out, sessions end anywhere), the tick is a batch a captured
    graph serves; the rows not in ``slots`` are computed and masked: nothing of their state is committed.
    """
    need = max(slots) + 1
    size = next((b for b in buckets if b >= need), None)
    if size is None:
        raise ValueError(f"slot {need - 1} is beyond the largest bucket {max(buckets)}")
    return tuple(range(size))


def prefix_batch(slots: Sequence[int]) -> bool:
    """Whether ``slots`` are ``0..B-1`` in order: the batches a captured graph serves."""
    return tuple(slots) == tuple(range(len(slots)))
