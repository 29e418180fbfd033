"""One row per level of a ``benchmarks/realtime_server_gpu.sh`` run: ``summary.json`` and ``summary.md`` in its folder.

Usage: ``python -m benchmarks.realtime_server_summary OUT_DIR``. A level measured by several client processes
(``webrtc_N_0.json``, ``webrtc_N_1.json`` ...) is pooled from their per-session records and judged as one; the reply
gap of such a level is the median of the clients' gap p50s and the largest of their p99s. Server CPU, threads and
engine figures come from the client process that sampled the server (the first).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.talker_gpu import pooled_level, server_side
from omnigate.loadtest.report import LoadTestReport

_FILE = re.compile(r"(realtime|webrtc)_(\d+)(?:_(\d+))?\.json")


def level_files(out: Path) -> dict[tuple[str, int], list[Path]]:
    """Report files by (target, sessions), the sampling client first."""
    found: dict[tuple[str, int], list[tuple[int, Path]]] = {}
    for path in out.iterdir():
        match = _FILE.fullmatch(path.name)
        if match:
            key = ("realtime" if match[1] == "realtime" else "realtime-webrtc", int(match[2]))
            found.setdefault(key, []).append((int(match[3] or 0), path))
    return {key: [path for _, path in sorted(paths)] for key, paths in sorted(found.items(), key=lambda kv: kv[0])}


def summarize(target: str, sessions: int, reports: list[LoadTestReport]) -> dict[str, Any]:
    levels = [report.levels[0] for report in reports]
    pooled = pooled_level(levels, reports[0].settings.slo_ttfa_ms)
    sampled = levels[0]
    threads = next((m for m in sampled.server_metrics if m.name == "server_process_threads"), None)
    gaps = [level.gap_ms for level in levels if level.gap_ms.count]
    return {
        "target": target,
        "sessions": sessions,
        "client_processes": len(levels),
        **pooled,
        "reply_gap_ms": {
            "p50": statistics.median(gap.p50 for gap in gaps) if gaps else None,
            "p99": max(gap.p99 for gap in gaps) if gaps else None,
        },
        "server_threads": None if threads is None else {"first": threads.first, "last": threads.last},
        "server_side": server_side(msgspec.to_builtins(sampled.server_metrics), sampled.wall_s),
        "wall_s": max(level.wall_s for level in levels),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| target | sessions | reply gap p50 | RTF p50 | TTFA p50 / p99 | utterances with underruns | underruns "
        "| errors | server CPU | server threads (first → last) | SLO |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        utterances = row["utterances"]
        threads = row["server_threads"]
        lines.append(
            f"| {row['target']} | {row['sessions']} | {_num(row['reply_gap_ms']['p50'], ' ms')} "
            f"| {_num(row['rtf']['p50'], '', 3)} "
            f"| {_num(row['ttfa_ms']['p50'], '')} / {_num(row['ttfa_ms']['p99'], ' ms')} "
            f"| {utterances['with_underruns']} of {utterances['completed']} | {row['underruns']} "
            f"| {sum(row['errors'].values())} | {_num(row['server_side']['server_cpu_cores'], ' cores', 2)} "
            f"| {_threads(threads)} "
            f"| {'pass' if row['passed'] else 'fail: ' + '; '.join(row['reasons'])} |"
        )
    return "\n".join(lines) + "\n"


def _threads(threads: dict[str, float] | None) -> str:
    return "-" if threads is None else f"{threads['first']:.0f} → {threads['last']:.0f}"


def _num(value: float | None, unit: str, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def main(out: Path) -> None:
    rows = []
    for (target, sessions), paths in level_files(out).items():
        reports = [msgspec.json.decode(path.read_bytes(), type=LoadTestReport) for path in paths]
        rows.append(summarize(target, sessions, reports))
    rows.sort(key=lambda row: (row["target"] != "realtime", row["sessions"]))
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = markdown(rows)
    (out / "summary.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
