"""Graceful drain of video sessions (``WS /v1/realtime/video``, WebRTC video calls) of a real ``omnigate serve``
process on SIGTERM, with the tiny random-weight video preset on the CPU.

As in :mod:`tests.integration.test_drain`, the server is a subprocess so the signal, the drain and the exit status are
the real ones, and every step waits on protocol events. A generation is still running when the signal arrives
because it is sent on ``video.start`` and the generation outlasts it by construction: a call's generation ends only
once its frames have played at the requested fps, and a WebSocket's takes seconds of CPU decoding.
"""

from __future__ import annotations

import asyncio
import io
import json
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import av
import pytest
from websockets.asyncio.client import ClientConnection, connect

from omnigate.loadtest.targets.webrtc import CallRefused, use_loopback_candidates
from tests.integration.test_drain import READ_LIMIT_S, ServerProcess, close_code, next_event, server_process
from tests.integration.test_webrtc_video import VideoPeer

pytestmark = pytest.mark.slow

VIDEO = "/v1/realtime/video"
VIDEO_CALLS = "/v1/realtime/video/calls"
PROMPT = "a red fox in the snow"
VIDEO_ARGS = (
    "--video-model",
    "preset:tiny",
    "--video-option",
    "max_sessions=2",
    "--video-option",
    "max_frames_in_flight=5",
    "--video-option",
    f"max_video_pixels={128 * 128 * 81}",
    "--webrtc-host-address",
    "127.0.0.1",
)
# About a second of CPU work: the drain's first look, milliseconds after the signal, finds it still generating.
WS_CLIP = {"prompt": PROMPT, "width": 96, "height": 64, "num_frames": 33, "fps": 16, "steps": 100}
# Its 17 frames play at 4 fps: the generation lasts 4 s whatever the CPU does.
CALL_CLIP = {"prompt": PROMPT, "width": 96, "height": 64, "num_frames": 17, "fps": 4, "steps": 2}
# Far past a one-second deadline: many seconds of decoding, and 33 s of playing at 1 fps.
LONG_WS_CLIP = {"prompt": PROMPT, "width": 128, "height": 128, "num_frames": 81, "fps": 16, "steps": 100}
LONG_CALL_CLIP = {"prompt": PROMPT, "width": 96, "height": 64, "num_frames": 33, "fps": 1, "steps": 2}


def video_url(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}{VIDEO}"


def calls_url(server: ServerProcess) -> str:
    return f"http://127.0.0.1:{server.port}{VIDEO_CALLS}"


async def create(ws: ClientConnection, clip: dict[str, Any], seed: int) -> None:
    await ws.send(json.dumps({"type": "video.create", **clip, "seed": seed}))
    assert (await next_event(ws))["type"] == "video.start"


@asynccontextmanager
async def video_call(server: ServerProcess) -> AsyncIterator[VideoPeer]:
    peer = VideoPeer()
    try:
        await peer.connect(calls_url(server))
        yield peer
    finally:
        await peer.close()


async def rest_of_generation(ws: ClientConnection) -> tuple[list[bytes], dict[str, Any]]:
    """The binary messages after ``video.start`` (init segment, fragments) and the ``video.done`` behind them."""
    segments: list[bytes] = []
    async with asyncio.timeout(READ_LIMIT_S):
        while isinstance(message := await ws.recv(), bytes):
            segments.append(message)
    done: dict[str, Any] = json.loads(message)
    assert done["type"] == "video.done", done
    return segments, done


def decoded_frames(segments: list[bytes]) -> int:
    with av.open(io.BytesIO(b"".join(segments)), mode="r", format="mp4") as container:
        return len(list(container.decode(video=0)))


async def closed_typed(peer: VideoPeer) -> None:
    """The call's last event is a ``shutting_down`` error, then the server closes it."""
    error = await peer.next_event("error", READ_LIMIT_S)
    assert error["code"] == "shutting_down", error
    await asyncio.wait_for(peer.ended.wait(), READ_LIMIT_S)


async def test_sigterm_closes_idle_video_sessions_at_once_and_lets_generations_finish(tmp_path: Path) -> None:
    use_loopback_candidates()
    async with (
        server_process(tmp_path, 30.0, VIDEO_ARGS) as server,
        connect(video_url(server)) as idle_ws,
        connect(video_url(server)) as generating_ws,
        video_call(server) as idle_call,
        video_call(server) as generating_call,
    ):
        generating_call.send("video.create", **CALL_CLIP, seed=1)
        await generating_call.next_event("video.start")
        await create(generating_ws, WS_CLIP, seed=2)

        server.process.send_signal(signal.SIGTERM)

        # The idle sessions are closed at once, typed.
        error = await next_event(idle_ws)
        assert (error["type"], error["code"]) == ("error", "shutting_down")
        assert await close_code(idle_ws) == 1012
        await closed_typed(idle_call)
        # New video sessions are refused, typed.
        async with connect(video_url(server)) as refused:
            assert (await next_event(refused))["code"] == "shutting_down"
            assert await close_code(refused) == 1012
        with pytest.raises(CallRefused) as refusal:
            async with video_call(server):
                pass
        assert refusal.value.status == 503 and json.loads(refusal.value.body)["error"]["code"] == "shutting_down"

        # The generations finish with all their frames, then their sessions are closed, typed.
        segments, done = await rest_of_generation(generating_ws)
        assert (done["status"], done["frames"]) == ("completed", 33)
        assert decoded_frames(segments) == 33
        assert (await next_event(generating_ws))["code"] == "shutting_down"
        assert await close_code(generating_ws) == 1012
        done = await generating_call.next_event("video.done", READ_LIMIT_S)
        assert (done["status"], done["frames"]) == ("completed", 17)
        await closed_typed(generating_call)
        assert len(generating_call.noise_frames(96, 64)) >= 2

        assert await server.exit_code() == 0
    log = server.log.read_text()
    assert "draining: 4 live sessions" in log
    assert "4 sessions closed when idle, 0 at the deadline, 0 left" in log


async def test_video_generations_still_running_at_the_deadline_are_cancelled_and_closed_typed(
    tmp_path: Path,
) -> None:
    use_loopback_candidates()
    async with (
        server_process(tmp_path, 1.0, VIDEO_ARGS) as server,
        connect(video_url(server)) as generating_ws,
        video_call(server) as generating_call,
    ):
        generating_call.send("video.create", **LONG_CALL_CLIP, seed=3)
        await generating_call.next_event("video.start")
        await create(generating_ws, LONG_WS_CLIP, seed=4)

        server.process.send_signal(signal.SIGTERM)

        # Each generation ends cancelled by the drain: its engine job finished before the engine was stopped (a job
        # the stopping engine cancels says code shutting_down), so the engine holds no job.
        _, done = await rest_of_generation(generating_ws)
        assert done["status"] == "cancelled" and "code" not in done, done
        assert done["frames"] < 81
        assert (await next_event(generating_ws))["code"] == "shutting_down"
        assert await close_code(generating_ws) == 1012
        done = await generating_call.next_event("video.done", READ_LIMIT_S)
        assert done["status"] == "cancelled" and "code" not in done, done
        assert done["frames"] < 33
        await closed_typed(generating_call)

        assert await server.exit_code() == 0
    assert "0 sessions closed when idle, 2 at the deadline, 0 left" in server.log.read_text()
