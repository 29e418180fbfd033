"""The video page at ``/static/video.html`` in Debian's Chromium (headless, through playwright-core), inside a network
namespace (as the talk page test: Chromium gathers no ICE candidates on loopback alone).

There the gateway serves the tiny random-weight video preset on the CPU, and the page generates a short clip over
the WebSocket (fragmented MP4 into Media Source Extensions), then over a WebRTC call's video track. The ``<video>``
element must present frames of the clip's size, and ``video.done`` must reach the page.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.browser.namespace import run_in_namespace, unshare_refusal

pytestmark = pytest.mark.browser

TRANSPORTS = ("mse", "webrtc")
# The clip video_page.mjs asks for.
WIDTH, HEIGHT, FRAMES, FPS = 96, 64, 17, 8


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    refusal = unshare_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    out = tmp_path_factory.mktemp("video-page")
    run = run_in_namespace("tests.browser.video_page_session", out)
    runs = {t: json.loads((out / f"{t}.json").read_text()) for t in TRANSPORTS if (out / f"{t}.json").exists()}
    output = f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{json.dumps(runs)[-3000:]}"
    assert run.returncode == 0, f"the browser run failed ({run.returncode}):\n{output}"
    return runs


def assert_generated_and_shown(run: dict[str, Any]) -> dict[str, Any]:
    """The page received the whole generation and its ``<video>`` element showed it at the clip's size."""
    events = run["events"]
    assert [e["type"] for e in events] == ["video.start", "video.done"], run
    start: dict[str, Any] = events[0]
    done: dict[str, Any] = events[1]
    assert (start["width"], start["height"], start["num_frames"], start["fps"]) == (WIDTH, HEIGHT, FRAMES, FPS)
    assert (done["status"], done["frames"]) == ("completed", FRAMES)
    assert run["state"] == "done" and run["error"] == "", run
    assert (run["videoWidth"], run["videoHeight"]) == (WIDTH, HEIGHT)
    presented_at_size = [size for size in run["presented"] if tuple(size) == (WIDTH, HEIGHT)]
    assert len(presented_at_size) >= 3, run["presented"]
    assert run["totalVideoFrames"] > 0
    return done


def test_the_page_plays_video_from_the_websocket_through_media_source(page_runs: dict[str, dict[str, Any]]) -> None:
    run = page_runs["mse"]
    done = assert_generated_and_shown(run)
    assert done["bytes"] > 0
    # Played to the end: every frame of the clip went through the decoder.
    assert run["ended"] and run["totalVideoFrames"] == FRAMES, run


def test_the_page_plays_video_from_a_webrtc_call(page_runs: dict[str, dict[str, Any]]) -> None:
    run = page_runs["webrtc"]
    done = assert_generated_and_shown(run)
    assert "bytes" not in done  # the track's encoder is aiortc's
