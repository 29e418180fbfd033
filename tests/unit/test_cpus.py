"""Cores available to the process: the affinity mask bounded by a cgroup quota."""

from __future__ import annotations

import os
from pathlib import Path

from omnigate.engines.cpus import available_cpus


def test_a_cgroup_v2_quota_bounds_the_cores(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert available_cpus(tmp_path) == min(2, len(os.sched_getaffinity(0)))


def test_no_quota_leaves_the_affinity_mask(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert available_cpus(tmp_path) == len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path / "missing") == len(os.sched_getaffinity(0))


def test_a_cgroup_v1_quota_bounds_the_cores(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert available_cpus(tmp_path) == 1
