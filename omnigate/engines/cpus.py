"""How many CPU cores this process may use: its affinity mask, bounded by a cgroup CPU quota (containers)."""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP = Path("/sys/fs/cgroup")


def available_cpus(cgroup_root: Path = _CGROUP) -> int:
    """Cores the process may run on: ``sched_getaffinity``, capped by a cgroup v2 ``cpu.max`` or v1 CFS quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


def _cgroup_quota(root: Path) -> int | None:
    """Whole cores of the cgroup's CPU quota (rounded up), or None when there is no quota."""
    try:
        fields = (root / "cpu.max").read_text().split()
        if len(fields) == 2 and fields[0] != "max":
            return math.ceil(int(fields[0]) / int(fields[1]))
        return None
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return math.ceil(quota / period) if quota > 0 and period > 0 else None
