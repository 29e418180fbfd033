"""Counts of an engine pool's steps that can cross a process boundary: a step-time and a batch-size histogram as
plain bucket counts, and the fraction of recent wall time the pool spent stepping. Sans-I/O: callers pass the time.

The engine core keeps these for its pool and sends them with its stats, so a gateway process reports the core's
steps on ``/metrics`` under the same names as an in-process pool's.
"""

from __future__ import annotations

from collections import deque

STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds of the engine step-time histogram (``omnigate_engine_step_duration_seconds``)."""
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Upper bounds of the engine batch-size histogram (``omnigate_engine_batch_size``)."""


def _index(bounds: tuple[float, ...], value: float) -> int:
    return next((i for i, bound in enumerate(bounds) if value <= bound), len(bounds))


class StepCounts:
    """The pool's steps as histogram bucket counts (the last bucket is +Inf). One writer: the pool's step observer
    (with one worker, one thread); a reader may see one step half counted, which a histogram scrape tolerates."""

    def __init__(self) -> None:
        self.step_counts = [0] * (len(STEP_BUCKETS_S) + 1)
        self.step_seconds_total = 0.0
        self.batch_counts = [0] * (len(BATCH_BUCKETS) + 1)
        self.batch_total = 0

    def observe(self, seconds: float, batch_size: int) -> None:
        """The pool's step observer: one step of ``batch_size`` streams took ``seconds``."""
        self.step_counts[_index(STEP_BUCKETS_S, seconds)] += 1
        self.step_seconds_total += seconds
        self.batch_counts[_index(BATCH_BUCKETS, batch_size)] += 1
        self.batch_total += batch_size


class BusyWindow:
    """The fraction of the last ``window_s`` of wall time the pool's workers spent stepping, from samples of its
    cumulative step seconds (taken whenever someone asks: the gateways' stats calls, several a second)."""

    def __init__(self, window_s: float = 5.0, workers: int = 1) -> None:
        self._window_s = window_s
        self._workers = max(1, workers)
        self._samples: deque[tuple[float, float]] = deque()

    def sample(self, now: float, step_seconds_total: float) -> float:
        """Record the total at ``now``; the busy fraction over the window (0 until two samples exist)."""
        self._samples.append((now, step_seconds_total))
        # keep one sample at or before the window's start, so the fraction covers the whole window
        while len(self._samples) > 2 and self._samples[1][0] <= now - self._window_s:
            self._samples.popleft()
        then, busy_then = self._samples[0]
        if now <= then:
            return 0.0
        return min(1.0, max(0.0, (step_seconds_total - busy_then) / (now - then) / self._workers))
