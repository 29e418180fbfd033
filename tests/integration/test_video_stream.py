"""``WS /v1/realtime/video`` against the real server (tiny random-weight Wan preset on the CPU, real H.264 fMP4).

Order is asserted from the engine's own timeline, which ``video.done`` reports, never from elapsed time. Where a test
waits for the server to reach a state, it polls that state with a deadline that only bounds a failing run.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import av
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from omnigate.codecs.video import top_level_boxes
from omnigate.engines.video.engine import VideoEngine
from omnigate.gateway.settings import Settings
from tests.serving import RunningServer, serve

VIDEO = "/v1/realtime/video"
CLIP = {"prompt": "a red fox in the snow", "width": 64, "height": 64, "num_frames": 17, "fps": 8, "steps": 2}


@pytest.fixture(scope="module")
def video_server() -> Iterator[RunningServer]:
    options = {"max_sessions": "1", "max_frames_in_flight": "5", "max_video_pixels": str(64 * 64 * 17)}
    with serve(Settings(engine="synthetic", video_model="preset:tiny", video_options=options)) as server:
        yield server


def video_engine(server: RunningServer) -> VideoEngine:
    engine: VideoEngine = server.app.state.video_engine
    return engine


async def wait_until(server: RunningServer, predicate: Callable[[], bool], limit_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not server.call(predicate):
        if loop.time() > deadline:
            raise AssertionError("the server never reached the expected state")
        await asyncio.sleep(0.02)


async def send(ws: ClientConnection, event_type: str, **fields: Any) -> None:
    await ws.send(json.dumps({"type": event_type, **fields}))


async def next_json(ws: ClientConnection) -> dict[str, Any]:
    message = await ws.recv()
    assert isinstance(message, str), "expected a JSON event, got binary"
    event: dict[str, Any] = json.loads(message)
    return event


async def started(ws: ClientConnection) -> dict[str, Any]:
    """video.start and the init segment behind it."""
    start = await next_json(ws)
    assert start["type"] == "video.start", start
    init = await ws.recv()
    assert isinstance(init, bytes) and [kind for kind, _ in top_level_boxes(init)] == ["ftyp", "moov"]
    return start


async def collect(ws: ClientConnection) -> tuple[dict[str, Any], list[bytes], dict[str, Any]]:
    """video.start, the binary segments, video.done; any other event fails the test."""
    start = await next_json(ws)
    assert start["type"] == "video.start", start
    segments: list[bytes] = []
    while True:
        message = await ws.recv()
        if isinstance(message, bytes):
            segments.append(message)
            continue
        done = json.loads(message)
        assert done["type"] == "video.done", done
        return start, segments, done


async def test_a_generation_streams_as_playable_fragmented_mp4(video_server: RunningServer) -> None:
    async with connect(video_server.ws_url + VIDEO) as ws:
        await send(ws, "video.create", **CLIP, seed=1)
        start, segments, done = await collect(ws)
    assert start["mime"].startswith('video/mp4; codecs="avc1.')
    assert (start["width"], start["height"], start["fps"], start["num_frames"], start["seed"]) == (64, 64, 8, 17, 1)
    # The init segment, then one fragment per latent frame (1 + 4 + 4 + 4 + 4 video frames).
    assert [kind for kind, _ in top_level_boxes(segments[0])] == ["ftyp", "moov"]
    assert len(segments) == 1 + 5
    assert all([kind for kind, _ in top_level_boxes(s)] == ["moof", "mdat"] for s in segments[1:])
    with av.open(io.BytesIO(b"".join(segments))) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 17
    assert {(f.width, f.height) for f in frames} == {(64, 64)}
    assert (done["status"], done["frames"], done["bytes"]) == ("completed", 17, sum(map(len, segments)))
    # With 5 frames of credit, the engine cannot have decoded more than two latent frames before the first
    # fragment was sent: the first fragment left before the last latent frame was decoded.
    assert done["stats"]["latent_frames"] == 5
    assert done["stats"]["decoded_before_first_send"] < 5


async def test_invalid_requests_are_refused_before_any_work_and_the_session_survives(
    video_server: RunningServer,
) -> None:
    engine = video_engine(video_server)
    work_before = video_server.call(lambda: (engine.prompts_encoded, engine.steps_run))
    async with connect(video_server.ws_url + VIDEO) as ws:
        bad: list[tuple[dict[str, Any], str, str | None]] = [
            ({**CLIP, "width": 60}, "invalid_size", "width"),
            ({**CLIP, "num_frames": 8}, "invalid_frames", "num_frames"),
            ({**CLIP, "num_frames": 21}, "too_large", "num_frames"),
            ({**CLIP, "steps": "two"}, "invalid_event", "steps"),
            ({**CLIP, "colour": "red"}, "invalid_event", "colour"),
            ({"width": 64}, "invalid_event", "prompt"),
            ({**CLIP, "model": "sora"}, "model_not_found", "model"),
            ({**CLIP, "num_frames": None, "live": True}, "live_unsupported", "live"),  # a whole-clip model
        ]
        for fields, code, param in bad:
            await send(ws, "video.create", **fields)
            error = await next_json(ws)
            assert (error["type"], error["code"], error.get("param")) == ("error", code, param), error
        await ws.send("{not json")
        assert (await next_json(ws))["code"] == "invalid_json"
        await send(ws, "video.make")
        assert (await next_json(ws))["code"] == "unknown_event"
        await ws.send(b"\x00\x01")
        assert (await next_json(ws))["code"] == "invalid_message"
        assert video_server.call(lambda: (engine.prompts_encoded, engine.steps_run)) == work_before
        await send(ws, "video.create", **{**CLIP, "num_frames": 5}, seed=2)
        _, segments, done = await collect(ws)
        assert done["status"] == "completed" and done["frames"] == 5 and len(segments) == 1 + 2


async def test_cancel_mid_way_leaves_nothing_behind_and_the_next_video_works(video_server: RunningServer) -> None:
    engine = video_engine(video_server)
    threads = video_server.call(threading.active_count)
    async with connect(video_server.ws_url + VIDEO) as ws:
        # A hundred denoising steps: the cancel, sent right behind the create, lands long before they are done.
        await send(ws, "video.create", **{**CLIP, "steps": 100}, seed=3)
        await send(ws, "video.cancel")
        start, segments, done = await collect(ws)
        assert start["num_frames"] == 17
        assert (done["status"], done["frames"]) == ("cancelled", 0)
        assert len(segments) == 1  # the init segment only
        # video.done leaves after the engine freed the slot and the generation's tensors.
        assert video_server.call(lambda: (engine.active, engine.free_slots)) == (0, 1)
        await send(ws, "video.cancel")  # nothing to cancel: ignored
        await send(ws, "video.create", **{**CLIP, "num_frames": 5}, seed=4)
        _, _, done = await collect(ws)
        assert done["status"] == "completed"
    await wait_until(video_server, lambda: video_server.gateway.registry.total_active == 0)
    assert video_server.call(threading.active_count) == threads


async def test_disconnect_mid_generation_cancels_it_and_releases_the_session(video_server: RunningServer) -> None:
    engine = video_engine(video_server)
    cancelled_before = video_server.call(lambda: engine.finished_total["cancelled"])
    async with connect(video_server.ws_url + VIDEO) as ws:
        await send(ws, "video.create", **{**CLIP, "steps": 100}, seed=5)
        await started(ws)
    await wait_until(video_server, lambda: engine.active == 0)
    await wait_until(video_server, lambda: video_server.gateway.registry.total_active == 0)
    assert video_server.call(lambda: engine.finished_total["cancelled"]) == cancelled_before + 1


async def test_a_second_generation_over_the_slot_count_is_refused_typed(video_server: RunningServer) -> None:
    async with connect(video_server.ws_url + VIDEO) as first, connect(video_server.ws_url + VIDEO) as second:
        await send(first, "video.create", **{**CLIP, "steps": 100}, seed=6)
        await started(first)
        await send(second, "video.create", **CLIP, seed=7)
        error = await next_json(second)
        assert error["code"] == "server_busy" and error["retry_after"] > 0
        await send(first, "video.create", **CLIP, seed=8)
        assert (await next_json(first))["code"] == "busy"  # one generation at a time per connection
        await send(first, "video.cancel")
        _, _, done = await collect_rest(first)
        assert done["status"] == "cancelled"
        await send(second, "video.create", **{**CLIP, "num_frames": 5}, seed=9)
        _, _, done = await collect(second)
        assert done["status"] == "completed"


async def collect_rest(ws: ClientConnection) -> tuple[None, list[bytes], dict[str, Any]]:
    """The rest of a generation whose start was already read."""
    segments: list[bytes] = []
    while True:
        message = await ws.recv()
        if isinstance(message, bytes):
            segments.append(message)
            continue
        done = json.loads(message)
        assert done["type"] == "video.done", done
        return None, segments, done


async def test_a_gateway_without_a_video_model_refuses_typed(synthetic_server: RunningServer) -> None:
    async with connect(synthetic_server.ws_url + VIDEO) as ws:
        error = await next_json(ws)
        assert error["code"] == "video_unavailable"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404


async def test_an_idle_connection_is_closed_with_a_typed_reason() -> None:
    # The short idle timer runs out while the client sends nothing: no message of the client races it.
    settings = Settings(engine="synthetic", video_model="preset:tiny", idle_timeout_s=0.5)
    with serve(settings) as server:
        async with connect(server.ws_url + VIDEO) as ws:
            error = await next_json(ws)
            assert error["code"] == "idle_timeout"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4408
        await wait_until(server, lambda: server.gateway.registry.total_active == 0)
