"""The talk page at ``/`` in Debian's Chromium (headless, through playwright-core), inside a network namespace.

The test makes its own namespace (``unshare -n``) with a veth pair, 10.200.0.1 and 10.200.0.2, because Chromium
gathers no ICE candidates on loopback alone; nothing outside the namespace is reachable from it. There the gateway
serves the piper voice, and the page speaks a sentence over WebRTC and, with WebRTC removed, over the WebSocket.
What the page played is recorded through WebAudio and must be speech.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from tests.audio_checks import speech_fraction
from tests.browser.namespace import run_in_namespace, unshare_refusal

pytestmark = pytest.mark.browser

MODES = ("webrtc", "no-webrtc")


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    refusal = unshare_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    out = tmp_path_factory.mktemp("browser")
    run = run_in_namespace("tests.browser.page_session", out)
    output = f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert run.returncode == 0, f"the browser run failed ({run.returncode}):\n{output}"
    return {mode: json.loads((out / f"{mode}.json").read_text()) for mode in MODES}


def played_audio(run: dict[str, Any]) -> tuple[np.ndarray, int]:
    """What the page played (int16 mono at the AudioContext's rate), trimmed to where it was audible."""
    pcm = np.frombuffer(base64.b64decode(run["pcm"]), dtype="<i2")
    audible = np.flatnonzero(np.abs(pcm) > 328)  # -40 dBFS
    assert audible.size, f"the page played nothing audible; console: {run['console']}"
    return pcm[audible[0] : audible[-1] + 1], int(run["sampleRate"])


def assert_speech(run: dict[str, Any]) -> None:
    pcm, rate = played_audio(run)
    assert pcm.size / rate > 2.5, "the sentence is about four seconds of speech"
    assert speech_fraction(pcm.tobytes(), rate) > 0.5
    # Speech-like energy: mostly loud, but the 20 ms envelope moves with the syllables (a tone would stay flat).
    windows = pcm[: pcm.size // (rate // 50) * (rate // 50)].astype(np.float64).reshape(-1, rate // 50) / 32768.0
    level_db = 20 * np.log10(np.sqrt(np.mean(windows**2, axis=1)) + 1e-9)
    assert np.mean(level_db > -40) > 0.6
    assert np.std(level_db) > 4.0
    stats = run["stats"]
    assert stats["errors"] == [] and stats["utterancesDone"] == 1
    assert stats["ttfaMs"] is not None and 0 < stats["ttfaMs"] < 5000


def test_the_page_speaks_over_webrtc(page_runs: dict[str, dict[str, Any]]) -> None:
    run = page_runs["webrtc"]
    assert run["transport"] == "over WebRTC", run["console"]
    assert_speech(run)


def test_without_webrtc_the_page_falls_back_to_the_websocket(page_runs: dict[str, dict[str, Any]]) -> None:
    run = page_runs["no-webrtc"]
    assert run["transport"] == "over WebSocket", run["console"]
    assert_speech(run)
