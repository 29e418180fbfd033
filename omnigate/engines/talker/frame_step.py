"""Everything one talker step does on the device, over fixed buffers, captured as CUDA graphs on a GPU.

A step takes rows (one per stream that gets a frame this step) and, for each: embeds the stream's last frame and runs
the backbone one position on (or takes the hidden state its prefill left), samples codebook 0 and the depth decoder's
codebooks, stores the frame as the stream's last, decodes it through the streaming Mimi decoder, and packs the
frame's audio as s16 PCM with its RMS and an end-of-audio flag. The host writes one input table before the step and
reads one packed table after it: two copies, no other host work or synchronisation inside the step.

:meth:`FrameStep.launch` only enqueues the step; :meth:`FrameStep.collect` waits for it. The packed outputs land in
one of two pinned host buffers, alternately, so the host can still be reading one step's outputs while the next step
runs on the device and copies its own into the other buffer.

On CUDA the step is captured once per bucket of batch sizes (a CUDA graph replays its thousands of kernels without
Python or launch overhead); a batch runs in the smallest bucket that holds it, the spare rows pointed at scratch slots
that belong to no stream. Elsewhere the same code runs eagerly at the exact batch size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from omnigate.engines.codec.mimi_stream import MimiStreamDecoder
from omnigate.engines.talker.frames import FrameModel
from omnigate.kernels.pcm import PACK_EXTRA, pack_pcm, unpack_rms
from omnigate.kernels.sampling_types import SamplingRows

# Rows of the input table (one column per batch row).
SLOT, POSITION, FRAME_SLOT, CODEC_SLOT, SEED, COUNTER, RING, PREFILL, FRESH = range(9)
INPUT_ROWS = 9


def default_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: powers of two to 64, then steps of a quarter of the power below (padding <= 25%)."""
    sizes = {1, 2, 4, 8, 16, 32, 64}
    base = 64
    while base < max_batch:
        sizes.update(base + k * base // 4 for k in range(1, 5))
        base *= 2
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


@dataclass
class StepRows:
    """Host-side description of one step's rows: streams that decode a frame first, then streams whose prefill
    just ran (their hidden states are in :attr:`FrameStep.prefill_hidden`)."""

    slots: list[int]  # each row's stream slot
    positions: list[int]  # backbone cache position of decoding rows (ignored for prefill rows)
    seeds: list[int]
    counters: list[int]
    rings: list[int]
    fresh: list[int]  # 1 where the stream has decoded no audio yet: its codec state starts clean
    decoding: int  # the first ``decoding`` rows decode; the rest were prefilled


@dataclass(frozen=True)
class StepResult:
    """One step's outputs on the host, row for row."""

    pcm: np.ndarray[tuple[int, int], np.dtype[np.int16]]  # [rows, samples]
    rms: np.ndarray[tuple[int], np.dtype[np.float32]]
    ended: np.ndarray[tuple[int], np.dtype[np.bool_]]  # the frame is the end-of-audio frame (no audio decoded)


class FrameStep:
    """The device side of a talker step for up to ``max_batch`` rows."""

    def __init__(
        self,
        frames: FrameModel,
        codec: MimiStreamDecoder,
        *,
        max_batch: int,
        graphs: bool,
        buckets: Sequence[int] | None = None,
    ) -> None:
        self.frames = frames
        self.codec = codec
        self.max_batch = max_batch
        device = frames.device
        self.device = device
        self.scratch = frames.cache.scratch
        if codec.scratch != self.scratch:
            raise ValueError("the codec and the backbone cache must have the same number of slots")
        cuda = device.type == "cuda"
        sampler = frames.sampler
        window = sampler.repetition_window
        self.window = window
        slots = self.scratch + 1
        self.inputs = torch.zeros(INPUT_ROWS, max_batch, dtype=torch.int64, device=device)
        self._host_inputs = torch.zeros(INPUT_ROWS, max_batch, dtype=torch.int64, pin_memory=cuda)
        self._idle_row = np.array([self.scratch, 0, self.scratch, self.scratch, 0, 0, 0, 0, 0], dtype=np.int64)
        self._host_inputs.numpy()[:] = self._idle_row[:, None]
        self.inputs.copy_(self._host_inputs)
        hidden = frames.backbone.heads * frames.backbone.head_dim
        self.prefill_hidden = torch.zeros(max_batch, hidden, dtype=frames.dtype, device=device)
        self.last_frames = torch.zeros(slots, frames.num_codebooks, dtype=torch.int64, device=device)
        self.history = torch.full((slots, frames.num_codebooks, window), -1, dtype=torch.int64, device=device)
        self.samples = codec.samples_per_frame
        self.out = torch.zeros(max_batch, self.samples + PACK_EXTRA, dtype=torch.int16, device=device)
        # Two host buffers, each with the event that marks its copy complete: the step after next reuses a buffer.
        self._host_out = [torch.zeros(self.out.shape, dtype=self.out.dtype, pin_memory=cuda) for _ in range(2)]
        self._copied = [torch.cuda.Event() for _ in self._host_out] if cuda else []  # type: ignore[no-untyped-call]
        self._launches = 0
        self._rows: dict[int, int] = {}  # buffer -> rows of its step, until collected
        self._sampling = SamplingRows(
            temperature=torch.full((max_batch,), sampler.temperature, dtype=torch.float32, device=device),
            top_k=torch.full((max_batch,), sampler.top_k, dtype=torch.int32, device=device),
            top_p=torch.full((max_batch,), sampler.top_p, dtype=torch.float32, device=device),
            penalty=torch.full((max_batch,), sampler.repetition_penalty, dtype=torch.float32, device=device),
            seeds=self.inputs[SEED],
            counters=self.inputs[COUNTER],
            history_slots=self.inputs[FRAME_SLOT],
            ring=self.inputs[RING],
        )
        self.graphs: _StepGraphs | None = None
        if graphs:
            if not cuda:
                raise ValueError("CUDA graphs need a CUDA device")
            self.graphs = _StepGraphs(self._compute, buckets or default_buckets(max_batch))

    @torch.no_grad()
    def _compute(self, rows: int, decoding: int) -> None:
        """The step over rows ``[0, rows)``; with ``decoding == rows`` every row runs the backbone and prefilled rows
        take their hidden state by the flag (the fixed-shape form that graphs capture)."""
        inputs = self.inputs[:, :rows]
        hidden = self.prefill_hidden[:rows]
        if decoding:
            frame_slots = inputs[FRAME_SLOT, :decoding]
            decoded = self.frames.decode(
                inputs[SLOT, :decoding], inputs[POSITION, :decoding], self.last_frames[frame_slots]
            )
            if decoding == rows:
                hidden = torch.where(inputs[PREFILL, :, None].bool(), hidden, decoded)
            else:
                hidden = torch.cat((decoded, self.prefill_hidden[decoding:rows]))
        if self.window:
            # A stream's first draw (counter 0) starts with an empty repetition window.
            frame_slots = inputs[FRAME_SLOT]
            first = (inputs[COUNTER] == 0)[:, None, None]
            self.history.index_copy_(0, frame_slots, torch.where(first, -1, self.history.index_select(0, frame_slots)))
        frame = self.frames.generate(hidden, self._sampling.head(rows), self.history)
        self.last_frames[inputs[FRAME_SLOT]] = frame
        ended = (frame == self.frames.eos_id).all(dim=1)
        # An end-of-audio frame is not audio: its row decodes into the scratch slot, leaving the stream's state as is.
        codec_slots = torch.where(ended, self.scratch, inputs[CODEC_SLOT])
        audio = self.codec.decode_frames(frame[:, :, None], codec_slots, inputs[FRESH])
        pack_pcm(audio, ended, self.out[:rows])

    @torch.no_grad()
    def run(self, rows: StepRows, prefill_hidden: torch.Tensor | None = None) -> StepResult:
        """Run one step for ``rows`` and wait for its outputs (:meth:`launch`, then :meth:`collect`)."""
        return self.collect(self.launch(rows, prefill_hidden))

    @torch.no_grad()
    def launch(self, rows: StepRows, prefill_hidden: torch.Tensor | None = None) -> int:
        """Enqueue one step for ``rows`` (``prefill_hidden``: the prefilled rows' hidden states, in order) and return
        the host buffer its outputs will land in, for :meth:`collect`. The previous launch must have been collected
        (the input table is reused); its outputs stay readable until the launch after this one."""
        count = len(rows.slots)
        if not 0 < count <= self.max_batch:
            raise ValueError(f"a step takes 1..{self.max_batch} rows, not {count}")
        if self._rows:
            raise RuntimeError("the previous step has not been collected")
        if prefill_hidden is not None and prefill_hidden.shape[0]:
            self.prefill_hidden[rows.decoding : count] = prefill_hidden
        bucket = count if self.graphs is None else self.graphs.bucket(count)
        table = self._host_inputs.numpy()
        table[:, count:bucket] = self._idle_row[:, None]
        decoding = rows.decoding
        table[SLOT, :count] = rows.slots
        table[SLOT, decoding:count] = self.scratch
        table[POSITION, :decoding] = rows.positions[:decoding]
        table[POSITION, decoding:count] = 0
        table[FRAME_SLOT, :count] = rows.slots
        table[CODEC_SLOT, :count] = rows.slots
        table[SEED, :count] = rows.seeds
        table[COUNTER, :count] = rows.counters
        table[RING, :count] = rows.rings
        table[PREFILL, :decoding] = 0
        table[PREFILL, decoding:count] = 1
        table[FRESH, :count] = rows.fresh
        self.inputs.copy_(self._host_inputs, non_blocking=True)
        if self.graphs is None:
            self._compute(count, decoding)
        else:
            self.graphs.replay(bucket)
        buffer = self._launches % len(self._host_out)
        self._launches += 1
        self._host_out[buffer][:count].copy_(self.out[:count], non_blocking=self.device.type == "cuda")
        if self._copied:
            self._copied[buffer].record()
        self._rows[buffer] = count
        return buffer

    @torch.no_grad()
    def time_steps(self, sizes: Sequence[int], reps: int = 3) -> list[tuple[int, float]]:
        """Seconds of one step of each of ``sizes`` rows (the median of ``reps`` after a warm-up run), over idle rows
        on the scratch slots, so no stream's state changes. Call before the first launch."""
        if self._rows:
            raise RuntimeError("a step is in flight")
        timings: list[tuple[int, float]] = []
        for size in sizes:
            times = []
            for _ in range(reps + 1):
                self._synchronize()
                started = time.perf_counter()
                if self.graphs is not None:
                    self.graphs.replay(self.graphs.bucket(size))
                else:
                    self._compute(size, size)
                self._synchronize()
                times.append(time.perf_counter() - started)
            timings.append((size, statistics.median(times[1:])))
        return timings

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def collect(self, buffer: int) -> StepResult:
        """Wait for the step launched into ``buffer`` and return its outputs (views of the host buffer)."""
        count = self._rows.pop(buffer)
        if self._copied:
            self._copied[buffer].synchronize()
        packed = self._host_out[buffer][:count].numpy()
        return StepResult(
            pcm=packed[:, : self.samples],
            rms=unpack_rms(packed, self.samples),
            ended=packed[:, self.samples + 2] != 0,
        )

    def discard(self) -> None:
        """Forget a launched step whose outputs nobody will collect (after a failure)."""
        self._rows.clear()


class _StepGraphs:
    """One CUDA graph of the step per bucket size, sharing one memory pool (they never run concurrently)."""

    def __init__(self, compute: Callable[[int, int], None], buckets: Sequence[int]) -> None:
        self.buckets = sorted(set(buckets))
        self.capture_s = 0.0
        started = time.perf_counter()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for size in self.buckets:  # warm-up: compiles kernels, settles GEMM algorithms and lazy caches
                compute(size, size)
        torch.cuda.current_stream().wait_stream(side)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                compute(size, size)
            if pool is None:
                pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started

    def bucket(self, rows: int) -> int:
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(f"no graph holds {rows} rows")

    def replay(self, bucket: int) -> None:
        self._graphs[bucket].replay()
