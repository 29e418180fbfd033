"""The outbound video track of a video call: generated frames, played at their generation's frame rate.

aiortc's sender loops on :meth:`GeneratedVideoTrack.recv`, encodes what it returns (VP8 or H.264, in a worker
thread) and sends it at once, so the track sets the pace: frames leave at the playing generation's fps, stamped on
a 90 kHz clock that keeps counting across generations. When no new frame is due, the last one shown (black before
the first) is sent again, so the stream stays alive: at the generation's rate while it plays (an underrun: decoding
is behind), at :data:`IDLE_FPS` between generations, where the first frame of the next one goes out as soon as it
is queued. Frames wait in a bounded queue; each one's ``on_played`` runs as it leaves the queue, which is where the
call returns the engine's frame credit, so decoding never runs further ahead of playback than that credit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from fractions import Fraction

import av
import numpy as np
import numpy.typing as npt
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

VIDEO_CLOCK_RATE = 90_000
VIDEO_TIME_BASE = Fraction(1, VIDEO_CLOCK_RATE)
# Between generations the held frame is repeated this often: enough to keep the stream alive, little to encode.
IDLE_FPS = 1.0
# A clock more than this late (a stalled loop, a slow encode) moves forward instead of sending a burst of frames.
MAX_LATE_S = 0.1


class FrameClock:
    """When each frame of a track is due, and its 90 kHz timestamp, at a rate that may change from frame to frame.

    Pure (times are passed in), so the pacing is tested without sleeping.
    """

    def __init__(self, max_late_s: float = MAX_LATE_S) -> None:
        self.max_late_s = max_late_s
        self._start: float | None = None
        self._last: float | None = None
        self._pts = -1
        self.late_resets = 0

    def next_due(self, fps: float) -> float | None:
        """When the next frame is due at ``fps``; None for the first frame, which is due at once."""
        return None if self._last is None else self._last + 1.0 / fps

    def stamp(self, due: float | None, now: float) -> int:
        """Record that a frame is sent at ``now`` for the slot ``due`` (None: at once); return its pts.

        A frame sent a little late keeps its slot, so the cadence holds; one more than ``max_late_s`` late restarts
        the cadence at ``now`` (the missed slots are not sent in a burst). Timestamps always increase.
        """
        at = now
        if due is not None:
            if now - due > self.max_late_s:
                self.late_resets += 1
            else:
                at = due
        if self._start is None:
            self._start = at
        self._last = at
        self._pts = max(self._pts + 1, round((at - self._start) * VIDEO_CLOCK_RATE))
        return self._pts


def black_frame(width: int, height: int) -> av.VideoFrame:
    """A black yuv420p frame (luma 16, chroma 128: video-range black)."""
    planes = np.full((height * 3 // 2, width), 128, dtype=np.uint8)
    planes[:height] = 16
    return av.VideoFrame.from_ndarray(planes, format="yuv420p")


def to_video_frames(rgb: npt.NDArray[np.uint8]) -> list[av.VideoFrame]:
    """Decoded RGB frames ``(n, height, width, 3)`` as yuv420p frames, what the VP8 and H.264 encoders take.

    A colour conversion per frame (milliseconds at 480p): call it off the event loop.
    """
    return [av.VideoFrame.from_ndarray(frame, format="rgb24").reformat(format="yuv420p") for frame in rgb]


class GeneratedVideoTrack(MediaStreamTrack):
    """A video track fed with decoded frames by the call and read by aiortc's RTP sender."""

    kind = "video"

    def __init__(self, width: int, height: int, capacity_frames: int, idle_fps: float = IDLE_FPS) -> None:
        super().__init__()
        self.capacity_frames = capacity_frames
        self.idle_fps = idle_fps
        self.clock = FrameClock()
        self._queue: deque[tuple[av.VideoFrame, Callable[[], None]]] = deque()
        self._held = black_frame(width, height)
        self._fps: float | None = None  # the playing generation's rate; None between generations
        self._changed = asyncio.Event()  # frames queued, frames played, or the track stopped
        self.frames_sent = 0
        self.generated_frames_sent = 0
        self.underrun_frames = 0

    @property
    def queued_frames(self) -> int:
        return len(self._queue)

    @property
    def playing(self) -> bool:
        """True from a generation's first queued frame until :meth:`finish` or :meth:`clear`."""
        return self._fps is not None

    def push(self, frames: Sequence[av.VideoFrame], fps: float, on_played: Callable[[], None]) -> None:
        """Queue ``frames`` to play at ``fps``; ``on_played`` runs once for each frame as it leaves the queue."""
        self._fps = fps
        self._queue.extend((frame, on_played) for frame in frames)
        self._changed.set()

    def clear(self) -> None:
        """Drop the queued frames (their ``on_played`` does not run) and stop playing; the last frame shown stays."""
        self._queue.clear()
        self._fps = None
        self._changed.set()

    def finish(self) -> None:
        """The generation's frames have all played: back to the idle rate."""
        self._fps = None

    async def wait_for_room(self, frames: int) -> None:
        """Return once ``frames`` more fit in the queue (or it is empty: a group larger than the queue still goes)."""
        while self._queue and len(self._queue) + frames > self.capacity_frames and self.readyState == "live":
            await self._wait_changed()

    async def wait_played(self) -> None:
        """Return once every queued frame has been sent (or the track stopped)."""
        while self._queue and self.readyState == "live":
            await self._wait_changed()

    async def _wait_changed(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        loop = asyncio.get_running_loop()
        due = self.clock.next_due(self._fps or self.idle_fps)
        if due is not None and not self._queue and self._fps is None:
            # Idle: the next generation's first frame goes out when it is queued, not at the next idle tick.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(due):
                    while not self._queue and self.readyState == "live":
                        await self._wait_changed()
            if self._queue:
                due = None
        elif due is not None and due > loop.time():
            await asyncio.sleep(due - loop.time())
        if self.readyState != "live":
            raise MediaStreamError
        frame = self._next_frame()
        frame.pts = self.clock.stamp(due, loop.time())
        frame.time_base = VIDEO_TIME_BASE
        # aiortc marks a frame it must send as a keyframe; a repeated frame must not stay one.
        frame.pict_type = av.video.frame.PictureType.NONE
        return frame

    def _next_frame(self) -> av.VideoFrame:
        self.frames_sent += 1
        if not self._queue:
            if self._fps is not None:
                self.underrun_frames += 1
            return self._held
        frame, on_played = self._queue.popleft()
        self._held = frame
        self.generated_frames_sent += 1
        on_played()
        self._changed.set()
        return frame

    def stop(self) -> None:
        self._queue.clear()
        self._changed.set()
        super().stop()
