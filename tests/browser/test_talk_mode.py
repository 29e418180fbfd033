"""The talk page's talk mode in Debian's Chromium: a server with an LLM and a speech recognizer (the stand-ins)
answers what the fake microphone says (a recorded user turn), and the page plays the reply and shows the turns,
over WebRTC and, with WebRTC removed, over the WebSocket."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.audio_checks import speech_fraction
from tests.browser.namespace import run_in_namespace, unshare_refusal
from tests.browser.talk_mode_session import REPLY, TRANSCRIPT
from tests.browser.test_talk_page import played_audio

pytestmark = pytest.mark.browser


MODES = ("webrtc", "no-webrtc")


@pytest.fixture(scope="module")
def talk_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    refusal = unshare_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    out = tmp_path_factory.mktemp("talk")
    run = run_in_namespace("tests.browser.talk_mode_session", out)
    output = f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert run.returncode == 0, f"the browser run failed ({run.returncode}):\n{output}"
    return {mode: json.loads((out / f"talk-{mode}.json").read_text()) for mode in MODES}


@pytest.mark.parametrize(("mode", "transport"), [("webrtc", "WebRTC"), ("no-webrtc", "WebSocket")])
def test_the_page_talks_with_the_servers_responder(
    talk_runs: dict[str, dict[str, Any]], mode: str, transport: str
) -> None:
    talk_run = talk_runs[mode]
    assert talk_run["transport"] == f"talking over {transport}", talk_run["console"]
    turns = talk_run["turns"]
    assert turns["responses"][0] == "completed", talk_run["console"]
    assert turns["transcripts"][0] == TRANSCRIPT and turns["replies"][0] == REPLY
    assert ["user", TRANSCRIPT] in talk_run["shown"] and ["assistant", REPLY] in talk_run["shown"]
    assert talk_run["stats"]["errors"] == []
    pcm, rate = played_audio(talk_run)
    assert pcm.size / rate > 1.0, "the reply is about two seconds of speech"
    assert speech_fraction(pcm.tobytes(), rate) > 0.5
