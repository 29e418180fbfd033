"""A server's resource footprint, read from its ``/metrics``: live sessions, engine streams, event-loop tasks, open
file descriptors and resident memory. Works for a server in another process or on another machine."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families


class Footprint(msgspec.Struct, frozen=True):
    sessions: int
    engine_streams: int
    tasks: int
    open_fds: int
    rss_bytes: int

    @property
    def rss_mib(self) -> float:
        return self.rss_bytes / (1024 * 1024)

    def describe(self) -> str:
        return (
            f"sessions={self.sessions} engine_streams={self.engine_streams} tasks={self.tasks} "
            f"fds={self.open_fds} rss={self.rss_mib:.1f} MiB"
        )


class FootprintUnavailable(Exception):
    """``/metrics`` is unreachable or lacks a series the footprint needs."""


def parse_footprint(text: str) -> Footprint:
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    try:
        return Footprint(
            sessions=int(totals.get("omnigate_sessions_active", 0.0)),
            engine_streams=int(totals.get("omnigate_engine_streams_active", 0.0)),
            tasks=int(totals["omnigate_event_loop_tasks"]),
            open_fds=int(totals["process_open_fds"]),
            rss_bytes=int(totals["process_resident_memory_bytes"]),
        )
    except KeyError as exc:
        raise FootprintUnavailable(f"/metrics has no {exc.args[0]}") from None


async def read_footprint(metrics_url: str, headers: dict[str, str] | None = None) -> Footprint:
    """One reading, on a fresh connection (a kept-alive one would itself be part of the footprint)."""
    async with httpx.AsyncClient(timeout=10.0, trust_env=False, headers=headers) as client:
        try:
            response = await client.get(metrics_url)
        except httpx.HTTPError as exc:
            raise FootprintUnavailable(f"GET {metrics_url}: {exc}") from None
    if response.status_code != 200:
        raise FootprintUnavailable(f"GET {metrics_url}: HTTP {response.status_code}")
    return parse_footprint(response.text)


async def settled_footprint(
    metrics_url: str, limit_s: float = 30.0, headers: dict[str, str] | None = None
) -> Footprint:
    """The footprint once the server holds no session and no engine stream. Raises TimeoutError after ``limit_s``:
    a server that never gets there leaks sessions or streams."""
    async with asyncio.timeout(limit_s):
        while True:
            footprint = await read_footprint(metrics_url, headers)
            if footprint.sessions == 0 and footprint.engine_streams == 0:
                return footprint
            await asyncio.sleep(0.1)
