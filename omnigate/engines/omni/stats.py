"""The thinker's worker loop in numbers, for ``/metrics``: totals since load, and rates over the last seconds."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class ThinkerRates:
    """Over the loops that ended in the last ``RATE_WINDOW_S`` seconds (zeros when none did)."""

    steps_per_s: float  # batched decode steps per second
    rows_per_step: float  # answers advanced per decode step
    prefill_tokens_per_step: float  # prompt tokens prefilled per worker loop that prefilled or decoded


class ThinkerStats:
    """Counted by the worker thread, read by scrapes from any thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, window_s: float = RATE_WINDOW_S) -> None:
        self._clock = clock
        self._window_s = window_s
        self._lock = threading.Lock()
        self._loops: deque[tuple[float, int, int]] = deque(maxlen=4096)  # (ended at, decode rows, prefill tokens)
        self.steps = 0
        self.decode_rows = 0
        self.prefill_tokens = 0
        self.prefill_forwards = 0  # forwards that prefilled one or more prompts
        self.prefilled_prompts = 0
        self.padded_steps = 0  # decode steps padded to a batch bucket (replayed from a captured graph on CUDA)

    def record_loop(self, rows: int, prefill_tokens: int, prompts: int, *, padded: bool) -> None:
        """One worker loop: ``rows`` answers advanced by one decode step (0: none), ``prefill_tokens`` of ``prompts``
        prompts prefilled in one forward (0: none)."""
        with self._lock:
            if rows:
                self.steps += 1
                self.decode_rows += rows
                self.padded_steps += int(padded)
            if prompts:
                self.prefill_forwards += 1
                self.prefilled_prompts += prompts
                self.prefill_tokens += prefill_tokens
            self._loops.append((self._clock(), rows, prefill_tokens))

    def rates(self) -> ThinkerRates:
        """Rates over the recent window."""
        now = self._clock()
        with self._lock:
            recent = [(rows, tokens) for ended, rows, tokens in self._loops if now - ended <= self._window_s]
        steps = sum(1 for rows, _ in recent if rows)
        return ThinkerRates(
            steps_per_s=steps / self._window_s,
            rows_per_step=sum(rows for rows, _ in recent) / steps if steps else 0.0,
            prefill_tokens_per_step=sum(tokens for _, tokens in recent) / len(recent) if recent else 0.0,
        )
