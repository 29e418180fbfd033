"""Camera frames from JPEG/PNG bytes to the model's pixels: on the server's image-decode pool, under a budget, one
session's frames in order.

A frame is checked against its :class:`~omnigate.gateway.video_chat.image_budget.FrameBudget` (bytes, PNG text and
ICC chunks, the header's pixel count) before it is decoded; a JPEG is decoded at the smallest scale that still covers
the model's frame. Then it is centre-cropped to a square and resized to the thinker's frame size; its digest (of
those pixels) keys the session's encoder cache, and a 64x64 grey thumbnail feeds the frame filter.

Decoding runs on a pool of its own (:class:`FrameDecodePool`, threads ``omnigate-image-decode``), never on the
loop's default pool, where the audio encoders run: a flood of large pictures waits for the image threads only. The
pool also bounds the frames every session together hold for it, so a flood is refused, never queued without bound.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import av
import numpy as np

from omnigate.engines.omni.request import FrameInput
from omnigate.gateway.video_chat.image_budget import (
    PNG_SIGNATURE,
    FrameBudget,
    FrameRefused,
    check_pixels,
    check_png_text,
    check_size,
)
from omnigate.os_threads import named_executor
from omnigate.sessions.video_chat import DecodedFrame

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger(__name__)

THUMBNAIL = 64
THREAD_PREFIX = "omnigate-image-decode"


# A camera frame as it arrives: a WebRTC camera frame, or a JPEG/PNG picture (as bytes, or as the base64 text of the
# WebSocket's ``video.frame``, decoded here, off the event loop).
EncodedFrame = bytes | str | av.VideoFrame


def decode_frame(data: EncodedFrame, frame_size: int, budget: FrameBudget) -> DecodedFrame:
    """Decode one JPEG/PNG picture (or convert a WebRTC camera frame). Blocking (milliseconds): run it on a worker
    thread. Raises :class:`FrameRefused` for anything it will not or cannot decode."""
    # Pillow is the models extra's, like the omni engine that frames are for: imported here, on the decoding thread,
    # so a gateway without --omni-model never imports it.
    from PIL import Image

    if isinstance(data, av.VideoFrame):
        check_pixels(data.width, data.height, budget)
        return _prepare(Image.fromarray(data.to_ndarray(format="rgb24")), frame_size)
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise FrameRefused("invalid_base64", "video.frame's data is not valid base64") from None
    check_size(data, budget)
    if data.startswith(PNG_SIGNATURE):
        check_png_text(data, budget)
    try:
        with Image.open(io.BytesIO(data), formats=("JPEG", "PNG")) as image:
            check_pixels(image.width, image.height, budget)
            if image.format == "JPEG":
                image.draft("RGB", (frame_size, frame_size))  # DCT scaling: a 4K frame decodes at 1/4 or 1/8
            rgb = image.convert("RGB")
    except FrameRefused:
        raise
    except Image.DecompressionBombError as exc:  # a header Pillow itself will not open (over 2 x MAX_IMAGE_PIXELS)
        raise FrameRefused("input_too_large", f"video.frame is too large: {exc}") from None
    # Pillow answers hostile bytes with many exception types (OSError, ValueError, SyntaxError, struct.error, ...).
    except Exception as exc:
        raise FrameRefused("invalid_frame", f"video.frame is not a decodable JPEG/PNG picture: {exc}") from None
    return _prepare(rgb, frame_size)


def _prepare(rgb: Image, frame_size: int) -> DecodedFrame:
    from PIL.Image import Resampling

    side = min(rgb.width, rgb.height)
    left, top = (rgb.width - side) // 2, (rgb.height - side) // 2
    square = rgb.crop((left, top, left + side, top + side))
    pixels = np.asarray(square.resize((frame_size, frame_size), Resampling.BILINEAR), dtype=np.uint8)
    thumbnail = square.convert("L").resize((THUMBNAIL, THUMBNAIL), Resampling.BILINEAR).tobytes()
    digest = hashlib.blake2b(pixels.tobytes(), digest_size=16).digest()
    return DecodedFrame(FrameInput(digest, pixels), thumbnail)


class FrameDecodePool:
    """The server's frame decoding: its threads, the budget of one frame, and the frames all sessions hold for it
    (received, not yet decoded) bounded by ``max_frames``."""

    def __init__(self, threads: int, max_frames: int, budget: FrameBudget) -> None:
        self.budget = budget
        self.max_frames = max_frames
        self.held = 0
        self._executor = named_executor(threads, THREAD_PREFIX)

    @property
    def has_room(self) -> bool:
        return self.held < self.max_frames

    def reserve(self) -> None:
        self.held += 1

    def release(self, count: int = 1) -> None:
        self.held = max(0, self.held - count)

    async def decode(self, data: EncodedFrame, frame_size: int) -> DecodedFrame:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, decode_frame, data, frame_size, self.budget)

    def close(self) -> None:
        """Stop the threads (a decode in progress finishes; queued ones are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


class FrameDecoder:
    """Decodes a session's frames one after another on the pool, handing each result back in order.

    The session bounds how many frames may wait (``frame_arrived``), so the queue here never grows past that. Every
    decode failure is a refusal of that frame (``on_refused``) and the session goes on; if the decoder itself ends
    for any other reason, ``on_died`` is told once, so the session ends instead of waiting for frames forever.
    """

    def __init__(
        self,
        pool: FrameDecodePool,
        frame_size: int,
        on_frame: Callable[[DecodedFrame], None],
        on_refused: Callable[[str, str], None],
        on_died: Callable[[str], None],
        capacity: int,
    ) -> None:
        self._pool = pool
        self._frame_size = frame_size
        self._on_frame = on_frame
        self._on_refused = on_refused
        self._on_died = on_died
        self._held = 0  # frames of this session counted in the pool's ``held``
        self._queue: asyncio.Queue[EncodedFrame] = asyncio.Queue(maxsize=capacity)
        self._task = asyncio.create_task(self._run(), name="video-chat-frames")
        self._task.add_done_callback(self._ended)

    @property
    def has_room(self) -> bool:
        """Whether the server takes another frame to decode."""
        return self._pool.has_room

    def put(self, data: EncodedFrame) -> None:
        self._queue.put_nowait(data)
        self._pool.reserve()
        self._held += 1

    async def _run(self) -> None:
        while True:
            data = await self._queue.get()
            try:
                frame = await self._pool.decode(data, self._frame_size)
            except FrameRefused as exc:
                self._on_refused(exc.code, exc.message)
                continue
            finally:
                self._held -= 1
                self._pool.release()
            self._on_frame(frame)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        log.error("a video-chat frame decoder stopped", exc_info=error)
        self._on_died(f"the frame decoder stopped: {type(error).__name__}: {error}")

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.wait([self._task])  # a task that died already has told on_died
        self._pool.release(self._held)
        self._held = 0
