"""The WebRTC speech track (packets, clock, cancel, room), the microphone ring and the ICE options."""

from __future__ import annotations

import asyncio
import socket
from fractions import Fraction

import aioice
import aioice.ice
import av
import numpy as np
import pytest
from aiortc.mediastreams import AudioStreamTrack, MediaStreamError

from omnigate.codecs.rtc_audio import silence_packet
from omnigate.gateway.webrtc.ice import configure_ice
from omnigate.gateway.webrtc.microphone import MicrophoneRing, consume_microphone
from omnigate.gateway.webrtc.track import SpeechTrack


class Epoch:
    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


def payloads(n: int, tag: str) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


async def test_packets_go_out_in_order_with_monotonic_pts_then_silence() -> None:
    track = SpeechTrack(Epoch(), lead_frames=3)
    track.push(0, payloads(3, "a"))
    got = [await track.recv() for _ in range(5)]
    assert [bytes(p) for p in got] == [b"a0", b"a1", b"a2", silence_packet(), silence_packet()]
    assert [p.pts for p in got] == [0, 960, 1920, 2880, 3840]
    assert all(p.time_base == Fraction(1, 48_000) for p in got)
    assert track.frames_sent == 5 and track.audio_frames_sent == 3
    assert track.underrun_frames == 2  # the utterance was not ended: silence inside it is an underrun
    track.end_utterance()
    await track.recv()
    assert track.underrun_frames == 2


async def test_cancel_makes_the_next_frame_silence() -> None:
    epoch = Epoch()
    track = SpeechTrack(epoch)
    track.push(0, payloads(10, "old"))
    assert bytes(await track.recv()) == b"old0"
    epoch.value = 1  # the session's cancel bumped the epoch
    assert bytes(await track.recv()) == silence_packet()
    assert track.queued_frames == 0
    track.push(0, payloads(2, "late"))  # an encode that finished after the cancel
    track.push(1, payloads(1, "new"))
    assert bytes(await track.recv()) == b"new0"
    assert track.underrun_frames == 0


async def test_played_marks_fire_when_their_packets_left_or_were_dropped() -> None:
    epoch = Epoch()
    track = SpeechTrack(epoch)
    fired: list[str] = []
    track.push(0, payloads(2, "a"))
    track.on_played(lambda: fired.append("a"))
    track.push(0, payloads(3, "b"))
    track.on_played(lambda: fired.append("b"))
    await track.recv()
    assert fired == []
    await track.recv()
    assert fired == ["a"]  # a's last packet has left; b's are still queued
    epoch.value = 1  # cancelled: b's packets are dropped, never sent
    assert bytes(await track.recv()) == silence_packet()
    assert fired == ["a", "b"]
    track.on_played(lambda: fired.append("empty"))
    await track.recv()
    assert fired == ["a", "b", "empty"]


async def test_writer_waits_for_room_until_the_clock_takes_packets() -> None:
    track = SpeechTrack(Epoch(), lead_frames=2)
    track.push(0, payloads(4, "p"))
    waiter = asyncio.create_task(track.wait_for_room())
    await track.recv()
    assert not waiter.done()  # 3 queued: still above the lead
    await track.recv()
    await asyncio.wait_for(waiter, 1)
    assert track.queued_frames == 2


async def test_wake_releases_a_writer_on_a_track_that_never_plays() -> None:
    track = SpeechTrack(Epoch(), lead_frames=1)
    track.push(0, payloads(5, "p"))
    waiter = asyncio.create_task(track.wait_for_room())
    await asyncio.sleep(0)
    assert not waiter.done()
    track.wake()
    track.push(0, payloads(5, "q"))  # a push after the wake does not trap the writer again
    await asyncio.wait_for(waiter, 1)
    await asyncio.wait_for(track.wait_for_room(), 1)


async def test_a_stopped_track_ends_the_sender() -> None:
    track = SpeechTrack(Epoch())
    track.stop()
    with pytest.raises(MediaStreamError):
        await track.recv()


def test_microphone_ring_keeps_the_latest_audio() -> None:
    ring = MicrophoneRing(10)
    ring.append(b"abcdef")
    ring.append(b"ghijkl")
    assert len(ring) == 10 and ring.dropped_bytes == 2 and ring.received_bytes == 12
    assert ring.take() == b"cdefghijkl"
    assert len(ring) == 0


async def test_microphone_frames_are_downmixed_to_48k_mono() -> None:
    class Stereo16k(AudioStreamTrack):
        def __init__(self) -> None:
            super().__init__()
            self.sent = 0

        async def recv(self) -> av.AudioFrame:
            if self.sent == 5:
                raise MediaStreamError
            samples = np.full((1, 320 * 2), 1000, dtype="<i2")
            frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="stereo")
            frame.sample_rate = 16_000
            frame.pts = self.sent * 320
            frame.time_base = Fraction(1, 16_000)
            self.sent += 1
            return frame

    ring = MicrophoneRing(1 << 20)
    await consume_microphone(Stereo16k(), ring.append)
    pcm = np.frombuffer(ring.take(), dtype="<i2")
    assert 4000 < pcm.size <= 4800  # 100 ms at 48 kHz, less what the resampler still holds
    assert np.all(np.abs(pcm[100:-100] - 1000) <= 2)


def test_host_addresses_apply_until_restored() -> None:
    before = aioice.ice.get_host_addresses
    restore = configure_ice(["127.0.0.1", "::1"])
    try:
        assert aioice.ice.get_host_addresses(True, False) == ["127.0.0.1"]
        assert aioice.ice.get_host_addresses(True, True) == ["127.0.0.1", "::1"]
    finally:
        restore()
    assert aioice.ice.get_host_addresses is before


def test_bad_ice_options_change_nothing() -> None:
    before = aioice.ice.get_host_addresses
    with pytest.raises(ValueError, match="port range"):
        configure_ice(["127.0.0.1"], (2000, 1000))
    with pytest.raises(ValueError, match="does not appear to be an IP"):
        configure_ice(["not-an-address"])
    assert aioice.ice.get_host_addresses is before


async def test_candidates_bind_inside_the_port_range_skipping_busy_ports() -> None:
    busy = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    busy.bind(("127.0.0.1", 0))
    low = busy.getsockname()[1]
    restore = configure_ice(["127.0.0.1"], (low, low + 1))
    connection = aioice.Connection(ice_controlling=True, components=1)
    try:
        await connection.gather_candidates()
        [candidate] = connection.local_candidates
        assert candidate.host == "127.0.0.1" and candidate.port == low + 1 and candidate.type == "host"
        other = aioice.Connection(ice_controlling=True, components=1)
        await other.gather_candidates()
        assert other.local_candidates == []  # the range is used up: no candidate rather than a port outside it
        await other.close()
    finally:
        await connection.close()
        restore()
        busy.close()
