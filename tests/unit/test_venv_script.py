"""``scripts/_venv.sh``'s install stamp: written only after the install succeeded and the server's modules import.

The environment's interpreter is a stand-in script that logs how it was called and fails the pip install or the
import check on demand, so the script's own control flow runs without a download.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAND_IN = """#!/usr/bin/env bash
echo "$*" >>"$(dirname "$0")/../calls.log"
if [ "$1" = "-m" ] && [ -n "${PIP_FAILS:-}" ]; then echo "pip: no such package" >&2; exit 1; fi
if [ "$1" = "-c" ] && [ -n "${IMPORT_FAILS:-}" ]; then echo "ModuleNotFoundError: torch" >&2; exit 1; fi
exit 0
"""


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STAND_IN)
    python.chmod(0o755)
    return tmp_path / "venv"


def pip_install(venv: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = f'source "{ROOT}/scripts/_venv.sh" && ensure_venv && pip_install piper'
    return subprocess.run(
        ["bash", "-c", script],
        env={**os.environ, "OMNIGATE_VENV": str(venv), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def calls(venv: Path) -> list[str]:
    log = venv / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


STAMP = ".omnigate-installed-piper"


def test_an_install_whose_server_does_not_import_is_not_recorded_and_is_retried(venv: Path) -> None:
    failed = pip_install(venv, IMPORT_FAILS="1")
    assert failed.returncode != 0
    assert "do not import" in failed.stderr
    assert not (venv / STAMP).exists()
    [install, check] = calls(venv)
    assert install.startswith("-m pip install") and install.endswith(f"-e {ROOT}[piper]")
    assert check.startswith("-c import omnigate.gateway.app")

    assert pip_install(venv).returncode == 0  # the next run installs again, and this time records it
    assert len(calls(venv)) == 4
    assert (venv / STAMP).read_text().startswith(f"{ROOT} ")
    assert pip_install(venv).returncode == 0  # recorded: nothing to do
    assert len(calls(venv)) == 4


def test_a_failed_install_leaves_no_stamp(venv: Path) -> None:
    (venv / STAMP).write_text("an earlier install of another pyproject.toml\n")
    failed = pip_install(venv, PIP_FAILS="1")
    assert failed.returncode != 0
    assert not (venv / STAMP).exists()
    assert [call.split()[:2] for call in calls(venv)] == [["-m", "pip"]]
