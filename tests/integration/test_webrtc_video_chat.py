"""``POST /v1/video/chat/calls`` against the real server (tiny omni preset, synthetic speech) with an aiortc peer
on loopback that sends a camera track (a moving test picture) and a microphone track: events on the ``video-chat``
data channel, the spoken answer as Opus on the audio track. Waits poll state with deadlines that only bound a
failing run.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import av
import httpx
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import AudioStreamTrack, MediaStreamError, MediaStreamTrack, VideoStreamTrack

from omnigate.engines.omni.engine import OmniEngine
from omnigate.gateway.security.credentials import api_key_hash
from omnigate.gateway.settings import Settings
from omnigate.loadtest.targets.webrtc import use_loopback_candidates
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration

CALLS = "/v1/video/chat/calls"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve(Settings(engine="synthetic", omni_model="preset:tiny", webrtc_host_addresses=("127.0.0.1",))) as running:
        yield running


class Camera(VideoStreamTrack):
    """A bright square moving over a gradient, 160x120."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    async def recv(self) -> av.VideoFrame:
        pts, time_base = await self.next_timestamp()
        picture = np.tile(np.linspace(0, 200, 160, dtype=np.uint8), (120, 1))[..., None].repeat(3, axis=2)
        x = (self.count * 9) % 120
        picture[40:80, x : x + 40] = 255
        self.count += 1
        frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
        frame.pts, frame.time_base = pts, time_base
        return frame


class Peer:
    def __init__(self) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.camera = Camera()
        self.pc.addTrack(self.camera)
        self.pc.addTrack(AudioStreamTrack())  # a silent microphone: VAD hears no question
        self.channel = self.pc.createDataChannel("video-chat")
        self.events: list[dict[str, Any]] = []
        self.audio_samples = 0
        self.loud_samples = 0
        self.opened = asyncio.Event()
        self.channel.on("open", self.opened.set)
        self.channel.on("message", lambda m: self.events.append(json.loads(m)))
        self.pc.on("track", self._on_track)
        self._tasks: list[asyncio.Task[None]] = []

    async def connect(self, url: str, headers: dict[str, str] | None = None) -> None:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        assert self.pc.localDescription is not None
        async with httpx.AsyncClient(trust_env=False) as client:
            response = await client.post(
                url,
                content=self.pc.localDescription.sdp,
                headers={"content-type": "application/sdp", **(headers or {})},
            )
        assert response.status_code == 201, response.text
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=response.text, type="answer"))
        await asyncio.wait_for(self.opened.wait(), 15)

    def send(self, event_type: str, **fields: Any) -> None:
        self.channel.send(json.dumps({"type": event_type, **fields}))

    async def until(self, predicate: Callable[[], bool], limit_s: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        while not predicate():
            assert loop.time() < deadline, "the call never reached the expected state"
            await asyncio.sleep(0.02)

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self._tasks.append(asyncio.create_task(self._listen(track)))

    async def _listen(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            samples = frame.to_ndarray()
            self.audio_samples += samples.size
            self.loud_samples += int((np.abs(samples) > 500).sum())

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pc.close()


async def test_a_typed_question_about_the_camera_is_answered_on_the_channel_and_the_audio_track(
    server: RunningServer,
) -> None:
    use_loopback_candidates()
    engine: OmniEngine = server.app.state.omni_engine
    encoded_before = server.call(lambda: engine.frames_encoded_total)
    peer = Peer()
    try:
        await peer.connect(server.http_url + CALLS)
        peer.send("session.config", num_frames=2, max_new_tokens=40)
        await peer.until(lambda: peer.camera.count >= 30)  # a second of camera (2 frames of it are taken)
        peer.send("video.query", text="What is moving?")
        await peer.until(lambda: any(e["type"] == "response.audio.done" for e in peer.events))
        kinds = [e["type"] for e in peer.events]
        assert kinds[0] == "response.start" and peer.events[0]["frames"] >= 1
        assert "response.text.delta" in kinds and kinds.count("response.text.done") == 1
        assert "response.audio.delta" not in kinds  # audio goes on the track, not the channel
        assert peer.events[-1] == {"type": "response.audio.done", "query_id": 0, "status": "completed"}
        await peer.until(lambda: peer.loud_samples > 0)
        encoded_after = server.call(lambda: engine.frames_encoded_total)
        assert isinstance(encoded_before, int) and isinstance(encoded_after, int) and encoded_after > encoded_before
    finally:
        await peer.close()


async def test_with_auth_on_a_client_secret_starts_a_call_as_the_page_does() -> None:
    """``/static/video-chat.js`` mints a client secret through the page's token URL and posts its offer with it."""
    use_loopback_candidates()
    settings = Settings(
        engine="synthetic",
        omni_model="preset:tiny",
        webrtc_host_addresses=("127.0.0.1",),
        api_key_hashes=(api_key_hash("video-chat-key"),),
    )
    with serve(settings) as keyed:
        async with httpx.AsyncClient(base_url=keyed.http_url, trust_env=False) as client:
            minted = await client.post(
                "/v1/realtime/client_secrets", headers={"Authorization": "Bearer video-chat-key"}, json={}
            )
        assert minted.status_code == 200, minted.text
        peer = Peer()
        try:
            await peer.connect(keyed.http_url + CALLS, {"Authorization": f"Bearer {minted.json()['value']}"})
            peer.send("ping")
            await peer.until(lambda: {"type": "pong"} in peer.events)
        finally:
            await peer.close()


async def test_a_gateway_without_an_omni_model_refuses_the_offer() -> None:
    with serve(Settings(engine="synthetic")) as plain:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("audio", direction="sendrecv")
        await pc.setLocalDescription(await pc.createOffer())
        assert pc.localDescription is not None
        async with httpx.AsyncClient(trust_env=False) as client:
            response = await client.post(
                plain.http_url + CALLS, content=pc.localDescription.sdp, headers={"content-type": "application/sdp"}
            )
        await pc.close()
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "video_chat_unavailable"
