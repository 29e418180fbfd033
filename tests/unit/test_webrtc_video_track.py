"""The WebRTC video track: its frame clock (pure, on given times), frame conversion, queue, credit and idle wake."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import av
import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError

from omnigate.gateway.webrtc.video_track import FrameClock, GeneratedVideoTrack, black_frame, to_video_frames

FAST_FPS = 1000.0  # a frame every millisecond: the tests that call recv() barely wait


def luma(frame: av.VideoFrame) -> np.ndarray:
    return frame.to_ndarray()[: frame.height]


def solid(level: int, count: int, width: int = 16, height: int = 16) -> list[av.VideoFrame]:
    return to_video_frames(np.full((count, height, width, 3), level, dtype=np.uint8))


def test_the_first_frame_is_due_at_once_and_the_next_ones_at_the_rate() -> None:
    clock = FrameClock()
    assert clock.next_due(8) is None
    assert clock.stamp(None, 100.0) == 0
    assert clock.next_due(8) == pytest.approx(100.125)
    assert clock.stamp(100.125, 100.125) == 11_250
    # A frame a little late keeps its slot, so the cadence holds.
    assert clock.stamp(clock.next_due(8), 100.3) == 22_500
    assert clock.late_resets == 0


def test_the_rate_may_change_between_frames() -> None:
    clock = FrameClock()
    clock.stamp(None, 5.0)
    clock.stamp(clock.next_due(8), 5.125)
    due = clock.next_due(16)
    assert due == pytest.approx(5.1875)
    assert clock.stamp(due, 5.1875) == 16_875


def test_a_clock_far_behind_restarts_its_cadence_instead_of_bursting() -> None:
    clock = FrameClock(max_late_s=0.1)
    clock.stamp(None, 0.0)
    due = clock.next_due(10)
    assert due == pytest.approx(0.1)
    assert clock.stamp(due, 2.0) == 180_000  # stamped when sent, not at the missed slot
    assert clock.late_resets == 1
    assert clock.next_due(10) == pytest.approx(2.1)


def test_timestamps_always_increase() -> None:
    clock = FrameClock()
    stamps = [clock.stamp(None, 1.0) for _ in range(3)]
    assert stamps == [0, 1, 2]


def test_frames_are_converted_to_yuv420p_at_their_size() -> None:
    rgb = np.zeros((3, 32, 48, 3), dtype=np.uint8)
    rgb[1] = 255
    frames = to_video_frames(rgb)
    assert [(f.width, f.height, f.format.name) for f in frames] == [(48, 32, "yuv420p")] * 3
    assert luma(frames[0]).max() <= 16 and luma(frames[1]).min() >= 235
    black = black_frame(48, 32)
    assert (black.width, black.height) == (48, 32)
    assert np.all(luma(black) == 16) and np.all(black.to_ndarray()[32:] == 128)


async def test_frames_play_in_order_with_credit_back_then_the_last_one_is_held() -> None:
    track = GeneratedVideoTrack(16, 16, capacity_frames=4)
    first = await track.recv()
    assert (first.width, first.height) == (16, 16) and np.all(luma(first) == 16)  # black before any frame
    played: list[int] = []
    frames = solid(200, 2)
    track.push(frames, FAST_FPS, lambda: played.append(track.queued_frames))
    got: list[av.VideoFrame] = []
    stamps: list[int] = [first.pts or 0]
    for _ in range(3):
        got.append(await track.recv())
        stamps.append(got[-1].pts or 0)
    assert got[0] is frames[0] and got[1] is frames[1] and got[2] is frames[1]
    assert played == [1, 0]  # each frame's credit returns as it leaves the queue
    assert stamps == sorted(set(stamps))  # strictly increasing, also for the repeated frame
    assert all(f.time_base == Fraction(1, 90_000) for f in got)
    assert (track.frames_sent, track.generated_frames_sent, track.underrun_frames) == (4, 2, 1)
    track.finish()
    assert not track.playing


async def test_clear_drops_queued_frames_without_their_credit() -> None:
    track = GeneratedVideoTrack(16, 16, capacity_frames=8)
    await track.recv()
    played: list[None] = []
    shown = solid(100, 1)
    track.push(shown, FAST_FPS, lambda: played.append(None))
    assert await track.recv() is shown[0]
    track.push(solid(200, 3), FAST_FPS, lambda: played.append(None))
    track.clear()
    assert track.queued_frames == 0 and not track.playing
    await track.wait_played()  # nothing left to play
    assert len(played) == 1


async def test_the_producer_waits_for_room_and_is_woken_as_frames_play() -> None:
    track = GeneratedVideoTrack(16, 16, capacity_frames=4)
    await track.recv()
    track.push(solid(50, 3), FAST_FPS, lambda: None)
    await asyncio.wait_for(track.wait_for_room(1), 5)  # 3 + 1 fit
    waiting = asyncio.create_task(track.wait_for_room(4))
    await track.recv()
    await track.recv()
    await track.recv()  # the queue is empty now: a full group may go in
    await asyncio.wait_for(waiting, 5)
    # A group larger than the queue is still taken when the queue is empty, or a small queue would block forever.
    await asyncio.wait_for(track.wait_for_room(9), 5)


async def test_an_idle_track_sends_the_first_frame_of_a_generation_when_it_is_queued() -> None:
    track = GeneratedVideoTrack(16, 16, capacity_frames=4, idle_fps=0.001)  # the next idle tick: in 1000 s
    await track.recv()
    pending = asyncio.create_task(track.recv())
    frames = solid(180, 1)
    track.push(frames, 8, lambda: None)
    assert await asyncio.wait_for(pending, 5) is frames[0]


async def test_a_stopped_track_ends_its_reader_and_wakes_its_producer() -> None:
    track = GeneratedVideoTrack(16, 16, capacity_frames=1, idle_fps=0.001)
    await track.recv()
    idle = asyncio.create_task(track.recv())
    track.push(solid(10, 2), FAST_FPS, lambda: None)
    assert await asyncio.wait_for(idle, 5) is not None
    room = asyncio.create_task(track.wait_for_room(1))
    track.stop()
    await asyncio.wait_for(room, 5)
    with pytest.raises(MediaStreamError):
        await track.recv()
