"""``webrtc``: the speech stream over WebRTC, ``POST /v1/realtime/calls``, with aiortc client peers.

Each session is one peer connection: a receive-only audio transceiver and the ``speech`` data channel, which
carries the same events as ``ws-speech``. The server's track never stops (silence when idle), so audio is counted
in decoded 20 ms frames that are not digital silence: each counts as 20 ms arriving when it was decoded (bytes are
those of the same audio as mono s16le at 48 kHz). TTFA runs to the first such frame. An utterance ends at the first
silent frame after its ``session.done`` (the audio still in flight when the event arrives belongs to it).

Against a server on a loopback address, the client gathers its ICE candidates on loopback too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import aioice.ice
import av
import httpx
import msgspec
import numpy as np
from aiortc import RTCConfiguration, RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from omnigate.loadtest.corpus import word_chunks
from omnigate.loadtest.protocol import (
    CLIENT_ENCODER,
    SERVER_DECODER,
    AudioDoneEvent,
    AudioStartEvent,
    ClientMessage,
    ErrorEvent,
    InputDoneMessage,
    InputTextMessage,
    SessionCloseMessage,
    SessionConfigMessage,
    SessionDoneEvent,
)
from omnigate.loadtest.targets.base import Target, http_url
from omnigate.loadtest.targets.ws_speech import finish_utterance
from omnigate.loadtest.traces import SessionTrace, UtteranceTrace

CALLS_PATH = "/v1/realtime/calls"
SPEECH_CHANNEL = "speech"
TRACK_SAMPLE_RATE = 48_000
_CLOSE_WAIT_S = 5.0

AudioCallback = Callable[[av.AudioFrame, float], None]
EventCallback = Callable[[str, float], None]


def use_loopback_candidates() -> None:
    """Gather ICE host candidates on 127.0.0.1 only, for this process (aioice skips loopback by default)."""
    aioice.ice.get_host_addresses = _loopback_addresses


def _loopback_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    return ["127.0.0.1"] if use_ipv4 else ["::1"]


def is_loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_silent(frame: av.AudioFrame) -> bool:
    """True when every sample is zero (the server's idle track sends Opus silence, which decodes to zeros)."""
    return not np.any(frame.to_ndarray())


def answer_audio_codec(sdp: str) -> str:
    """The first codec of the audio media section of an SDP answer (``opus/48000/2``), or ``none``."""
    in_audio = False
    payloads: list[str] = []
    for line in sdp.splitlines():
        if line.startswith("m="):
            fields = line[2:].split()
            in_audio = fields[:1] == ["audio"]
            payloads = fields[3:] if in_audio else []
        elif in_audio and payloads and line.startswith(f"a=rtpmap:{payloads[0]} "):
            return line.split(" ", 1)[1].strip().lower()
    return "none"


class CallRefused(Exception):
    """The server answered the offer with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class SpeechPeer:
    """An aiortc client of ``POST /v1/realtime/calls``: an audio transceiver and the ``speech`` data channel.

    ``on_audio`` gets every decoded frame of the server's track (s16, stereo, 48 kHz) with its arrival time,
    ``on_event`` every message of the data channel. ``microphone``, when given, is sent to the server.
    ``channel_label`` picks the protocol (``oai-events``: the realtime protocol).
    """

    def __init__(
        self,
        on_event: EventCallback,
        on_audio: AudioCallback,
        microphone: MediaStreamTrack | None = None,
        channel_label: str = SPEECH_CHANNEL,
    ) -> None:
        self._on_event = on_event
        self._on_audio = on_audio
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        if microphone is None:
            self.pc.addTransceiver("audio", direction="recvonly")
        else:
            self.pc.addTransceiver(microphone, direction="sendrecv")
        self.channel: RTCDataChannel = self.pc.createDataChannel(channel_label)
        self.opened = asyncio.Event()
        self.ended = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self.channel.on("open", self.opened.set)
        self.channel.on("close", self.ended.set)
        self.channel.on("message", self._message)
        self.pc.on("track", self._track)
        self.pc.on("connectionstatechange", self._connection_state)

    async def connect(self, client: httpx.AsyncClient, calls_url: str) -> None:
        """Offer, post, apply the answer and wait for the data channel to open. Raises :class:`CallRefused`."""
        await self.pc.setLocalDescription(await self.pc.createOffer())
        offer = self.pc.localDescription
        assert offer is not None
        response = await client.post(calls_url, content=offer.sdp, headers={"content-type": "application/sdp"})
        if response.status_code != 201:
            raise CallRefused(response.status_code, response.text)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=response.text, type="answer"))
        await self.opened.wait()

    def audio_codec(self) -> str:
        """The audio codec of the server's answer (``opus/48000/2``), or ``none`` before one was applied."""
        answer = self.pc.remoteDescription
        return answer_audio_codec(answer.sdp) if answer is not None else "none"

    def send(self, message: ClientMessage) -> None:
        self.channel.send(CLIENT_ENCODER.encode(message).decode())

    def send_json(self, body: dict[str, Any]) -> None:
        self.channel.send(msgspec.json.encode(body).decode())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self.pc.close()

    def _message(self, message: str | bytes) -> None:
        if isinstance(message, str):
            self._on_event(message, time.perf_counter())

    def _connection_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self.ended.set()

    def _track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio" and self._reader is None:
            self._reader = asyncio.create_task(self._read(track))

    async def _read(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            if isinstance(frame, av.AudioFrame):
                self._on_audio(frame, time.perf_counter())


async def wait_unless_ended(event: asyncio.Event, peer: SpeechPeer, timeout_s: float) -> bool:
    """Wait for ``event``; False after ``timeout_s`` or when the call ended first."""
    waiters = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(peer.ended.wait())}
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when="FIRST_COMPLETED")
    finally:
        for waiter in waiters:
            waiter.cancel()
    return event.is_set()


class _Receiving:
    """The utterance in flight and how far its audio has come."""

    def __init__(self, trace: SessionTrace) -> None:
        self.trace = trace
        self.utterance: UtteranceTrace | None = None
        self.server_done = False
        self.last_audio_s: float | None = None
        self.done = asyncio.Event()

    def begin(self, utterance: UtteranceTrace) -> None:
        utterance.sample_rate = TRACK_SAMPLE_RATE
        self.utterance = utterance
        self.server_done = False
        self.last_audio_s = None
        self.done.clear()

    def on_audio(self, frame: av.AudioFrame, now_s: float) -> None:
        utterance = self.utterance
        if utterance is None or utterance.status != "running":
            return
        if not is_silent(frame):
            # Bytes of the same audio as mono s16le at the track rate.
            utterance.audio(now_s, frame.samples * 2 * TRACK_SAMPLE_RATE // frame.sample_rate)
            self.last_audio_s = now_s
        elif self.server_done:
            utterance.finish(self.last_audio_s if self.last_audio_s is not None else now_s, "completed")
            self.done.set()

    def on_event(self, message: str, now_s: float) -> None:
        try:
            event = SERVER_DECODER.decode(message)
        except msgspec.DecodeError as exc:
            self.trace.error("protocol_unknown_event", f"{exc}: {message[:200]}")
            return
        utterance = self.utterance
        if isinstance(event, ErrorEvent):
            self.trace.error(event.code or "server_error", event.message)
        elif utterance is None:
            self.trace.error("protocol_event_outside_utterance")
        elif isinstance(event, AudioStartEvent):
            utterance.unit_started(event.sentence_text, TRACK_SAMPLE_RATE)
        elif isinstance(event, AudioDoneEvent):
            if event.error:
                self.trace.error("audio_done_error")
        elif isinstance(event, SessionDoneEvent):
            if event.status != "completed":
                # Ended early: the audio still in flight does not make it whole.
                finish_utterance(self.trace, utterance, now_s, event)
                self.done.set()
            self.server_done = True


class WebRtcTarget(Target):
    kind = "webrtc"
    _client: httpx.AsyncClient | None = None

    @property
    def calls_url(self) -> str:
        return http_url(self.spec.url, CALLS_PATH)

    async def open(self) -> None:
        if is_loopback_url(self.spec.url):
            use_loopback_candidates()
        # Every call sets up on a connection of its own, as calls from different browsers do: a kept-alive
        # connection would take every call of this client process to the one gateway worker that accepted it.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.settings.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            trust_env=False,
            headers=self.auth_headers(),
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def run_session(self, texts: Sequence[str], trace: SessionTrace) -> None:
        state = _Receiving(trace)
        peer = SpeechPeer(state.on_event, state.on_audio)
        try:
            if await self.connect(peer, trace):
                await self._converse(peer, texts, trace, state)
        finally:
            await peer.close()

    async def connect(self, peer: SpeechPeer, trace: SessionTrace) -> bool:
        """Set up the call and record it; False, with the failure recorded, when it could not be set up."""
        assert self._client is not None, "open() the target first"
        try:
            async with asyncio.timeout(self.settings.connect_timeout_s):
                await peer.connect(self._client, self.calls_url)
        except CallRefused as exc:
            trace.error(f"http_{exc.status}", exc.body)
            return False
        except TimeoutError:
            trace.error("connect_timeout")
            return False
        except (httpx.HTTPError, OSError) as exc:
            trace.error("connect_failed", str(exc))
            return False
        trace.connected(time.perf_counter())
        trace.record_negotiated("audio_codec", peer.audio_codec())
        return True

    async def _converse(self, peer: SpeechPeer, texts: Sequence[str], trace: SessionTrace, state: _Receiving) -> None:
        # The track carries the audio (Opus); the data channel's format setting only shapes the events.
        peer.send(
            SessionConfigMessage(response_format="pcm", stream_audio=True, model=self.spec.model, voice=self.spec.voice)
        )
        for text in texts:
            if not trace.may_begin_utterance(time.perf_counter()):
                break
            utterance = trace.begin_utterance(time.perf_counter(), text)
            state.begin(utterance)
            if not await self._send_text(peer, utterance):
                trace.error("closed_by_server")
                return
            peer.send(InputDoneMessage())
            if not await wait_unless_ended(state.done, peer, self.settings.utterance_timeout_s):
                trace.error("utterance_timeout" if not peer.ended.is_set() else "closed_by_server")
                return
        peer.send(SessionCloseMessage())
        try:
            async with asyncio.timeout(_CLOSE_WAIT_S):
                await peer.ended.wait()
        except TimeoutError:
            trace.error("close_timeout")

    async def _send_text(self, peer: SpeechPeer, utterance: UtteranceTrace) -> bool:
        words_per_second = self.settings.words_per_second
        chunks = word_chunks(utterance.text) if words_per_second > 0 else [utterance.text]
        start_s = time.perf_counter()
        sent_chars = 0
        for index, chunk in enumerate(chunks):
            if words_per_second > 0:
                # A fixed schedule from the start, so slow sends do not stretch the pace.
                await asyncio.sleep(max(0.0, start_s + index / words_per_second - time.perf_counter()))
            if peer.channel.readyState != "open":
                return False
            peer.send(InputTextMessage(text=chunk))
            sent_chars += len(chunk)
            utterance.text_sent(time.perf_counter(), sent_chars)
        return True
