"""``omnigate-loadtest soak`` end to end, for a few seconds against the real server: it samples the server's footprint
and the clients' latency every interval and its exit status follows its verdict. (Whether a given server trends
upward is what a real soak measures, for ten minutes or an hour; ``docs/reliability/`` has the results.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from omnigate.gateway.settings import Settings
from omnigate.loadtest.soak import SoakReport
from tests.serving import serve

pytestmark = pytest.mark.slow

LOADTEST = str(Path(sys.executable).with_name("omnigate-loadtest"))


def test_the_soak_samples_every_interval_and_reports_a_verdict(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    with serve(Settings(engine="synthetic", model="rtf=0.2")) as server:
        command = [LOADTEST, "soak", server.http_url, "--sessions", "4", "--duration", "8", "--interval", "2"]
        result = subprocess.run(
            [*command, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    report = msgspec.json.decode(out.read_bytes(), type=SoakReport)
    assert result.returncode == (0 if report.passed else 1), result.stderr
    assert report.sessions == 4 and len(report.samples) == 4
    assert all(sample.footprint is not None for sample in report.samples)
    assert sum(sample.utterances for sample in report.samples) > 0
    assert {t.name for t in report.trends} == {
        "rss_mib",
        "open_fds",
        "event_loop_tasks",
        "ttfa_p99_ms",
        "ttfa_p50_ms",
    }
    assert report.passed == (not report.problems)


def test_the_soak_needs_one_way_to_size_the_load() -> None:
    result = subprocess.run([LOADTEST, "soak", "--duration", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "exactly one of" in result.stderr
