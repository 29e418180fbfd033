"""Runs measured levels: sessions started by an arrival model against a target, metrics scraped alongside.

:class:`LevelRun` is one level; :func:`run_levels`, :func:`run_capacity_search` and :func:`run_comparison` are the
three ways the CLI strings levels together.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
import msgspec

from omnigate.loadtest.arrivals import ArrivalModel, ClosedLoop, OpenLoop, arrival_label, poisson_arrivals
from omnigate.loadtest.capacity import search_capacity
from omnigate.loadtest.corpus import pick_texts
from omnigate.loadtest.metrics import MetricsSampler
from omnigate.loadtest.report import (
    CapacityReport,
    CompareLevel,
    CompareReport,
    LevelReport,
    LevelTraces,
    comparison_ratios,
    summarize_level,
)
from omnigate.loadtest.targets.base import Target
from omnigate.loadtest.traces import SessionTrace

# After a failed session a closed-loop worker pauses briefly, so a refusing server is not hammered in a tight loop.
_FAILURE_PAUSE_S = 0.5


class LevelSettings(msgspec.Struct, frozen=True):
    """Everything about a level except the target and the arrival model."""

    duration_s: float
    warmup_s: float
    drain_s: float
    seed: int
    utterances_per_session: int
    jitter_ms: float
    slo_ttfa_ms: float
    metrics_interval_s: float
    scrape_metrics: bool = True
    """Read ``GET /metrics`` of the target server."""
    server_pid: int | None = None
    """Sample this local process's memory and CPU (the server, when it runs on this machine)."""


class LevelRun:
    """One level in progress. The progress display reads :attr:`traces` while it runs."""

    def __init__(
        self,
        target: Target,
        arrival: ArrivalModel,
        settings: LevelSettings,
        corpus: Sequence[str],
        round_index: int | None = None,
    ) -> None:
        self.target = target
        self.arrival = arrival
        self.settings = settings
        self.corpus = corpus
        self.round_index = round_index
        self.traces: list[SessionTrace] = []
        self.start_s = time.perf_counter()
        self.stop_s = self.start_s + settings.duration_s
        self._session_ids = itertools.count()

    @property
    def label(self) -> str:
        load = arrival_label(self.arrival)
        if isinstance(self.arrival, ClosedLoop):
            load += " sessions"
        round_part = "" if self.round_index is None else f" round {self.round_index + 1}"
        return f"{self.target.spec.label}: {load}{round_part}"

    async def run(self, metrics_client: httpx.AsyncClient | None) -> tuple[LevelReport, LevelTraces]:
        """Run the level to the end of its drain time and summarize it."""
        settings = self.settings
        sampler = None
        if settings.scrape_metrics and metrics_client is None:
            raise ValueError("scrape_metrics needs a metrics client")
        if settings.scrape_metrics or settings.server_pid is not None:
            sampler = MetricsSampler(
                metrics_client if settings.scrape_metrics else None,
                self.target.metrics_url(),
                settings.metrics_interval_s,
                settings.server_pid,
            )
            await sampler.scrape()
        # A full collection over everything imported so far pauses this loop for a noticeable time, which would
        # show up as the server's latency: keep what exists now out of the collector's walks for the level.
        gc.collect()
        gc.freeze()
        cpu_start_s = time.process_time()
        self.start_s = time.perf_counter()
        self.stop_s = self.start_s + self.settings.duration_s
        sampling = asyncio.create_task(sampler.run(time.perf_counter)) if sampler is not None else None
        try:
            if isinstance(self.arrival, ClosedLoop):
                await self._closed_loop(self.arrival)
            else:
                await self._open_loop(self.arrival)
        finally:
            if sampling is not None:
                sampling.cancel()
                await asyncio.gather(sampling, return_exceptions=True)
        wall_s = time.perf_counter() - self.start_s
        cpu_percent = (time.process_time() - cpu_start_s) / wall_s * 100.0 if wall_s > 0 else None
        if sampler is not None:
            await sampler.scrape()
        run = LevelTraces(self.traces, self.start_s, wall_s)
        report = summarize_level(
            [run],
            target=self.target.spec,
            arrival=self.arrival,
            round_index=self.round_index,
            duration_s=self.settings.duration_s,
            warmup_s=self.settings.warmup_s,
            jitter_ms=self.settings.jitter_ms,
            slo_ttfa_ms=self.settings.slo_ttfa_ms,
            client_cpu_percent=cpu_percent,
            server_metrics=sampler.summary() if sampler is not None else [],
            metrics_error=sampler.error if sampler is not None else None,
        )
        return report, run

    async def _closed_loop(self, arrival: ClosedLoop) -> None:
        workers = [asyncio.create_task(self._worker(offset)) for offset in arrival.start_offsets()]
        await self._finish(workers, self.stop_s + self.settings.drain_s)

    async def _worker(self, offset_s: float) -> None:
        await asyncio.sleep(max(0.0, self.start_s + offset_s - time.perf_counter()))
        while time.perf_counter() < self.stop_s:
            trace = await self._session()
            if trace.status == "failed":
                await asyncio.sleep(_FAILURE_PAUSE_S)

    async def _open_loop(self, arrival: OpenLoop) -> None:
        in_flight: set[asyncio.Task[SessionTrace]] = set()
        arrivals = poisson_arrivals(arrival.rate, self.settings.duration_s, self.settings.seed)
        for offset_s in arrivals:
            await asyncio.sleep(max(0.0, self.start_s + offset_s - time.perf_counter()))
            if len(in_flight) >= arrival.max_in_flight:
                trace = self._new_trace()
                trace.error("client_overflow")
                trace.end(time.perf_counter())
                continue
            task = asyncio.create_task(self._session())
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        await self._finish(list(in_flight), self.stop_s + self.settings.drain_s)

    async def _finish(self, tasks: Sequence[asyncio.Task[Any]], deadline_s: float) -> None:
        """Let the tasks end on their own until ``deadline_s``, then cut them off."""
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline_s - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _new_trace(self) -> SessionTrace:
        trace = SessionTrace(next(self._session_ids), time.perf_counter())
        # Sessions finish the utterance in flight when the level stops; the drain is for that, not for more.
        trace.last_utterance_start_s = self.stop_s
        self.traces.append(trace)
        return trace

    async def _session(self) -> SessionTrace:
        trace = self._new_trace()
        texts = pick_texts(self.corpus, self.settings.utterances_per_session, self.settings.seed, trace.session_id)
        try:
            await self.target.run_session(texts, trace)
        except asyncio.CancelledError:
            trace.cut_off(time.perf_counter())
            raise
        except Exception as exc:  # a client bug must not stop the run; it is reported by type
            trace.error(f"client_{type(exc).__name__}", str(exc))
        trace.end(time.perf_counter())
        return trace


LevelObserver = Callable[[LevelRun], Awaitable[tuple[LevelReport, LevelTraces]]]
"""Runs a level, typically while showing its progress; given the level, returns what ``LevelRun.run`` returns."""


async def run_levels(
    target: Target, arrivals: Sequence[ArrivalModel], settings: LevelSettings, corpus: Sequence[str], run: LevelObserver
) -> list[LevelReport]:
    """Measure each arrival model in turn."""
    reports = []
    for arrival in arrivals:
        report, _ = await run(LevelRun(target, arrival, settings, corpus))
        reports.append(report)
    return reports


async def run_capacity_search(
    target: Target,
    settings: LevelSettings,
    corpus: Sequence[str],
    run: LevelObserver,
    *,
    max_sessions: int,
    tolerance: float,
    ramp_s: float,
) -> tuple[CapacityReport, list[LevelReport]]:
    """Search the largest closed-loop concurrency whose level meets the SLO."""
    reports: list[LevelReport] = []

    async def measure(sessions: int) -> bool:
        report, _ = await run(LevelRun(target, ClosedLoop(sessions=sessions, ramp_s=ramp_s), settings, corpus))
        reports.append(report)
        return report.slo.passed

    result = await search_capacity(measure, max_level=max_sessions, tolerance=tolerance)
    capacity = CapacityReport(
        target=target.spec, slo_ttfa_ms=settings.slo_ttfa_ms, level_duration_s=settings.duration_s, result=result
    )
    return capacity, reports


async def run_comparison(
    a: Target,
    b: Target,
    arrivals: Sequence[ArrivalModel],
    settings: LevelSettings,
    corpus: Sequence[str],
    run: LevelObserver,
    *,
    rounds: int,
) -> tuple[CompareReport, list[LevelReport]]:
    """Measure A and B alternately (A B, then B A, ...) at each arrival model; pool the rounds and take ratios."""
    per_round: list[LevelReport] = []
    levels: list[CompareLevel] = []
    for arrival in arrivals:
        runs: dict[str, list[tuple[LevelReport, LevelTraces]]] = {"a": [], "b": []}
        for round_index in range(rounds):
            order = (("a", a), ("b", b)) if round_index % 2 == 0 else (("b", b), ("a", a))
            for side, target in order:
                outcome = await run(LevelRun(target, arrival, settings, corpus, round_index))
                runs[side].append(outcome)
                per_round.append(outcome[0])
        pooled = {side: _pool(outcomes, settings) for side, outcomes in runs.items()}
        levels.append(
            CompareLevel(
                arrival=arrival,
                a=pooled["a"],
                b=pooled["b"],
                ratios=comparison_ratios(pooled["a"], pooled["b"]),
                round_ratios=[comparison_ratios(ra, rb) for (ra, _), (rb, _) in zip(runs["a"], runs["b"], strict=True)],
            )
        )
    return CompareReport(a=a.spec, b=b.spec, rounds=rounds, levels=levels), per_round


def _pool(outcomes: Sequence[tuple[LevelReport, LevelTraces]], settings: LevelSettings) -> LevelReport:
    first = outcomes[0][0]
    cpu = [report.client_cpu_percent for report, _ in outcomes if report.client_cpu_percent is not None]
    return summarize_level(
        [traces for _, traces in outcomes],
        target=first.target,
        arrival=first.arrival,
        round_index=None,
        duration_s=sum(report.duration_s for report, _ in outcomes),
        warmup_s=settings.warmup_s,
        jitter_ms=settings.jitter_ms,
        slo_ttfa_ms=settings.slo_ttfa_ms,
        client_cpu_percent=sum(cpu) / len(cpu) if cpu else None,
        server_metrics=[],
        metrics_error=None,
    )
