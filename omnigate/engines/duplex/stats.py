"""Counters of the duplex engine's tick clock, kept without torch so the gateway's metrics can read them.

The clock thread is the only writer of every field except ``sessions`` (written under the engine's lock); readers
(a ``/metrics`` scrape) read without a lock and may see one tick's fields half updated, which a counter tolerates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STEP_BUCKETS_S = (0.02, 0.04, 0.06, 0.07, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds of the step-time histogram: fine around the 80 ms frame, coarse where a tick is far too slow."""


@dataclass
class ClockStats:
    """What the clock did since the engine loaded (warm-up excluded)."""

    ticks: int = 0
    late_ticks: int = 0  # ended after the next tick was due
    missed_ticks: int = 0  # dropped because the clock fell more than a tick behind
    late_seconds_total: float = 0.0  # how far past their due time the late ticks ended, summed
    graph_ticks: int = 0  # the model ran as a captured CUDA graph
    eager_ticks: int = 0  # the model ran op by op (no graphs on this device, or graphs off)
    graph_captures: int = 0  # graphs captured on a live tick (the warm-up captures every bucket beforehand)
    frames: int = 0  # session frames produced (each a committed step of one session)
    rows: int = 0  # rows the model computed: the frames plus masked rows
    sat_out: int = 0  # session-ticks skipped for lack of credit (their rows masked, their state untouched)
    sessions: int = 0  # live sessions now
    last_batch: int = 0  # rows of the last tick
    last_frames: int = 0  # session frames of the last tick
    step_seconds_total: float = 0.0  # the model step (codec and model, output on the host)
    step_seconds_max: float = 0.0
    tick_seconds_total: float = 0.0  # the whole tick: collecting input, the step, handing out the frames
    clock_cpu_seconds_total: float = 0.0  # CPU time of the clock thread in ticks (far below tick time: it waited)
    step_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS_S) + 1))  # last: +Inf

    def observe_step(self, seconds: float) -> None:
        """Count one step's duration in the histogram and the totals."""
        self.step_seconds_total += seconds
        self.step_seconds_max = max(self.step_seconds_max, seconds)
        index = next((i for i, bound in enumerate(STEP_BUCKETS_S) if seconds <= bound), len(STEP_BUCKETS_S))
        self.step_counts[index] += 1
