"""A prefill from token ids to each unit's last hidden state, captured as CUDA graphs bucketed by token count.

A prefill runs the whole backbone over the new text tokens of every stream that starts a unit in a step. Eagerly that
is about ten kernel launches per layer plus the embedding, index and norm around them, each a call into torch that
releases the GIL and must win it back from the server's event loop; replayed from a graph it is one copy of an index
table and one launch. The spare rows of a bucket point at the cache's scratch slot, position 0, so they write and read
nothing of any stream.

The buckets hold one step's whole prefill, whatever one stream's context window: a step's tokens span many slots. A
prefill larger than the largest bucket (a single unit longer than the whole budget) replays the graphs piece after
piece, in order, each piece's rows attending to what the pieces before wrote.

Memory: the graphs share one pool, sized by the largest bucket's activations, which are linear in its tokens (no
tokens x context buffer: the slot attention streams the keys). Per token that is about ``3 x intermediate + 6 x
hidden`` values of the backbone's dtype (the MLP's gate, up and product dominate); :attr:`PrefillGraphs.pool_bytes`
is what the capture actually reserved.

Without capture (``capture=False``, any device) the same bucketing and padding run eagerly: the twin that checks
them on the CPU.
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


def prefill_pieces(tokens: int, max_tokens: int) -> list[tuple[int, int]]:
    """``[start, end)`` row ranges of at most ``max_tokens`` rows that a prefill of ``tokens`` rows runs in."""
    return [(start, min(start + max_tokens, tokens)) for start in range(0, tokens, max_tokens)]


class PrefillGraphs:
    """Replays ``compute`` for any number of token rows from graphs captured for up to ``max_tokens`` rows."""

    def __init__(
        self,
        compute: PrefillCompute,
        *,
        scratch_slot: int,
        max_tokens: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.max_tokens = max_tokens
        self.buckets = prefill_buckets(max_tokens)
        self.pool_bytes = 0
        self.capture_s = 0.0
        self._compute = compute
        self._scratch = scratch_slot
        self._table = torch.zeros(4, max_tokens, device=device, dtype=torch.int64)
        self._table[SLOTS] = scratch_slot
        self._host = torch.zeros(4, max_tokens, dtype=torch.int64, pin_memory=capture)
        # marks the host table's last copy to the device done: rewritten before it only between a prefill's pieces
        self._copied = torch.cuda.Event() if capture else None  # type: ignore[no-untyped-call]
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture(device)

    def _run_eagerly(self, size: int) -> torch.Tensor:
        table = self._table[:, :size]
        return self._compute(table[IDS], table[SLOTS], table[POSITIONS], table[LAST])

    def _capture(self, device: torch.device) -> None:
        started = time.perf_counter()
        reserved = torch.cuda.memory_reserved(device)
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for size in self.buckets:  # warm-up: compiles kernels and settles GEMM algorithms before capture
                self._run_eagerly(size)
        torch.cuda.current_stream(device).wait_stream(side)
        pool = None
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.no_grad():
                self._outputs[size] = self._run_eagerly(size)
            if pool is None:
                pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize(device)
        self.pool_bytes = torch.cuda.memory_reserved(device) - reserved
        self.capture_s = time.perf_counter() - started

    def bucket(self, tokens: int) -> int:
        """The captured size a piece of ``tokens`` rows (1..``max_tokens``) replays: the smallest that holds it."""
        for size in self.buckets:
            if size >= tokens:
                return size
        raise ValueError(f"no prefill graph holds {tokens} rows")

    def run(
        self, ids: Sequence[int], slots: Sequence[int], positions: Sequence[int], last: Sequence[int]
    ) -> torch.Tensor:
        """``[len(last), hidden]``: the normed hidden state at each ``last`` row (ascending); valid until the next
        run."""
        pieces = prefill_pieces(len(ids), self.max_tokens)
        if len(pieces) == 1:
            return self._run_piece(ids, slots, positions, last)
        outputs = []
        for k, (start, end) in enumerate(pieces):
            if k and self._copied is not None:
                self._copied.synchronize()  # the previous piece's table must have left the host buffer
            ends = [row - start for row in last if start <= row < end]
            piece = self._run_piece(ids[start:end], slots[start:end], positions[start:end], ends, mark=True)
            outputs.append(piece.clone())
        return torch.cat(outputs)

    def _run_piece(
        self,
        ids: Sequence[int],
        slots: Sequence[int],
        positions: Sequence[int],
        last: Sequence[int],
        *,
        mark: bool = False,
    ) -> torch.Tensor:
        count = len(ids)
        bucket = self.bucket(count)
        host = self._host.numpy()
        host[IDS, :count] = ids
        host[SLOTS, :count] = slots
        host[POSITIONS, :count] = positions
        host[LAST, : len(last)] = last
        host[IDS, count:bucket] = 0
        host[SLOTS, count:bucket] = self._scratch
        host[POSITIONS, count:bucket] = 0
        host[LAST, len(last) : bucket] = 0
        # The pinned table is rewritten only after the step that follows has synchronised (between the pieces of
        # one prefill, after the copy's event): the copy is done by then.
        self._table[:, :bucket].copy_(self._host[:, :bucket], non_blocking=True)
        if mark and self._copied is not None:
            self._copied.record()
        if not self._graphs:  # the eager twin
            return self._run_eagerly(bucket)[: len(last)]
        self._graphs[bucket].replay()
        return self._outputs[bucket][: len(last)]
