"""The voice-agent examples the README documents, run as a reader runs them against a real ``omnigate serve``: each
writes a reply the Silero VAD hears as speech, and with a voice the server does not have prints the refusal and stops
with a non-zero status."""

from __future__ import annotations

import subprocess
import sys
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.audio_checks import speech_fraction
from tests.integration.agent_pipelines import ServerProcess, omnigate_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "livekit": (ROOT / "examples" / "livekit_agent.py", ["--offline"]),
    "pipecat": (ROOT / "examples" / "pipecat_pipeline.py", []),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with omnigate_serve(tmp_path_factory.mktemp("examples")) as running:
        yield running


def run(name: str, server: ServerProcess, out: Path, voice: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip(name)
    script, flags = EXAMPLES[name]
    command = [sys.executable, str(script), *flags, str(out), "--base-url", server.base_url, "--voice", voice]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_speaks_a_reply(name: str, server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "reply.wav"
    result = run(name, server, out, "alloy")
    assert result.returncode == 0, result.stderr
    with wave.open(str(out)) as wav:
        rate, pcm = wav.getframerate(), wav.readframes(wav.getnframes())
    assert rate == 24000 and len(pcm) / (2 * rate) > 3.0
    assert speech_fraction(pcm, rate) > 0.6


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_prints_a_refusal_and_stops(name: str, server: ServerProcess, tmp_path: Path) -> None:
    result = run(name, server, tmp_path / "reply.wav", "nobody")
    assert result.returncode == 1 and "unknown_voice" in result.stderr, result.stderr
