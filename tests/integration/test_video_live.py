"""Live video on ``WS /v1/realtime/video``: the real server with the chunk-causal tiny preset on the CPU, a real
websockets client, and the fMP4 decoded with PyAV.

Order is asserted from the events' order on the wire, never from elapsed time.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import av
import pytest
from websockets.asyncio.client import ClientConnection, connect

from omnigate.codecs.video import top_level_boxes
from omnigate.engines.video.live import LiveVideoEngine
from omnigate.gateway.settings import Settings
from tests.serving import RunningServer, serve

VIDEO = "/v1/realtime/video"
LIVE = {"prompt": "a red fox in the snow", "live": True, "width": 64, "height": 64, "fps": 8, "steps": 2}
DURATION_S = 6  # of video per live stream: 48 frames at 8 fps


@pytest.fixture(scope="module")
def live_server() -> Iterator[RunningServer]:
    options = {"max_sessions": "3", "max_frames_in_flight": "12", "max_live_seconds": str(DURATION_S)}
    with serve(Settings(engine="synthetic", video_model="preset:tiny-causal", video_options=options)) as server:
        engine: LiveVideoEngine = server.app.state.video_engine
        # Headroom for two streams' KV caches at 64x64, not three (slots allow three).
        server.call(
            lambda: setattr(engine, "cache_budget_bytes", 2 * engine.cache_bytes(engine.resolve("x", live=True)))
        )
        yield server


async def send(ws: ClientConnection, event_type: str, **fields: Any) -> None:
    await ws.send(json.dumps({"type": event_type, **fields}))


async def next_json(ws: ClientConnection) -> dict[str, Any]:
    message = await ws.recv()
    assert isinstance(message, str), "expected a JSON event, got binary"
    event: dict[str, Any] = json.loads(message)
    return event


async def until_done(ws: ClientConnection) -> tuple[list[dict[str, Any]], list[bytes], dict[str, Any]]:
    """Every JSON event and binary message up to ``video.done``."""
    events: list[dict[str, Any]] = []
    media: list[bytes] = []
    while True:
        message = await ws.recv()
        if isinstance(message, bytes):
            media.append(message)
            continue
        event = json.loads(message)
        if event["type"] == "video.done":
            return events, media, event
        events.append(event)


async def next_of(ws: ClientConnection, event_type: str) -> dict[str, Any]:
    """The next event of ``event_type``, past media and other events."""
    while True:
        message = await ws.recv()
        if isinstance(message, str) and (event := json.loads(message))["type"] == event_type:
            return dict(event)


def decoded_frames(segments: list[bytes]) -> int:
    with av.open(io.BytesIO(b"".join(segments))) as container:
        return sum(1 for _ in container.decode(video=0))


async def test_a_live_stream_runs_in_chunks_follows_a_new_prompt_and_stops_on_cancel(
    live_server: RunningServer,
) -> None:
    async with connect(live_server.ws_url + VIDEO) as ws:
        await send(ws, "video.create", **LIVE, seed=1)
        start = await next_json(ws)
        assert (start["type"], start["live"], start["num_frames"]) == ("video.start", True, None)
        init = await ws.recv()
        assert isinstance(init, bytes) and [kind for kind, _ in top_level_boxes(init)] == ["ftyp", "moov"]
        segments = [init]
        chunk = await next_json(ws)
        assert (chunk["type"], chunk["index"], chunk["frames"], chunk["prompt_id"]) == ("video.chunk", 0, 9, 0)
        fragment = await ws.recv()
        assert isinstance(fragment, bytes) and [kind for kind, _ in top_level_boxes(fragment)] == ["moof", "mdat"]
        segments.append(fragment)
        await send(ws, "video.prompt", prompt="a grey wolf at night")
        # Read on until the new prompt shows, then one chunk more, then stop.
        chunks = [chunk]
        accepted: dict[str, Any] | None = None
        updated: dict[str, Any] | None = None
        while updated is None or chunks[-1]["index"] < updated["chunk_index"]:
            message = await ws.recv()
            if isinstance(message, bytes):
                segments.append(message)
                continue
            event = json.loads(message)
            if event["type"] == "video.prompt.accepted":
                accepted = event
                in_progress = chunks[-1]["index"] + 1  # chunk 0 was out: the next one may already be under way
            elif event["type"] == "video.prompt.updated":
                updated = event
            else:
                assert event["type"] == "video.chunk", event
                chunks.append(event)
        assert accepted is not None and accepted["prompt_id"] == updated["prompt_id"] == 1
        # No later than the chunk after the one in progress when the prompt came.
        assert updated["chunk_index"] <= in_progress + 1
        assert 0 <= updated["step"] < LIVE["steps"]  # from which of that chunk's denoising steps
        assert [c["prompt_id"] for c in chunks] == [0 if c["index"] < updated["chunk_index"] else 1 for c in chunks]
        await send(ws, "video.cancel")
        events, media, done = await until_done(ws)
        segments += media
        chunks += [e for e in events if e["type"] == "video.chunk"]
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    assert done["status"] == "cancelled"
    assert done["frames"] == sum(c["frames"] for c in chunks) < DURATION_S * 8
    assert decoded_frames(segments) == done["frames"]


async def test_a_live_stream_ends_typed_at_the_duration_limit(live_server: RunningServer) -> None:
    async with connect(live_server.ws_url + VIDEO) as ws:
        await send(ws, "video.create", **LIVE, seed=2)
        events, segments, done = await until_done(ws)
    chunks = [e for e in events if e["type"] == "video.chunk"]
    assert (done["status"], done["code"], done["frames"]) == ("completed", "max_duration", DURATION_S * 8)
    assert [c["frames"] for c in chunks] == [9, 12, 12, 12, 3]
    assert decoded_frames(segments) == DURATION_S * 8


async def test_a_bounded_clip_still_works_on_the_chunk_causal_engine(live_server: RunningServer) -> None:
    async with connect(live_server.ws_url + VIDEO) as ws:
        await send(ws, "video.create", **{**LIVE, "live": False, "num_frames": 17}, seed=3)
        events, segments, done = await until_done(ws)
    assert [e["frames"] for e in events if e["type"] == "video.chunk"] == [9, 8]
    assert (done["status"], done["frames"]) == ("completed", 17)
    assert decoded_frames(segments) == 17


async def test_live_requests_out_of_limits_and_past_the_headroom_are_refused_typed(
    live_server: RunningServer,
) -> None:
    engine: LiveVideoEngine = live_server.app.state.video_engine
    async with (
        connect(live_server.ws_url + VIDEO) as first,
        connect(live_server.ws_url + VIDEO) as second,
        connect(live_server.ws_url + VIDEO) as third,
    ):
        bad: list[tuple[dict[str, Any], str, str | None]] = [
            ({**LIVE, "steps": 9}, "invalid_value", "steps"),
            ({**LIVE, "chunk_frames": 5}, "invalid_value", "chunk_frames"),
            ({**LIVE, "width": 66}, "invalid_size", "width"),
            ({**LIVE, "num_frames": 17}, "invalid_value", "num_frames"),
        ]
        for fields, code, param in bad:
            await send(third, "video.create", **fields)
            error = await next_json(third)
            assert (error["type"], error["code"], error.get("param")) == ("error", code, param), error
        await send(third, "video.prompt", prompt="no stream here")
        assert (await next_json(third))["code"] == "no_live_stream"
        await send(first, "video.create", **LIVE, seed=4)
        await send(second, "video.create", **LIVE, seed=5)
        for ws in (first, second):
            assert (await next_json(ws))["type"] == "video.start"
        await send(first, "video.prompt", prompt=" ")
        event = await next_of(first, "error")
        assert (event["code"], event["param"]) == ("invalid_value", "prompt")
        await send(third, "video.create", **LIVE, seed=6)
        refused = await next_json(third)
        assert refused["code"] == "server_busy" and "headroom" in refused["message"]
        assert refused["retry_after"] > 0
        for ws in (first, second):
            await send(ws, "video.cancel")
            _, _, done = await until_done(ws)
            assert done["status"] == "cancelled"
    assert live_server.call(lambda: engine.active) == 0
