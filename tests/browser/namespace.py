"""The network namespace the browser tests run Chromium and the gateway in (Chromium gathers no ICE candidates on
loopback alone): a veth pair, 10.200.0.1 and 10.200.0.2, made with ``unshare -n``; nothing outside is reachable."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE_SETUP = (
    "ip link set lo up"
    " && ip link add veth0 type veth peer name veth1"
    " && ip addr add 10.200.0.1/24 dev veth0 && ip addr add 10.200.0.2/24 dev veth1"
    " && ip link set veth0 up && ip link set veth1 up"
)
RUN_TIMEOUT_S = 240


def unshare_refusal() -> str | None:
    """Why a network namespace cannot be made here, or None when it can."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else f"unshare -n is not permitted: {probe.stderr.strip()}"


def run_in_namespace(module: str, out: Path, timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module OUT`` in a fresh namespace (the module starts the server and drives Chromium)."""
    script = f'{NAMESPACE_SETUP} && exec "$0" -m {module} "$1"'
    return subprocess.run(
        ["unshare", "-n", "sh", "-c", script, sys.executable, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
