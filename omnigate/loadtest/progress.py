"""What the operator sees: a live view of the level in progress, and summary tables at the end (rich)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from omnigate.loadtest.arrivals import arrival_label
from omnigate.loadtest.report import CapacityReport, CompareReport, LevelReport, LevelTraces
from omnigate.loadtest.runner import LevelRun
from omnigate.loadtest.stats import distribution
from omnigate.loadtest.traces import UtteranceTrace

_REFRESH_S = 0.5


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


class ProgressDisplay:
    """Runs levels while refreshing a live view of the one in progress (when enabled)."""

    def __init__(self, console: Console, live: bool, jitter_ms: float) -> None:
        self._console = console
        self._live = live
        self._jitter_ms = jitter_ms
        # Replaying an utterance through the player is done once, when it completes.
        self._played: dict[int, tuple[float | None, int]] = {}

    async def observe(
        self, level: LevelRun, metrics_client: httpx.AsyncClient | None
    ) -> tuple[LevelReport, LevelTraces]:
        """Run ``level``, showing its progress, then print a one-line result."""
        self._played.clear()
        if not self._live:
            outcome = await level.run(metrics_client)
        else:
            running = asyncio.create_task(level.run(metrics_client))
            with Live(self._render(level), console=self._console, auto_refresh=False, transient=True) as live:
                while not running.done():
                    await asyncio.wait({running}, timeout=_REFRESH_S)
                    live.update(self._render(level), refresh=True)
            outcome = running.result()
        self._console.print(level_line(level.label, outcome[0]))
        return outcome

    def _render(self, level: LevelRun) -> Table:
        now_s = time.perf_counter()
        traces = list(level.traces)
        status = Counter(trace.status for trace in traces)
        errors: Counter[str] = Counter()
        ttfa: list[float] = []
        underruns = 0
        audio_ms = 0.0
        for trace in traces:
            errors.update(trace.errors)
            for utterance in trace.utterances:
                audio_ms += sum(ms for _, ms, _ in utterance.arrivals)
                if utterance.status != "completed":
                    continue
                first_ttfa, utterance_underruns = self._replay(utterance)
                if first_ttfa is not None:
                    ttfa.append(first_ttfa)
                underruns += utterance_underruns
        summary = distribution(ttfa)
        elapsed_s = now_s - level.start_s
        phase = "warm-up" if elapsed_s < level.settings.warmup_s else "measuring"
        if now_s > level.stop_s:
            phase = "draining"
        table = Table(title=level.label, show_header=True, title_justify="left")
        for column in ("phase", "elapsed", "active", "done", "failed", "TTFA p50/p99 ms", "underruns", "audio s"):
            table.add_column(column, justify="right")
        table.add_row(
            phase,
            f"{elapsed_s:.0f}/{level.settings.duration_s:.0f} s",
            str(status["running"]),
            str(status["completed"]),
            str(status["failed"]),
            f"{_ms(summary.p50)} / {_ms(summary.p99)}",
            str(underruns),
            f"{audio_ms / 1000.0:.1f}",
        )
        if errors:
            table.caption = "errors: " + ", ".join(f"{code} {count}" for code, count in errors.most_common(5))
        return table

    def _replay(self, utterance: UtteranceTrace) -> tuple[float | None, int]:
        known = self._played.get(id(utterance))
        if known is None:
            known = (utterance.ttfa_ms(), utterance.play(self._jitter_ms).underruns)
            self._played[id(utterance)] = known
        return known


def level_line(label: str, report: LevelReport) -> Text:
    """One line per finished level."""
    verdict = ("SLO met", "green") if report.slo.passed else ("SLO missed: " + "; ".join(report.slo.reasons), "red")
    line = Text(f"{label}: ")
    line.append(
        f"{report.utterances.completed} utterances, TTFA p50 {_ms(report.ttfa_ms.p50)} ms "
        f"p99 {_ms(report.ttfa_ms.p99)} ms, {report.underruns} underruns, "
        f"{sum(report.errors.values())} errors. "
    )
    line.append(verdict[0], style=verdict[1])
    return line


def summary_table(levels: list[LevelReport]) -> Table:
    """Every measured level, one row each."""
    table = Table(title="omnigate-loadtest summary", title_justify="left")
    columns = (
        "level",
        "sessions ok/fail/cut",
        "utt",
        "TTFA p50/p90/p99 ms",
        "gap p99 ms",
        "underruns (utt)",
        "stall ms",
        "RTF p50",
        "audio s",
        "CPU %",
        "errors",
        "SLO",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("level", "errors") else "right")
    for level in levels:
        load = arrival_label(level.arrival)
        if level.round is not None:
            load += f" r{level.round + 1}"
        s = level.sessions
        ttfa = level.ttfa_ms
        table.add_row(
            f"{level.target.label} @ {load}",
            f"{s.completed}/{s.failed}/{s.cut_off}",
            str(level.utterances.completed),
            f"{_ms(ttfa.p50)}/{_ms(ttfa.p90)}/{_ms(ttfa.p99)}",
            _ms(level.gap_ms.p99),
            f"{level.underruns} ({level.utterances.with_underruns})",
            f"{level.stalled_ms:.0f}",
            _ratio(level.rtf.p50),
            f"{level.audio_s:.1f}",
            _ms(level.client_cpu_percent),
            ", ".join(f"{code} {count}" for code, count in sorted(level.errors.items())) or "-",
            "pass" if level.slo.passed else "fail",
        )
    return table


def negotiated_text(levels: list[LevelReport]) -> Text:
    """What the server answered on each level: extensions, formats, content types, with the sessions per answer."""
    text = Text("negotiated", style="bold")
    for level in levels:
        load = arrival_label(level.arrival) + ("" if level.round is None else f" r{level.round + 1}")
        answers = "; ".join(
            f"{key} " + ", ".join(f"{value} ({count})" for value, count in values.items())
            for key, values in level.negotiated.items()
        )
        text.append(f"\n  {level.target.label} @ {load}: {answers or 'nothing recorded'}")
    return text


def turn_steps_text(levels: list[LevelReport]) -> Text | None:
    """Conversational turns step by step (p50 / p95 ms), for levels that measured them (realtime talk mode)."""
    measured = [level for level in levels if level.turn_steps_ms]
    if not measured:
        return None
    text = Text("turns step by step, ms (p50 / p95)", style="bold")
    for level in measured:
        load = arrival_label(level.arrival) + ("" if level.round is None else f" r{level.round + 1}")
        steps = ", ".join(
            f"{step} {_ms(d.p50)} / {_ms(d.p95)}" for step, d in level.turn_steps_ms.items() if d.p50 is not None
        )
        text.append(f"\n  {level.target.label} @ {load}: {steps}")
    return text


def capacity_text(capacity: CapacityReport) -> Text:
    result = capacity.result
    text = Text(f"Capacity of {capacity.target.label}: ", style="bold")
    text.append(f"{result.capacity} concurrent sessions", style="bold green" if result.capacity else "bold red")
    tried = ", ".join(f"{level} {'pass' if passed else 'fail'}" for level, passed in result.tried)
    text.append(f" (zero underruns, zero errors, p99 TTFA < {capacity.slo_ttfa_ms:g} ms; levels tried: {tried}")
    if result.ceiling_reached:
        text.append("; the ceiling was reached, raise --max-sessions to search further")
    text.append(")")
    return text


def compare_table(compare: CompareReport) -> Group:
    """Ratios B / A per level, pooled over the rounds."""
    table = Table(
        title=f"B / A ratios over {compare.rounds} alternating rounds (A = {compare.a.label}, B = {compare.b.label})",
        title_justify="left",
    )
    metrics = ("ttfa_p50", "ttfa_p99", "gap_p99", "rtf_p50", "underruns", "audio_s_per_wall_s", "client_cpu_percent")
    table.add_column("load")
    for metric in metrics:
        table.add_column(metric, justify="right")
    for level in compare.levels:
        table.add_row(arrival_label(level.arrival), *(_ratio(level.ratios.get(metric)) for metric in metrics))
    absolute = Table(title="pooled absolute values", title_justify="left")
    for column in ("load", "side", "utterances", "TTFA p50", "p99 ms", "underruns", "errors"):
        absolute.add_column(column, justify="right")
    for level in compare.levels:
        for side, report in (("A", level.a), ("B", level.b)):
            absolute.add_row(
                arrival_label(level.arrival),
                side,
                str(report.utterances.completed),
                _ms(report.ttfa_ms.p50),
                _ms(report.ttfa_ms.p99),
                str(report.underruns),
                str(sum(report.errors.values())),
            )
    return Group(table, absolute)
