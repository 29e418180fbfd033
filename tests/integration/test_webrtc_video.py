"""``POST /v1/realtime/video/calls`` against the real server (tiny random-weight Wan preset on the CPU) with aiortc
client peers on loopback: events on the ``video`` data channel, VP8 frames decoded from the video track.

Order is asserted from the engine's own timeline, which ``video.done`` reports, never from elapsed time. Where a test
waits for the server to reach a state, it polls that state with a deadline that only bounds a failing run.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import av
import httpx
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from omnigate.engines.video.engine import VideoEngine
from omnigate.gateway.settings import Settings
from omnigate.gateway.webrtc.video_call import TRANSPORT, VideoCall
from omnigate.loadtest.targets.webrtc import CallRefused, use_loopback_candidates
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration

VIDEO_CALLS = "/v1/realtime/video/calls"
LOOPBACK = ("127.0.0.1",)
# 96x64 (the tiny preset's default is 64x64, which the track shows black before the first generation).
CLIP = {"prompt": "a red fox in the snow", "width": 96, "height": 64, "num_frames": 17, "fps": 16, "steps": 2}
SHORT = {**CLIP, "num_frames": 5}
# Decoded frames of the random-weight model are noise; the track's black frame is flat.
NOISE_LUMA_STD = 5.0


class ReceivedFrame:
    def __init__(self, frame: av.VideoFrame, events_before: int) -> None:
        self.width = frame.width
        self.height = frame.height
        self.luma_std = float(frame.to_ndarray(format="gray").std())
        self.events_before = events_before  # data channel events received before this frame


class VideoPeer:
    """An aiortc client of the video calls route: a receive-only video transceiver and the ``video`` data channel."""

    def __init__(self, channel_label: str = "video") -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.pc.addTransceiver("video", direction="recvonly")
        self.channel = self.pc.createDataChannel(channel_label)
        self.events: list[dict[str, Any]] = []
        self._taken: Counter[str] = Counter()  # events of each kind returned by next_event
        self.frames: list[ReceivedFrame] = []
        self.opened = asyncio.Event()
        self.ended = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self.channel.on("open", self.opened.set)
        self.channel.on("close", self.ended.set)
        self.channel.on("message", self._on_message)
        self.pc.on("track", self._on_track)

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        assert self.pc.localDescription is not None
        return self.pc.localDescription.sdp

    async def connect(self, url: str) -> None:
        async with httpx.AsyncClient(trust_env=False) as client:
            response = await client.post(url, content=await self.offer(), headers={"content-type": "application/sdp"})
        if response.status_code != 201:
            raise CallRefused(response.status_code, response.text)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=response.text, type="answer"))
        await asyncio.wait_for(self.opened.wait(), 10)

    def send(self, event_type: str, **fields: Any) -> None:
        self.channel.send(json.dumps({"type": event_type, **fields}))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def noise_frames(self, width: int, height: int) -> list[ReceivedFrame]:
        """Frames of that size that are not the flat black the track shows before any video."""
        return [f for f in self.frames if (f.width, f.height) == (width, height) and f.luma_std > NOISE_LUMA_STD]

    async def until(self, predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((predicate, future))
        self._wake()
        await asyncio.wait_for(future, timeout_s)

    async def next_event(self, kind: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """The next event of ``kind`` not yet taken (it may have arrived already)."""
        index = self._taken[kind]
        await self.until(lambda: len(self.of(kind)) > index, timeout_s)
        self._taken[kind] += 1
        return self.of(kind)[index]

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self.pc.close()

    def _on_message(self, message: str | bytes) -> None:
        assert isinstance(message, str)
        self.events.append(json.loads(message))
        self._wake()

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "video" and self._reader is None:
            self._reader = asyncio.create_task(self._read(track))

    async def _read(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            assert isinstance(frame, av.VideoFrame)
            self.frames.append(ReceivedFrame(frame, len(self.events)))
            self._wake()

    def _wake(self) -> None:
        for predicate, future in list(self._waiters):
            if not future.done() and predicate():
                future.set_result(None)
                self._waiters.remove((predicate, future))


@asynccontextmanager
async def video_call(server: RunningServer) -> AsyncIterator[VideoPeer]:
    use_loopback_candidates()
    peer = VideoPeer()
    try:
        await peer.connect(server.http_url + VIDEO_CALLS)
        yield peer
    finally:
        await peer.close()


def rtc_video_settings(**overrides: Any) -> Settings:
    options = {"max_sessions": "1", "max_frames_in_flight": "5", "max_video_pixels": str(96 * 64 * 17)}
    return Settings(
        engine="synthetic",
        video_model="preset:tiny",
        video_options=options,
        webrtc_host_addresses=LOOPBACK,
        **overrides,
    )


@pytest.fixture(scope="module")
def rtc_video_server() -> Iterator[RunningServer]:
    with serve(rtc_video_settings()) as server:
        yield server


def video_engine(server: RunningServer) -> VideoEngine:
    engine: VideoEngine = server.app.state.video_engine
    return engine


def live_video_calls(server: RunningServer) -> list[VideoCall]:
    calls = server.call(lambda: list(server.app.state.webrtc.calls.values()))
    assert isinstance(calls, list)
    return [c for c in calls if isinstance(c, VideoCall)]


async def on_server(server: RunningServer, coroutine: Any, timeout_s: float = 30.0) -> Any:
    """Await a coroutine on the server's loop (the server runs in its own thread)."""
    future = asyncio.run_coroutine_threadsafe(coroutine, server.loop)
    return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)


async def wait_until(server: RunningServer, predicate: Callable[[], bool], limit_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not server.call(predicate):
        if loop.time() > deadline:
            raise AssertionError("the server never reached the expected state")
        await asyncio.sleep(0.02)


async def test_generated_frames_play_on_the_track_as_they_are_decoded(rtc_video_server: RunningServer) -> None:
    async with video_call(rtc_video_server) as peer:
        peer.send("video.create", **CLIP, seed=1)
        start = await peer.next_event("video.start")
        done = await peer.next_event("video.done")
        # The frames played before video.done have arrived by now or are a few milliseconds behind it.
        await peer.until(lambda: len(peer.noise_frames(96, 64)) >= 2)
        [live] = live_video_calls(rtc_video_server)
    assert start["mime"] == "video/VP8"
    assert (start["width"], start["height"], start["fps"], start["num_frames"], start["seed"]) == (96, 64, 16, 17, 1)
    assert (done["status"], done["frames"]) == ("completed", 17)
    assert "bytes" not in done  # the track's encoder is aiortc's: the gateway counts frames, not bytes
    assert not peer.of("error")
    # Before the video, the track showed black at the engine's default size; the video's frames came after video.start.
    assert any((f.width, f.height) == (64, 64) and f.luma_std < 1.0 for f in peer.frames)
    start_index = peer.events.index(start)
    assert all(f.events_before > start_index for f in peer.noise_frames(96, 64))
    # Frame credit returns as frames play: with 5 frames of credit the engine cannot have decoded more than two of
    # the five latent frames before the first frame played, so it played before the last latent frame was decoded.
    assert done["stats"]["latent_frames"] == 5
    assert done["stats"]["decoded_before_first_send"] < 5
    track = live.track
    assert rtc_video_server.call(lambda: track.generated_frames_sent) == 17


async def test_a_bad_create_gets_one_typed_error_and_the_call_keeps_working(rtc_video_server: RunningServer) -> None:
    engine = video_engine(rtc_video_server)
    work_before = rtc_video_server.call(lambda: (engine.prompts_encoded, engine.steps_run))
    async with video_call(rtc_video_server) as peer:
        bad: list[tuple[dict[str, Any], str, str | None]] = [
            ({**CLIP, "width": 60}, "invalid_size", "width"),
            ({**CLIP, "num_frames": 8}, "invalid_frames", "num_frames"),
            ({**CLIP, "num_frames": 21}, "too_large", "num_frames"),
            ({**CLIP, "steps": "two"}, "invalid_event", "steps"),
            ({"width": 64}, "invalid_event", "prompt"),
            ({**CLIP, "model": "sora"}, "model_not_found", "model"),
        ]
        for fields, code, param in bad:
            peer.send("video.create", **fields)
            error = await peer.next_event("error")
            assert (error["code"], error.get("param")) == (code, param), error
        peer.channel.send("{not json")
        assert (await peer.next_event("error"))["code"] == "invalid_json"
        peer.send("video.make")
        assert (await peer.next_event("error"))["code"] == "unknown_event"
        peer.channel.send(b"\x00\x01")
        assert (await peer.next_event("error"))["code"] == "invalid_message"
        assert rtc_video_server.call(lambda: (engine.prompts_encoded, engine.steps_run)) == work_before
        peer.send("video.create", **SHORT, seed=2)
        done = await peer.next_event("video.done")
    assert len(peer.of("error")) == len(bad) + 3  # one each, nothing more
    assert (done["status"], done["frames"]) == ("completed", 5)


async def test_cancel_mid_way_leaves_nothing_behind_and_the_next_video_plays(rtc_video_server: RunningServer) -> None:
    engine = video_engine(rtc_video_server)
    async with video_call(rtc_video_server) as peer:
        # A hundred denoising steps: the cancel, sent right behind the create, lands long before they are done.
        peer.send("video.create", **{**CLIP, "steps": 100}, seed=3)
        peer.send("video.cancel")
        start = await peer.next_event("video.start")
        done = await peer.next_event("video.done")
        assert start["num_frames"] == 17
        assert (done["status"], done["frames"]) == ("cancelled", 0)
        # video.done leaves after the engine freed the slot and the generation's tensors.
        assert rtc_video_server.call(lambda: (engine.active, engine.free_slots)) == (0, 1)
        peer.send("video.cancel")  # nothing to cancel: ignored
        peer.send("video.create", **SHORT, seed=4)
        done = await peer.next_event("video.done")
        assert (done["status"], done["frames"]) == ("completed", 5)
        peer.send("session.close")
        await asyncio.wait_for(peer.ended.wait(), 10)
    await on_server(rtc_video_server, rtc_video_server.app.state.webrtc.join())
    assert rtc_video_server.gateway.registry.total_active == 0
    assert not peer.of("error")


async def test_a_peer_closing_mid_generation_frees_everything(rtc_video_server: RunningServer) -> None:
    engine = video_engine(rtc_video_server)
    cancelled_before = engine.finished_total["cancelled"]  # counted by the engine thread; nothing runs now
    async with video_call(rtc_video_server) as peer:
        peer.send("video.create", **{**CLIP, "steps": 100}, seed=5)
        await peer.next_event("video.start")
        [live] = live_video_calls(rtc_video_server)
    # The client closed its peer connection mid-generation: the server sees it, ends the call and frees everything.
    await on_server(rtc_video_server, rtc_video_server.app.state.webrtc.join())
    await wait_until(rtc_video_server, lambda: engine.active == 0)
    assert engine.finished_total["cancelled"] == cancelled_before + 1
    assert rtc_video_server.gateway.registry.active.get(TRANSPORT, 0) == 0
    assert live.pc.connectionState == "closed"
    assert rtc_video_server.call(lambda: live.job) is None


async def test_a_second_generation_over_the_engine_slots_is_refused_typed(rtc_video_server: RunningServer) -> None:
    async with video_call(rtc_video_server) as first, video_call(rtc_video_server) as second:
        first.send("video.create", **{**CLIP, "steps": 100}, seed=6)
        await first.next_event("video.start")
        second.send("video.create", **SHORT, seed=7)
        error = await second.next_event("error")
        assert error["code"] == "server_busy" and error["retry_after"] > 0
        first.send("video.create", **SHORT, seed=8)
        assert (await first.next_event("error"))["code"] == "busy"  # one generation at a time per call
        first.send("video.cancel")
        assert (await first.next_event("video.done"))["status"] == "cancelled"
        second.send("video.create", **SHORT, seed=9)
        assert (await second.next_event("video.done"))["status"] == "completed"


async def test_offers_are_checked_and_a_gateway_without_video_refuses_typed(
    rtc_video_server: RunningServer, synthetic_server: RunningServer
) -> None:
    use_loopback_candidates()
    audio_only = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    audio_only.addTransceiver("audio", direction="recvonly")
    audio_only.createDataChannel("video")
    await audio_only.setLocalDescription(await audio_only.createOffer())
    assert audio_only.localDescription is not None
    peer = VideoPeer()
    video_offer = await peer.offer()
    headers = {"content-type": "application/sdp"}
    async with httpx.AsyncClient(trust_env=False) as client:
        no_video = await client.post(
            rtc_video_server.http_url + VIDEO_CALLS, content=audio_only.localDescription.sdp, headers=headers
        )
        unserved = await client.post(synthetic_server.http_url + VIDEO_CALLS, content=video_offer, headers=headers)
    await audio_only.close()
    await peer.close()
    assert no_video.status_code == 400 and "video" in no_video.json()["error"]["message"]
    assert unserved.status_code == 503 and unserved.json()["error"]["code"] == "video_unavailable"
    for server in (rtc_video_server, synthetic_server):
        assert server.gateway.registry.active.get(TRANSPORT, 0) == 0


async def test_server_shutdown_ends_the_generation_and_the_call() -> None:
    context = serve(rtc_video_settings())
    server = context.__enter__()
    try:
        async with video_call(server) as peer:
            peer.send("video.create", **{**CLIP, "steps": 100}, seed=10)
            await peer.next_event("video.start")
            [live] = live_video_calls(server)
            await asyncio.to_thread(context.__exit__, None, None, None)
            await asyncio.wait_for(peer.ended.wait(), 10)
        assert live.pc.connectionState == "closed"
        done = peer.of("video.done")
        assert [d["status"] for d in done] == ["cancelled"]
        assert [e["code"] for e in peer.of("error")] == ["shutting_down"]
    finally:
        await asyncio.to_thread(context.__exit__, None, None, None)


async def test_a_call_that_never_connects_is_reaped() -> None:
    with serve(rtc_video_settings(webrtc_ice_timeout_s=0.5)) as server:
        use_loopback_candidates()
        peer = VideoPeer()
        # No candidates: the server has nobody to check, so ICE can only time out.
        offer = "\r\n".join(line for line in (await peer.offer()).split("\r\n") if "a=candidate" not in line)
        async with httpx.AsyncClient(trust_env=False) as client:
            answered = await client.post(
                server.http_url + VIDEO_CALLS, content=offer, headers={"content-type": "application/sdp"}
            )
        assert answered.status_code == 201 and answered.headers["location"].startswith(VIDEO_CALLS + "/rtc_")
        [never] = live_video_calls(server)
        await on_server(server, server.app.state.webrtc.join())
        await peer.close()
        assert server.gateway.registry.active.get(TRANSPORT, 0) == 0
        assert never.pc.connectionState == "closed"
        assert never.end_reason == "ice_timeout"


async def test_a_live_stream_plays_on_the_track_and_follows_a_new_prompt() -> None:
    # Three seconds of live video at 16 fps: 48 frames in chunks of 9, 12, 12, 12 and the last 3.
    settings = Settings(
        engine="synthetic",
        video_model="preset:tiny-causal",
        video_options={"max_live_seconds": "3"},
        webrtc_host_addresses=LOOPBACK,
    )
    with serve(settings) as server:
        async with video_call(server) as peer:
            live = {key: value for key, value in CLIP.items() if key != "num_frames"}
            peer.send("video.create", **live, live=True, seed=1)
            start = await peer.next_event("video.start")
            first = await peer.next_event("video.chunk")
            peer.send("video.prompt", prompt="a grey wolf under the moon")
            accepted = await peer.next_event("video.prompt.accepted")
            updated = await peer.next_event("video.prompt.updated")
            done = await peer.next_event("video.done")
            await peer.until(lambda: len(peer.noise_frames(96, 64)) >= 2)
    assert (start["live"], start["num_frames"]) == (True, None)
    assert (first["index"], first["frames"], first["prompt_id"]) == (0, 9, 0)
    assert accepted["prompt_id"] == updated["prompt_id"] == 1
    chunks = peer.of("video.chunk")
    # The chunk after the first may have been under way when the prompt came; the one after it has the new prompt.
    assert updated["chunk_index"] <= 2
    assert peer.events.index(updated) < peer.events.index(chunks[updated["chunk_index"]])
    assert [c["prompt_id"] for c in chunks] == [int(c["index"] >= updated["chunk_index"]) for c in chunks]
    assert [c["frames"] for c in chunks] == [9, 12, 12, 12, 3]
    assert (done["status"], done["code"], done["frames"]) == ("completed", "max_duration", 48)
    assert not peer.of("error")
