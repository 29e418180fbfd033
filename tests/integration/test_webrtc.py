"""``POST /v1/realtime/calls`` against the real server (uvloop) with aiortc client peers, all on loopback."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from typing import Any

import av
import httpx
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection
from aiortc.mediastreams import AudioStreamTrack, MediaStreamTrack

from omnigate.engines.piper import PiperEngine
from omnigate.gateway.settings import Settings
from omnigate.gateway.webrtc.call import SPEECH_CHANNEL, WebRtcCall
from omnigate.loadtest.report import TargetSpec
from omnigate.loadtest.targets import SessionSettings
from omnigate.loadtest.targets.webrtc import SpeechPeer, WebRtcTarget, is_silent, use_loopback_candidates
from omnigate.loadtest.traces import SessionTrace
from tests.audio_checks import speech_fraction, synthetic_ms
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration

CALLS = "/v1/realtime/calls"
LOOPBACK = ("127.0.0.1",)
RATE = 48_000
FRAME_BYTES = 960 * 2
SENTENCES = "The quick brown fox jumps over the lazy dog. It ran away into the forest, and nobody saw it again."


class Listener:
    """What a client peer hears and reads: data channel events, and the track as mono s16le at 48 kHz."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.audio = bytearray()  # every audible frame, in order
        self.audible_frames = 0
        self.silent_run = 0  # silent frames since the last audible one
        self.mark_audible = 0
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []

    def on_event(self, message: str, now_s: float) -> None:
        self.events.append(json.loads(message))
        self._wake()

    def on_audio(self, frame: av.AudioFrame, now_s: float) -> None:
        if is_silent(frame):
            self.silent_run += 1
        else:
            stereo = frame.to_ndarray().reshape(-1, 2).astype(np.int32)
            self.audio += (stereo.sum(axis=1) // 2).astype("<i2").tobytes()
            self.audible_frames += 1
            self.silent_run = 0
        self._wake()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def done(self, utterance: int) -> dict[str, Any] | None:
        return next((e for e in self.of("session.done") if e["utterance_index"] == utterance), None)

    def finished(self, utterance: int, silent_frames: int = 10) -> bool:
        """``session.done`` arrived and the audio in flight behind it has played out."""
        return self.done(utterance) is not None and self.silent_run >= silent_frames

    async def until(self, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((predicate, future))
        self._wake()
        await asyncio.wait_for(future, timeout_s)

    def _wake(self) -> None:
        for predicate, future in list(self._waiters):
            if not future.done() and predicate():
                future.set_result(None)
                self._waiters.remove((predicate, future))


@asynccontextmanager
async def call(
    server: RunningServer,
    listener: Listener,
    microphone: MediaStreamTrack | None = None,
    channel_label: str = SPEECH_CHANNEL,
    headers: dict[str, str] | None = None,
) -> AsyncIterator[SpeechPeer]:
    use_loopback_candidates()
    peer = SpeechPeer(listener.on_event, listener.on_audio, microphone, channel_label)
    try:
        async with httpx.AsyncClient(trust_env=False, headers=headers) as client:
            await asyncio.wait_for(peer.connect(client, server.http_url + CALLS), 10)
        yield peer
    finally:
        await peer.close()


async def on_server(server: RunningServer, coroutine: Coroutine[Any, Any, Any], timeout_s: float = 20.0) -> Any:
    """Await a coroutine on the server's loop (the server runs in its own thread)."""
    future = asyncio.run_coroutine_threadsafe(coroutine, server.loop)
    return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)


def live_calls(server: RunningServer) -> list[WebRtcCall]:
    calls: list[WebRtcCall] = server.call(lambda: list(server.app.state.webrtc.calls.values()))  # type: ignore[assignment]
    return calls


def metric(server: RunningServer, name: str) -> float:
    text = str(server.call(lambda: server.app.state.metrics.render().decode()))
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def rtc_piper_server(piper_engine: PiperEngine) -> Iterator[RunningServer]:
    with serve(Settings(webrtc_host_addresses=LOOPBACK), engine=piper_engine) as server:
        yield server


@pytest.fixture(scope="module")
def rtc_synthetic_server() -> Iterator[RunningServer]:
    with serve(Settings(engine="synthetic", webrtc_host_addresses=LOOPBACK)) as server:
        yield server


async def test_speech_arrives_on_the_track(rtc_piper_server: RunningServer) -> None:
    listener = Listener()
    async with call(rtc_piper_server, listener) as peer:
        peer.send_json({"type": "session.config", "voice": "joe"})
        for word in SENTENCES.split():
            peer.send_json({"type": "input.text", "text": word + " "})
        peer.send_json({"type": "input.done"})
        await listener.until(lambda: listener.finished(0))
    start = listener.of("audio.start")[0]
    assert start["format"] == "opus" and start["sample_rate"] == RATE
    # The first unit is short (three words, fewer when the segmenter's timer released it before the next word came).
    assert start["sentence_text"] and SENTENCES.startswith(start["sentence_text"])
    done = listener.done(0)
    assert done is not None and done["status"] == "completed" and done["total_sentences"] >= 2
    assert all(d["total_bytes"] > 0 for d in listener.of("audio.done"))
    assert not listener.of("error")
    duration_s = len(listener.audio) / 2 / RATE
    assert duration_s > 3.0
    assert speech_fraction(bytes(listener.audio), RATE) > 0.5
    await on_server(rtc_piper_server, rtc_piper_server.app.state.webrtc.join())
    assert rtc_piper_server.gateway.registry.active.get("webrtc", 0) == 0


async def test_cancel_silences_the_track_and_the_session_goes_on(rtc_piper_server: RunningServer) -> None:
    listener = Listener()
    async with call(rtc_piper_server, listener) as peer:
        peer.send_json({"type": "session.config", "voice": "joe"})
        peer.send_json({"type": "input.text", "text": " ".join([SENTENCES] * 3)})
        peer.send_json({"type": "input.done"})
        # Half a second of speech has played; piper runs far ahead of real time, so the outbox and track are full.
        await listener.until(lambda: listener.audible_frames >= 25)
        audible_at_cancel = listener.audible_frames
        peer.send_json({"type": "input.cancel"})
        await listener.until(lambda: listener.finished(0, silent_frames=50))
        done = listener.done(0)
        assert done is not None and done["status"] == "cancelled"
        # Only what was already on the wire when the cancel landed: not the 0.5 s the outbox and track held.
        assert listener.audible_frames - audible_at_cancel <= 10
        peer.send_json({"type": "input.text", "text": "Still here."})
        peer.send_json({"type": "input.done"})
        before = listener.audible_frames
        await listener.until(lambda: listener.finished(1))
    second = listener.done(1)
    assert second is not None and second["status"] == "completed"
    assert listener.audible_frames - before > 20
    assert metric(rtc_piper_server, "omnigate_webrtc_cancels_total") >= 1


async def test_microphone_is_consumed_and_a_disconnect_frees_the_session(rtc_synthetic_server: RunningServer) -> None:
    listener = Listener()
    microphone = AudioStreamTrack()  # aiortc's paced silence: a stand-in microphone
    async with call(rtc_synthetic_server, listener, microphone) as peer:
        peer.send_json({"type": "session.config"})
        peer.send_json({"type": "input.text", "text": "A short test sentence."})
        peer.send_json({"type": "input.done"})
        await listener.until(lambda: listener.finished(0))
        [live] = live_calls(rtc_synthetic_server)
        received = rtc_synthetic_server.call(lambda: live.microphone.received_bytes)
        assert isinstance(received, int) and received > 0
        assert len(live.microphone) <= live.microphone.capacity_bytes
        peer.send_json({"type": "input.text", "text": "This one is cut off by the hang-up. " * 5})
        peer.send_json({"type": "input.done"})
        await listener.until(lambda: listener.audible_frames > 30)
    # The client closed its peer connection mid-utterance: the server sees it, ends the call and frees everything.
    await on_server(rtc_synthetic_server, rtc_synthetic_server.app.state.webrtc.join())
    gateway = rtc_synthetic_server.gateway
    assert gateway.registry.active.get("webrtc", 0) == 0
    # Its admission slot is free at once; the stream object itself closes when an engine step it is in ends.
    assert gateway.pool is not None and gateway.pool.admission.active == 0
    assert live.pc.connectionState == "closed"


async def test_a_realtime_channel_beside_speech_is_refused_with_a_typed_error(
    rtc_synthetic_server: RunningServer,
) -> None:
    listener = Listener()
    async with call(rtc_synthetic_server, listener) as peer:
        realtime = peer.pc.createDataChannel("oai-events")
        answers: asyncio.Queue[str] = asyncio.Queue(maxsize=4)
        realtime.on("message", lambda message: answers.put_nowait(message))
        error = json.loads(await asyncio.wait_for(answers.get(), 10))
        # The speech session the call is bound to goes on.
        peer.send_json({"type": "session.config"})
        peer.send_json({"type": "input.text", "text": "Still speaking."})
        peer.send_json({"type": "input.done"})
        await listener.until(lambda: listener.finished(0))
    assert error["type"] == "error"
    assert error["error"]["code"] == "channel_in_use"
    assert error["error"]["type"] == "invalid_request_error"
    done = listener.done(0)
    assert done is not None and done["status"] == "completed"


async def test_speech_protocol_errors_are_typed_and_the_session_survives(rtc_synthetic_server: RunningServer) -> None:
    listener = Listener()
    async with call(rtc_synthetic_server, listener) as peer:
        peer.send_json({"type": "input.text", "text": "before any config"})
        peer.channel.send("not json")
        peer.send_json({"type": "no.such.event"})
        peer.channel.send(b"\x00\x01")
        peer.send_json({"type": "session.config"})
        peer.send_json({"type": "input.text", "text": "Hello."})
        peer.send_json({"type": "input.done"})
        await listener.until(lambda: listener.finished(0))
    codes = [e["code"] for e in listener.of("error")]
    assert codes == ["no_config", "invalid_json", "unknown_event", "invalid_message"]
    done = listener.done(0)
    assert done is not None and done["status"] == "completed"


async def test_bad_offers_are_refused_typed(rtc_synthetic_server: RunningServer) -> None:
    url = rtc_synthetic_server.http_url + CALLS
    data_only = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    data_only.createDataChannel("speech")
    await data_only.setLocalDescription(await data_only.createOffer())
    assert data_only.localDescription is not None
    async with httpx.AsyncClient(trust_env=False) as client:
        wrong_type = await client.post(url, content="v=0", headers={"content-type": "application/json"})
        garbage = await client.post(url, content="hello", headers={"content-type": "application/sdp"})
        no_audio = await client.post(
            url, content=data_only.localDescription.sdp, headers={"content-type": "application/sdp"}
        )
        too_big = await client.post(url, content="a" * 70_000, headers={"content-type": "application/sdp"})
    await data_only.close()
    assert wrong_type.status_code == 415 and wrong_type.json()["error"]["code"] == "unsupported_media_type"
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "invalid_offer"
    assert no_audio.status_code == 400 and "audio" in no_audio.json()["error"]["message"]
    assert too_big.status_code == 413
    assert rtc_synthetic_server.gateway.registry.active.get("webrtc", 0) == 0


async def test_calls_over_the_session_cap_are_refused_with_retry_after() -> None:
    with serve(Settings(engine="synthetic", webrtc_host_addresses=LOOPBACK, max_sessions=1)) as server:
        listener = Listener()
        async with call(server, listener):
            second = Listener()
            with pytest.raises(Exception, match="HTTP 503") as refused:
                async with call(server, second):
                    pass
        assert "server_busy" in str(refused.value)


async def test_a_call_that_never_connects_is_reaped() -> None:
    with serve(Settings(engine="synthetic", webrtc_host_addresses=LOOPBACK, webrtc_ice_timeout_s=0.5)) as server:
        use_loopback_candidates()
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("audio", direction="recvonly")
        await pc.setLocalDescription(await pc.createOffer())
        assert pc.localDescription is not None
        # No candidates: the server has nobody to check, so ICE can only time out.
        offer = "\r\n".join(line for line in pc.localDescription.sdp.split("\r\n") if "a=candidate" not in line)
        async with httpx.AsyncClient(trust_env=False) as client:
            answered = await client.post(
                server.http_url + CALLS, content=offer, headers={"content-type": "application/sdp"}
            )
        assert answered.status_code == 201 and answered.headers["location"].startswith(CALLS + "/rtc_")
        [never] = live_calls(server)
        await on_server(server, server.app.state.webrtc.join())
        await pc.close()
        assert server.gateway.registry.active.get("webrtc", 0) == 0
        assert never.pc.connectionState == "closed"
        assert metric(server, "omnigate_webrtc_ice_timeouts_total") == 1
        assert metric(server, 'omnigate_webrtc_calls_ended_total{reason="ice_timeout"}') == 1


async def test_server_shutdown_closes_live_calls() -> None:
    context = serve(Settings(engine="synthetic", webrtc_host_addresses=LOOPBACK))
    server = context.__enter__()
    try:
        listener = Listener()
        async with call(server, listener) as peer:
            peer.send_json({"type": "session.config"})
            peer.send_json({"type": "input.text", "text": "Speaking while the server stops. " * 4})
            peer.send_json({"type": "input.done"})
            await listener.until(lambda: listener.audible_frames > 5)
            [live] = live_calls(server)
            await asyncio.to_thread(context.__exit__, None, None, None)
            await asyncio.wait_for(peer.ended.wait(), 10)
        assert live.pc.connectionState == "closed"
        assert [e["code"] for e in listener.of("error")] == ["shutting_down"]
        done = listener.done(0)
        assert done is not None and done["status"] == "cancelled"
    finally:
        await asyncio.to_thread(context.__exit__, None, None, None)


async def test_ice_binds_in_the_configured_port_range() -> None:
    low, high = 47_100, 47_163
    with serve(Settings(engine="synthetic", webrtc_host_addresses=LOOPBACK, webrtc_udp_ports=(low, high))) as server:
        listener = Listener()
        async with call(server, listener) as peer:
            assert peer.pc.remoteDescription is not None
            answer = peer.pc.remoteDescription.sdp
            peer.send_json({"type": "session.config"})
            peer.send_json({"type": "input.text", "text": "Through the port range."})
            peer.send_json({"type": "input.done"})
            await listener.until(lambda: listener.finished(0))
    ports = [int(m) for m in re.findall(r"a=candidate:\S+ \d+ udp \d+ \S+ (\d+) typ host", answer)]
    assert ports and all(low <= port <= high for port in ports)
    assert listener.audible_frames > 20


async def test_the_loadtest_target_measures_what_it_hears(rtc_synthetic_server: RunningServer) -> None:
    text = "Twenty characters!!."
    target = WebRtcTarget(
        TargetSpec(label="webrtc", target="webrtc", url=rtc_synthetic_server.http_url),
        SessionSettings(words_per_second=0),
    )
    trace = SessionTrace(0, time.perf_counter())
    await target.open()
    try:
        await target.run_session([text, text], trace)
    finally:
        await target.close()
    trace.end(time.perf_counter())
    assert trace.status == "completed", trace.error_details
    assert trace.negotiated == {"audio_codec": "opus/48000/2"}
    for utterance in trace.utterances:
        assert utterance.status == "completed"
        ttfa_ms = utterance.ttfa_ms()
        assert ttfa_ms is not None and ttfa_ms > 0
        # Whole 20 ms frames: the audio, its last frame padded, and the frame carrying the codec's lookahead.
        assert synthetic_ms(text) <= utterance.audio_ms <= synthetic_ms(text) + 60
        assert utterance.bytes == utterance.audio_ms * 96  # mono s16le at 48 kHz
        assert len(utterance.gaps_ms()) == len(utterance.arrivals) - 1
