"""Capacity search: the largest concurrency that still meets the SLO. Sans-I/O.

The search doubles the level until one fails (or the ceiling is reached), then bisects between the last level
that passed and the first that failed until the bracket is within the tolerance. It assumes that passing is
monotonic in the level, which holds up to measurement noise.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import msgspec


class CapacityResult(msgspec.Struct, frozen=True):
    """``capacity`` is the largest level that passed (0 when none did); ``first_failure`` the smallest that failed."""

    capacity: int
    first_failure: int | None
    ceiling_reached: bool
    tried: list[tuple[int, bool]]


class CapacitySearch:
    """Drive with :meth:`next_level` and :meth:`record` until :meth:`next_level` returns ``None``."""

    def __init__(self, max_level: int, start: int = 1, tolerance: float = 0.0) -> None:
        if start < 1 or max_level < start:
            raise ValueError("need 1 <= start <= max_level")
        if tolerance < 0:
            raise ValueError("tolerance must be >= 0")
        self._max = max_level
        self._start = start
        self._tolerance = tolerance
        self._passed: int | None = None
        self._failed: int | None = None
        self._tried: list[tuple[int, bool]] = []

    def next_level(self) -> int | None:
        """The next level to measure, or ``None`` when the search is over."""
        if not self._tried:
            return self._start
        if self._failed is None:
            assert self._passed is not None
            if self._passed >= self._max:
                return None
            return min(self._passed * 2, self._max)
        low = self._passed if self._passed is not None else 0
        if self._failed - low <= max(1, math.floor(low * self._tolerance)):
            return None
        return (low + self._failed) // 2 if low > 0 else self._bisect_below_start()

    def record(self, level: int, passed: bool) -> None:
        """Record the outcome of measuring ``level``."""
        self._tried.append((level, passed))
        if passed:
            self._passed = max(self._passed or 0, level)
        else:
            self._failed = level if self._failed is None else min(self._failed, level)

    def result(self) -> CapacityResult:
        capacity = self._passed or 0
        return CapacityResult(
            capacity=capacity,
            first_failure=self._failed,
            ceiling_reached=self._failed is None and capacity >= self._max,
            tried=list(self._tried),
        )

    def _bisect_below_start(self) -> int | None:
        # Nothing has passed yet: search down towards level 1.
        assert self._failed is not None
        if self._failed <= 1:
            return None
        return max(1, self._failed // 2)


async def search_capacity(
    measure: Callable[[int], Awaitable[bool]], max_level: int, start: int = 1, tolerance: float = 0.0
) -> CapacityResult:
    """Run a :class:`CapacitySearch`, measuring each level with ``measure(level) -> passed``."""
    search = CapacitySearch(max_level=max_level, start=start, tolerance=tolerance)
    while (level := search.next_level()) is not None:
        search.record(level, await measure(level))
    return search.result()
