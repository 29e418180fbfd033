"""The README's client examples, run as a reader runs them, against the real server as ``omnigate serve`` runs it
(the hibari voice).

Each example must produce audio as written, and with a mistyped voice print the server's ``unknown_voice`` error and
stop with a non-zero status, not wait for the server to give up on the session.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serving import RunningServer

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_ADDRESS = "127.0.0.1:8000"
# A guard against a hung example only; the server's own timeouts are far longer (config_timeout: 10 s, idle: 60 s).
EXAMPLE_TIMEOUT_S = 120
VOICE = re.compile(r'("voice": ?|voice=)"\w+"')


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.DOTALL | re.MULTILINE)


def client_examples() -> dict[str, tuple[list[str], str]]:
    """Each example that talks to the server: its name, the command that runs it, and its source."""
    examples: dict[str, tuple[list[str], str]] = {}
    for block in code_blocks("python"):
        name = "openai-sdk" if "from openai" in block else "websocket"
        examples[name] = ([sys.executable, "-c"], block)
    [curl] = [block for block in code_blocks("sh") if block.startswith("curl ")]
    examples["curl"] = (["bash", "-euo", "pipefail", "-c"], curl)
    return examples


EXAMPLES = client_examples()


def run_example(
    name: str, server: RunningServer, cwd: Path, *, voice: str | None = None
) -> subprocess.CompletedProcess[str]:
    command, source = EXAMPLES[name]
    assert DEFAULT_ADDRESS in source and VOICE.search(source), f"the {name} example changed shape"
    source = source.replace(DEFAULT_ADDRESS, f"{server.host}:{server.port}")
    if voice is not None:
        source = VOICE.sub(lambda m: f'{m.group(1)}"{voice}"', source)
    return subprocess.run(
        [*command, source], cwd=cwd, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S, check=False
    )


def test_the_readme_has_each_example() -> None:
    assert set(EXAMPLES) == {"websocket", "openai-sdk", "curl"}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_writes_audio(name: str, default_server: RunningServer, tmp_path: Path) -> None:
    if name == "curl" and shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    run = run_example(name, default_server, tmp_path)
    assert run.returncode == 0, run.stderr
    [written] = list(tmp_path.iterdir())
    assert written.stat().st_size > 5_000, "a second of speech or more (an error body is a few hundred bytes)"
    if name == "websocket":
        assert run.stdout.strip() == "out.pcm: s16le mono at 24000 Hz"
    if name == "openai-sdk":
        assert run.stdout.strip() == "hello.pcm: audio/pcm;rate=24000"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_prints_a_refusal_and_stops(name: str, default_server: RunningServer, tmp_path: Path) -> None:
    if name == "curl" and shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    run = run_example(name, default_server, tmp_path, voice="jeo")
    assert run.returncode != 0
    assert "'jeo' is not served; available: heart" in run.stderr, run.stderr
    assert "config_timeout" not in run.stderr
