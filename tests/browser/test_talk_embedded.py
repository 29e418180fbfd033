"""The talk page's talk mode in Debian's Chromium against the server as ``serve`` starts it by default: nothing but
the gateway runs (the hibari voice, the embedded recognizer, the embedded LLM), and a spoken question gets a
transcript and a spoken answer, over WebRTC and, with WebRTC removed, over the WebSocket."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.audio_checks import speech_fraction
from tests.browser.namespace import run_in_namespace, unshare_refusal
from tests.browser.test_talk_page import played_audio

pytestmark = pytest.mark.browser

MODES = ("webrtc", "no-webrtc")
RUN_TIMEOUT_S = 900  # the embedded LLM's load, then a conversation per mode
# words of the recorded question ("Could you book a table for two at eight tonight?"), of which pocketsphinx hears at
# least two whichever way the audio came (it heard "you book a table for today to my", "look at table for today
# tonight")
QUESTION_WORDS = {"book", "table", "two", "eight", "tonight"}


@pytest.fixture(scope="module")
def talk_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    refusal = unshare_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    out = tmp_path_factory.mktemp("talk-embedded")
    run = run_in_namespace("tests.browser.talk_embedded_session", out, timeout_s=RUN_TIMEOUT_S)
    output = f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert run.returncode == 0, f"the browser run failed ({run.returncode}):\n{output}"
    return {mode: json.loads((out / f"talk-{mode}.json").read_text()) for mode in MODES}


@pytest.mark.parametrize(("mode", "transport"), [("webrtc", "WebRTC"), ("no-webrtc", "WebSocket")])
def test_the_page_talks_with_the_embedded_agent(
    talk_runs: dict[str, dict[str, Any]], mode: str, transport: str
) -> None:
    talk_run = talk_runs[mode]
    assert talk_run["transport"] == f"talking over {transport}", talk_run["console"]
    turns = talk_run["turns"]
    assert turns["responses"][0] == "completed", (turns, talk_run["console"])
    heard = set(turns["transcripts"][0].lower().replace("?", "").split())
    assert len(heard & QUESTION_WORDS) >= 2, turns["transcripts"]
    reply = turns["replies"][0]
    assert any(ch.isalpha() for ch in reply), turns["replies"]
    assert ["user", turns["transcripts"][0]] in talk_run["shown"] and ["assistant", reply] in talk_run["shown"]
    assert talk_run["stats"]["errors"] == []
    pcm, rate = played_audio(talk_run)
    assert pcm.size / rate > 0.5, "the answer is spoken"
    assert speech_fraction(pcm.tobytes(), rate) > 0.3
