"""The thinker's decode step with its sampling, as one fixed-size batch: replayed from a CUDA graph per batch bucket.

Eagerly a decode step of the 3B thinker is ~400 kernel launches (15-20 ms on an H200 whatever the batch); replayed
from a graph it is three copies in and one launch. A step samples every answer's next token from its logits (inverse
CDF, one uniform per answer, as :func:`~omnigate.engines.omni.sampling.sample_rows` does eagerly) and runs the
thinker over the sampled tokens at once, so the ids leave the device once per step. The ``n`` rows of a step fill
the first rows of the smallest bucket that holds them; every other row, and every row whose answer cannot go on
whatever it samples (no room left in its slot, or its last token), writes at the cache's scratch slot, position 0,
so it changes nothing of any answer. A row that samples its end of answer wrote one key past its slot's length:
never read (lengths are committed on the host only for the rows that go on). Captures reuse the duplex engine's
:class:`~omnigate.engines.duplex.graphs.CapturedCall` and buckets; on the CPU the same padded step runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from omnigate.engines.duplex.graphs import CapturedCall, batch_buckets

# (logits [B, V] float32, floats [2, B] float64: temperature and uniform, ints [2, B] int64: slot and position)
# -> (sampled ids [B], next logits [B, V] float32)
StepCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

TEMPERATURE, UNIFORM = 0, 1
SLOT, POSITION = 0, 1


@dataclass(frozen=True)
class StepRows:
    """A step's rows on the host, padded to ``bucket``: what the captured graph reads."""

    bucket: int
    floats: list[list[float]]  # [2][bucket]: temperature, uniform
    ints: list[list[int]]  # [2][bucket]: slot, position


def pad_step_rows(
    temperature: Sequence[float],
    uniforms: Sequence[float],
    targets: Sequence[tuple[int, int] | None],
    buckets: Sequence[int],
    scratch: int,
) -> StepRows:
    """The rows of one step: row ``i`` samples with ``temperature[i]`` and ``uniforms[i]`` and writes its token at
    ``targets[i]`` (slot, position), or at the scratch slot when ``targets[i]`` is None; rows past ``len(targets)``
    up to the smallest bucket that holds them sample greedily and write at the scratch slot."""
    count = len(targets)
    bucket = next((b for b in buckets if b >= count), None)
    if bucket is None or count == 0:
        raise ValueError(f"a step of {count} rows does not fit the buckets {tuple(buckets)}")
    pad = bucket - count
    slots = [scratch if t is None else t[0] for t in targets] + [scratch] * pad
    positions = [0 if t is None else t[1] for t in targets] + [0] * pad
    return StepRows(
        bucket=bucket,
        floats=[list(temperature) + [0.0] * pad, list(uniforms) + [0.0] * pad],
        ints=[slots, positions],
    )


class DecodeSteps:
    """Runs ``compute`` on padded rows: from a graph captured per bucket on CUDA, eagerly elsewhere."""

    def __init__(self, compute: StepCompute, *, slots: int, vocab: int, device: torch.device) -> None:
        self.buckets = batch_buckets(slots)
        self.vocab = vocab
        self.device = device
        self._compute = compute
        self._graphs: dict[int, CapturedCall] = {}

    @property
    def captured(self) -> int:
        """Buckets with a captured graph."""
        return len(self._graphs)

    def capture(self, scratch: int) -> None:
        """Capture every bucket's graph (CUDA only): the capture runs the step on rows that all write at the scratch
        slot, so it leaves every answer's cache as it was."""
        if self.device.type != "cuda":
            return
        for bucket in self.buckets:
            logits = torch.zeros(bucket, self.vocab, device=self.device)
            floats = torch.zeros(2, bucket, device=self.device, dtype=torch.float64)
            ints = torch.zeros(2, bucket, device=self.device, dtype=torch.int64)
            ints[SLOT] = scratch
            self._graphs[bucket] = CapturedCall(self._compute, (logits, floats, ints))

    def run(self, logits: Sequence[torch.Tensor], rows: StepRows) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampled ids ``[n]``, next logits ``[n, V]``) of the ``n = len(logits)`` rows; from a graph, the outputs
        are valid until the next run of the same bucket."""
        count = len(logits)
        floats = torch.tensor(rows.floats, dtype=torch.float64)
        ints = torch.tensor(rows.ints, dtype=torch.int64)  # both copied into the graph's buffers as they are
        captured = self._graphs.get(rows.bucket)
        if captured is None:
            padded = torch.zeros(rows.bucket, self.vocab, device=self.device)
            torch.stack(list(logits), out=padded[:count])
            sampled, following = self._compute(padded, floats.to(self.device), ints.to(self.device))
            return sampled[:count], following[:count]
        # The logits go straight into the graph's input buffer (its spare rows keep earlier, finite values).
        buffer = captured.inputs[0]
        torch.stack(list(logits), out=buffer[:count])
        sampled, following = captured.run((buffer, floats, ints))
        return sampled[:count], following[:count]
