"""A prefill from token ids to each unit's last hidden state, captured as CUDA graphs bucketed by token count.

A prefill runs the whole backbone over the new text tokens of every stream that starts a unit in a step. Eagerly that
is about ten kernel launches per layer plus the embedding, index and norm around them, each a call into torch that
releases the GIL and must win it back from the server's event loop; replayed from a graph it is one copy of an index
table and one launch. The spare rows of a bucket point at the cache's scratch slot, position 0, so they write and read
nothing of any stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

# (ids, slots, positions, last) -> [rows, hidden]: the normed hidden state at each ``last`` row
PrefillCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

IDS, SLOTS, POSITIONS, LAST = range(4)
MIN_BUCKET = 16


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: powers of two from 16, the last one at ``max_tokens`` (padding < 50%)."""
    sizes, size = [], MIN_BUCKET
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_tokens]


class PrefillGraphs:
    """Replays ``compute`` for up to ``max_tokens`` token rows from captured graphs."""

    def __init__(self, compute: PrefillCompute, *, scratch_slot: int, max_tokens: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.buckets = prefill_buckets(max_tokens)
        self._scratch = scratch_slot
        self._table = torch.zeros(4, max_tokens, device=device, dtype=torch.int64)
        self._table[SLOTS] = scratch_slot
        self._host = torch.zeros(4, max_tokens, dtype=torch.int64, pin_memory=True)
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        started = time.perf_counter()

        def run(size: int) -> torch.Tensor:
            table = self._table[:, :size]
            return compute(table[IDS], table[SLOTS], table[POSITIONS], table[LAST])

        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for size in self.buckets:  # warm-up: compiles kernels and settles GEMM algorithms before capture
                run(size)
        torch.cuda.current_stream(device).wait_stream(side)
        pool = None
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.no_grad():
                self._outputs[size] = run(size)
            if pool is None:
                pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - started

    def fits(self, tokens: int) -> bool:
        """Whether a prefill of ``tokens`` rows has a graph."""
        return 0 < tokens <= self.max_tokens

    def run(
        self, ids: Sequence[int], slots: Sequence[int], positions: Sequence[int], last: Sequence[int]
    ) -> torch.Tensor:
        """``[len(last), hidden]``: the normed hidden state at each ``last`` row; valid until the next run."""
        count = len(ids)
        bucket = next(size for size in self.buckets if size >= count)
        host = self._host.numpy()
        host[IDS, :count] = ids
        host[SLOTS, :count] = slots
        host[POSITIONS, :count] = positions
        host[LAST, : len(last)] = last
        host[IDS, count:bucket] = 0
        host[SLOTS, count:bucket] = self._scratch
        host[POSITIONS, count:bucket] = 0
        host[LAST, len(last) : bucket] = 0
        # The pinned table is rewritten only after the step that follows has synchronised: the copy is done by then.
        self._table[:, :bucket].copy_(self._host[:, :bucket], non_blocking=True)
        self._graphs[bucket].replay()
        return self._outputs[bucket][: len(last)]
