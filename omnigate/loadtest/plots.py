"""PNG plots of a report: TTFA CDF, TTFA and underruns against load, throughput per second.

matplotlib is imported only here and only when plots are asked for (it is an optional extra of the client).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from omnigate.loadtest.arrivals import ClosedLoop, arrival_label
from omnigate.loadtest.report import LevelReport, LoadTestReport


def _label(level: LevelReport) -> str:
    round_part = "" if level.round is None else f" r{level.round + 1}"
    return f"{level.target.label} @ {arrival_label(level.arrival)}{round_part}"


def _load_value(level: LevelReport) -> float:
    arrival = level.arrival
    return float(arrival.sessions) if isinstance(arrival, ClosedLoop) else arrival.rate


def _ttfa_values(level: LevelReport) -> list[float]:
    return sorted(
        utterance.ttfa_ms
        for session in level.session_records
        for utterance in session.utterances
        if utterance.status == "completed" and utterance.ttfa_ms is not None
    )


def write_plots(report: LoadTestReport, directory: Path) -> list[Path]:
    """Write the plots into ``directory`` (created if needed); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    levels = report.levels
    if report.compare is not None:
        levels = [side for level in report.compare.levels for side in (level.a, level.b)]
    written = [
        _ttfa_cdf(plt, levels, directory / "ttfa_cdf.png"),
        _against_load(plt, levels, directory / "ttfa_underruns_vs_load.png"),
        _throughput(plt, report.levels, directory / "throughput.png"),
    ]
    return written


def _ttfa_cdf(plt: Any, levels: list[LevelReport], path: Path) -> Path:
    figure, axes = plt.subplots(figsize=(8, 5))
    for level in levels:
        values = _ttfa_values(level)
        if values:
            fractions = [(index + 1) / len(values) for index in range(len(values))]
            axes.step(values, fractions, where="post", label=f"{_label(level)} (n={len(values)})")
    axes.set_xlabel("time to first audio (ms)")
    axes.set_ylabel("fraction of utterances")
    axes.set_title("TTFA CDF")
    axes.set_ylim(0, 1.01)
    axes.grid(True, alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _against_load(plt: Any, levels: list[LevelReport], path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    by_target: dict[str, list[LevelReport]] = defaultdict(list)
    for level in levels:
        by_target[level.target.label].append(level)
    figure, (latency, underruns) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for label, target_levels in by_target.items():
        target_levels.sort(key=_load_value)
        loads = [_load_value(level) for level in target_levels]
        latency.plot(loads, [level.ttfa_ms.p50 for level in target_levels], marker="o", label=f"{label} p50")
        latency.plot(loads, [level.ttfa_ms.p99 for level in target_levels], marker="s", label=f"{label} p99")
        underruns.plot(loads, [level.underruns for level in target_levels], marker="o", label=label)
    loads = sorted({_load_value(level) for level in levels})
    if loads and loads[0] > 0 and loads[-1] / loads[0] >= 8:
        underruns.set_xscale("log", base=2)
    underruns.set_ylim(0, max(1.0, 1.1 * max((level.underruns for level in levels), default=0)))
    underruns.yaxis.set_major_locator(MaxNLocator(integer=True))
    closed = all(isinstance(level.arrival, ClosedLoop) for level in levels)
    underruns.set_xlabel("concurrent sessions" if closed else "arrival rate (sessions/s)")
    latency.set_ylabel("TTFA (ms)")
    underruns.set_ylabel("underruns")
    latency.set_title("TTFA and underruns against load")
    for axes in (latency, underruns):
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _throughput(plt: Any, levels: list[LevelReport], path: Path) -> Path:
    figure, (audio, active) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for level in levels:
        seconds = [point.second for point in level.throughput]
        audio.plot(seconds, [point.audio_s for point in level.throughput], label=_label(level))
        active.plot(seconds, [point.mean_active_sessions for point in level.throughput], label=_label(level))
    audio.set_ylabel("audio received (s per s)")
    active.set_ylabel("sessions open (mean)")
    active.set_xlabel("second of the level")
    audio.set_title("Throughput per second")
    for axes in (audio, active):
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0] and len(levels) <= 12:
            axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
