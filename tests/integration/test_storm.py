"""Abort and disconnect storms against every CPU engine, with leak checks.

A warm-up storm first (allocator pools, codec and engine caches fill), then the measured storm; afterwards the
server must hold zero sessions and zero engine streams, and no more event-loop tasks or file descriptors than before
it. Resident memory is printed with the other numbers and bounded loosely: the server shares this process with the
clients, and onnxruntime's memory arena (piper) grows to the peak concurrent synthesis it has seen and keeps it
(``docs/reliability/results.md`` shows that it is the arena, not session state). The big storms are
``benchmarks/storm.py``.
"""

from __future__ import annotations

import pytest

from omnigate.engines.base import Engine
from omnigate.gateway.settings import Settings
from omnigate.loadtest.footprint import Footprint, settled_footprint
from omnigate.loadtest.storm import StormResult, run_storm
from tests.serving import serve

pytestmark = pytest.mark.slow

# The test process also runs the clients, so a few descriptors (a resolver, a pooled socket) may differ.
FD_SLACK = 4
MIB = 1024 * 1024
# The server runs in the test process, so RSS is the process's. The piper engine runs without onnxruntime's arena and
# trims glibc's heaps every few calls, so what a storm leaves behind shows here rather than hiding in allocator heaps;
# the warm-up storm has already grown the heaps to what the longest piece needs.
RSS_BOUND_BYTES = {"synthetic": 48 * MIB, "piper": 96 * MIB}


def report(
    capsys: pytest.CaptureFixture[str], name: str, result: StormResult, before: Footprint, after: Footprint
) -> None:
    with capsys.disabled():
        print(
            f"\nstorm {name}: {result.sessions} sessions {result.by_pattern}, unexpected {result.unexpected}, "
            f"late cancels {result.late_cancels}\n"
            f"  before: {before.describe()}\n  after:  {after.describe()}\n"
            f"  growth: tasks {after.tasks - before.tasks:+d}, fds {after.open_fds - before.open_fds:+d}, "
            f"rss {after.rss_mib - before.rss_mib:+.1f} MiB"
        )


@pytest.mark.parametrize(("engine_name", "sessions", "concurrency"), [("synthetic", 400, 40), ("piper", 150, 12)])
async def test_abort_storm_leaves_nothing_behind(
    engine_name: str,
    sessions: int,
    concurrency: int,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    engine: Engine | None = request.getfixturevalue("piper_engine") if engine_name == "piper" else None
    # The storm offers piper more than two cores synthesize in real time: it is about cleanup, so admission is by
    # slots (headroom admission would refuse part of it, which its own tests cover).
    with serve(Settings(engine=engine_name, admission="slots"), engine=engine) as server:
        metrics = server.http_url + "/metrics"
        warm_up = await run_storm(server.http_url, sessions // 4, concurrency=concurrency, seed=1)
        assert warm_up.unexpected == {}
        before = await settled_footprint(metrics)
        result = await run_storm(server.http_url, sessions, concurrency=concurrency, seed=2)
        after = await settled_footprint(metrics)
        pool = server.gateway.pool
        assert pool is not None
        aborted = server.call(lambda: pool.aborted_total)
        leases = server.call(lambda: len(server.gateway.registry.leases))
    report(capsys, engine_name, result, before, after)
    assert result.unexpected == {}
    assert after.sessions == 0 and after.engine_streams == 0 and leases == 0
    assert isinstance(aborted, int) and aborted > 0
    assert after.tasks <= before.tasks
    assert after.open_fds <= before.open_fds + FD_SLACK
    assert after.rss_bytes - before.rss_bytes < RSS_BOUND_BYTES[engine_name]
