"""Is a series trending upward? The soak's verdict on memory, file descriptors, tasks and latency over time.

A series trends upward when both hold, after its warm-up samples:

- its least-squares line rises by more than ``tolerance`` across the samples, and
- every sample of its last third exceeds the median of its first third by more than half of ``tolerance``.

The first catches steady growth; the second keeps a spike or a dip from deciding alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import msgspec


class Trend(msgspec.Struct, frozen=True):
    name: str
    samples: int
    first: float | None
    last: float | None
    slope_per_sample: float
    rise: float
    """Rise of the fitted line from the first sample to the last."""
    tolerance: float
    upward: bool


def least_squares_slope(values: Sequence[float]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2.0
    mean_y = statistics.fmean(values)
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def trend(name: str, values: Sequence[float | None], tolerance: float, warm_up: int = 1) -> Trend:
    """The verdict on ``values`` (one per interval; None where nothing was measured) after ``warm_up`` samples."""
    kept = [v for v in values[warm_up:] if v is not None]
    slope = least_squares_slope(kept)
    rise = slope * (len(kept) - 1) if kept else 0.0
    upward = False
    if len(kept) >= 3:
        third = max(1, len(kept) // 3)
        early, late = statistics.median(kept[:third]), min(kept[-third:])
        upward = rise > tolerance and late - early > tolerance / 2.0
    return Trend(
        name=name,
        samples=len(kept),
        first=kept[0] if kept else None,
        last=kept[-1] if kept else None,
        slope_per_sample=slope,
        rise=rise,
        tolerance=tolerance,
        upward=upward,
    )
