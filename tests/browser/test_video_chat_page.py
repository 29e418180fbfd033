"""The video chat page at ``/static/video-chat.html`` in Debian's Chromium (headless, through playwright-core) with a
fake camera (a Y4M file) and a fake microphone (a WAV file), inside a network namespace (Chromium gathers no ICE
candidates on loopback alone). The gateway serves the tiny omni preset and the synthetic speech engine on the CPU.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.browser.namespace import run_in_namespace, unshare_refusal

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def page_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    refusal = unshare_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    out = tmp_path_factory.mktemp("video-chat-page")
    run = run_in_namespace("tests.browser.video_chat_page_session", out)
    result_file = out / "run.json"
    result: dict[str, Any] = json.loads(result_file.read_text()) if result_file.exists() else {}
    output = f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{json.dumps(result)[-3000:]}"
    assert run.returncode == 0, f"the browser run failed ({run.returncode}):\n{output}"
    return result


def of_query(run: dict[str, Any], query_id: int) -> list[dict[str, Any]]:
    return [e for e in run["events"] if e.get("query_id") == query_id]


def test_a_spoken_question_is_ended_by_the_server_vad_and_answered(page_run: dict[str, Any]) -> None:
    spoken = of_query(page_run, 0)
    assert spoken[0]["type"] == "response.start", spoken
    assert spoken[-1] == {"type": "response.audio.done", "query_id": 0, "status": "completed"}


def test_a_typed_question_is_answered_in_captions_and_on_the_audio_track(page_run: dict[str, Any]) -> None:
    typed = of_query(page_run, 1)
    assert typed[0]["type"] == "response.start" and typed[0]["frames"] >= 1, typed
    assert typed[-1] == {"type": "response.audio.done", "query_id": 1, "status": "completed"}
    text = next(e["text"] for e in typed if e["type"] == "response.text.done")
    assert page_run["captions"] == text
    assert (page_run["previewWidth"], page_run["previewHeight"]) == (320, 240)  # the fake camera's file
    assert page_run["audioBytes"] > 0
    assert page_run["error"] == "", page_run
