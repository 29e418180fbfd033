"""Server-side counters read back from ``GET /metrics`` (Prometheus text format) while a level runs.

With ``--server-pid`` the server process's own footprint (psutil) is sampled alongside. Whatever is exposed is
kept: every sample series is summarized over the level (first, last, min, max, mean, and last - first for
counters), so new server metrics show up in reports without changes here.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from omnigate.loadtest.report import MetricSeries


def parse_metrics(text: str) -> dict[str, tuple[str, float]]:
    """Sample series of a Prometheus exposition: ``name{labels}`` -> (metric type, value)."""
    samples: dict[str, tuple[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # creation timestamps of counters and histograms, not measurements
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            samples[key] = (family.type, float(sample.value))
    return samples


def summarize_series(scrapes: list[dict[str, tuple[str, float]]]) -> list[MetricSeries]:
    """Per series, its values over the scrapes in order (series missing from some scrapes use those present)."""
    values: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for scrape in scrapes:
        for key, (kind, value) in scrape.items():
            if math.isnan(value):
                continue
            values.setdefault(key, []).append(value)
            kinds[key] = kind
    return [
        MetricSeries(
            name=key,
            kind=kinds[key],
            first=series[0],
            last=series[-1],
            min=min(series),
            max=max(series),
            mean=math.fsum(series) / len(series),
            delta=series[-1] - series[0],
        )
        for key, series in sorted(values.items())
    ]


class MetricsSampler:
    """Samples the server at a fixed interval from :meth:`run` until cancelled.

    Two sources, each optional: ``GET /metrics`` (``client`` given; the first failure stops it, recorded in
    :attr:`error`), and the server process itself when it runs on this machine (``server_pid`` given; resident
    memory, CPU time (also of the main thread, which runs the event loop), threads and open files read with psutil,
    which ``/metrics`` may not expose).
    """

    def __init__(
        self, client: httpx.AsyncClient | None, url: str, interval_s: float, server_pid: int | None = None
    ) -> None:
        self._client = client
        self._url = url
        self._interval_s = interval_s
        self._process = _open_process(server_pid) if server_pid is not None else None
        self.scrapes: list[dict[str, tuple[str, float]]] = []
        self.error: str | None = None if client is not None else "not scraped"

    async def scrape(self) -> None:
        """One sample of every source still working; failures are recorded, never raised."""
        sample: dict[str, tuple[str, float]] = {}
        if self._client is not None and self.error is None:
            try:
                response = await self._client.get(self._url)
                if response.status_code == 200:
                    sample.update(parse_metrics(response.text))
                else:
                    self.error = f"GET {self._url}: HTTP {response.status_code}"
            except (httpx.HTTPError, ValueError) as exc:
                self.error = f"GET {self._url}: {type(exc).__name__}: {exc}"
        if self._process is not None:
            # psutil reads /proc synchronously; keep it off the event loop.
            reading = await asyncio.to_thread(_read_process, self._process)
            if reading is None:
                self._process = None
            else:
                sample.update(reading)
        if sample:
            self.scrapes.append(sample)

    async def run(self, clock: Callable[[], float]) -> None:
        """Sample every interval on a fixed schedule (no drift) until cancelled."""
        next_s = clock()
        while True:
            next_s += self._interval_s
            await asyncio.sleep(max(0.0, next_s - clock()))
            await self.scrape()

    def summary(self) -> list[MetricSeries]:
        return summarize_series(self.scrapes)


def _psutil() -> Any:
    """psutil, imported on first use (it is part of the client's optional extra)."""
    import psutil  # type: ignore[import-untyped]

    return psutil


def process_exists(pid: int) -> bool:
    """Whether a process with this id runs on this machine."""
    return bool(_psutil().pid_exists(pid))


def _open_process(pid: int) -> Any:
    return _psutil().Process(pid)


def _read_process(process: Any) -> dict[str, tuple[str, float]] | None:
    """The process's footprint as metric samples, or ``None`` once it is gone."""
    try:
        with process.oneshot():
            times = process.cpu_times()
            # The main thread runs the event loop; the rest is engine and codec threads.
            main = next((t for t in process.threads() if t.id == process.pid), None)
            sample = {
                "server_process_resident_memory_bytes": ("gauge", float(process.memory_info().rss)),
                "server_process_cpu_seconds_total": ("counter", float(times.user + times.system)),
                "server_process_main_thread_cpu_seconds_total": (
                    "counter",
                    float(main.user_time + main.system_time) if main is not None else math.nan,
                ),
                "server_process_threads": ("gauge", float(process.num_threads())),
                "server_process_open_fds": ("gauge", float(process.num_fds())),
            }
    except _psutil().Error:
        return None
    return sample
