"""The video page's live mode in Debian's Chromium (headless), inside a network namespace, against the chunk-causal
tiny preset on the CPU: start a live stream, change its prompt while it plays, stop it; over the WebSocket (fMP4
into Media Source Extensions) and over a WebRTC call's video track.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.browser.namespace import run_in_namespace, unshare_refusal

pytestmark = pytest.mark.browser

TRANSPORTS = ("mse", "webrtc")
WIDTH, HEIGHT = 96, 64


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    refusal = unshare_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    out = tmp_path_factory.mktemp("video-live-page")
    run = run_in_namespace("tests.browser.video_live_page_session", out)
    runs = {t: json.loads(path.read_text()) for t in TRANSPORTS if (path := out / f"live-{t}.json").exists()}
    output = f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{json.dumps(runs)[-3000:]}"
    assert run.returncode == 0, f"the browser run failed ({run.returncode}):\n{output}"
    return runs


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_page_starts_a_live_stream_changes_its_prompt_and_stops_it(
    page_runs: dict[str, dict[str, Any]], transport: str
) -> None:
    run = page_runs[transport]
    events = run["events"]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "video.start" and events[0]["live"] is True, run
    assert kinds[-1] == "video.done" and events[-1]["status"] == "cancelled", run
    assert "video.prompt.accepted" in kinds and "video.prompt.updated" in kinds
    updated = next(e for e in events if e["type"] == "video.prompt.updated")
    chunks = [e for e in events if e["type"] == "video.chunk"]
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    assert [c["prompt_id"] for c in chunks] == [int(c["index"] >= updated["chunk_index"]) for c in chunks]
    assert kinds.index("video.prompt.updated") < events.index(chunks[updated["chunk_index"]])
    assert len([s for s in run["presented"] if tuple(s) == (WIDTH, HEIGHT)]) >= 3, run["presented"]
    assert run["error"] == "" and run["sendPromptDisabled"], run
