"""The backbone forward of a prefill, captured as CUDA graphs bucketed by token count.

A prefill runs the whole backbone over the new text tokens of every stream that starts a unit in a step. Eagerly that
is about ten kernel launches per layer from Python, several milliseconds of host time that also hold the GIL the
server's event loop needs; a replayed graph is one launch. Tokens are copied into fixed buffers and the spare rows of
the bucket point at the cache's scratch slot, position 0, so they write and read nothing of any stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

BackboneForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

MIN_BUCKET = 16


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: powers of two from 16, the last one at ``max_tokens`` (padding < 50%)."""
    sizes, size = [], MIN_BUCKET
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_tokens]


class PrefillGraphs:
    """Replays ``forward(x, slots, positions)`` for up to ``max_tokens`` rows from captured graphs."""

    def __init__(
        self,
        forward: BackboneForward,
        *,
        hidden: int,
        scratch_slot: int,
        max_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.max_tokens = max_tokens
        self.buckets = prefill_buckets(max_tokens)
        self._scratch = scratch_slot
        self._x = torch.zeros(max_tokens, hidden, device=device, dtype=dtype)
        self._slots = torch.full((max_tokens,), scratch_slot, device=device, dtype=torch.int64)
        self._positions = torch.zeros(max_tokens, device=device, dtype=torch.int64)
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        started = time.perf_counter()
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for size in self.buckets:  # warm-up: compiles kernels and settles GEMM algorithms before capture
                forward(self._x[:size], self._slots[:size], self._positions[:size])
        torch.cuda.current_stream(device).wait_stream(side)
        pool = None
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.no_grad():
                self._outputs[size] = forward(self._x[:size], self._slots[:size], self._positions[:size])
            if pool is None:
                pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - started

    def fits(self, tokens: int) -> bool:
        """Whether a prefill of ``tokens`` rows has a graph."""
        return 0 < tokens <= self.max_tokens

    def run(self, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The backbone output for rows ``x`` ``[T, hidden]``; valid until the next :meth:`run`."""
        count = x.shape[0]
        bucket = next(size for size in self.buckets if size >= count)
        self._x[:count].copy_(x)
        self._slots[:count].copy_(slots)
        self._positions[:count].copy_(positions)
        self._slots[count:bucket].fill_(self._scratch)
        self._positions[count:bucket].zero_()
        self._graphs[bucket].replay()
        return self._outputs[bucket][:count]
