"""Camera frames from JPEG/PNG bytes to the model's pixels, off the event loop, one session's frames in order.

A frame is decoded, centre-cropped to a square and resized to the thinker's frame size; its digest (of those
pixels) keys the session's encoder cache, and a 64x64 grey thumbnail feeds the frame filter.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
from collections.abc import Callable
from typing import TYPE_CHECKING

import av
import numpy as np

from omnigate.engines.omni.request import FrameInput
from omnigate.sessions.video_chat import DecodedFrame

if TYPE_CHECKING:
    from PIL.Image import Image

THUMBNAIL = 64
MAX_PIXELS = 8192 * 8192  # a frame larger than this is refused before it is decoded


class FrameDecodeError(ValueError):
    pass


def decode_frame(data: bytes | av.VideoFrame, frame_size: int) -> DecodedFrame:
    """Decode one JPEG/PNG picture (or convert a WebRTC camera frame). Blocking (milliseconds): run it on a worker
    thread."""
    # Pillow is the models extra's, like the omni engine that frames are for: imported here, on the decoding thread,
    # so a gateway without --omni-model never imports it.
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, av.VideoFrame):
        return _prepare(Image.fromarray(data.to_ndarray(format="rgb24")), frame_size)
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in ("JPEG", "PNG"):
                raise FrameDecodeError(f"video.frame must be JPEG or PNG, not {image.format}")
            if image.width * image.height > MAX_PIXELS:
                raise FrameDecodeError(f"video.frame of {image.width}x{image.height} is too large")
            rgb = image.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise FrameDecodeError(f"video.frame is not a decodable JPEG/PNG picture: {exc}") from None
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


class FrameDecoder:
    """Decodes a session's frames one after another on a worker thread, handing each result back in order.

    The session bounds how many frames may wait (``frame_arrived``), so the queue here never grows past that.
    """

    def __init__(
        self,
        frame_size: int,
        on_frame: Callable[[DecodedFrame], None],
        on_error: Callable[[str], None],
        capacity: int,
    ) -> None:
        self._frame_size = frame_size
        self._on_frame = on_frame
        self._on_error = on_error
        self._queue: asyncio.Queue[bytes | av.VideoFrame] = asyncio.Queue(maxsize=capacity)
        self._task = asyncio.create_task(self._run(), name="video-chat-frames")

    def put(self, data: bytes | av.VideoFrame) -> None:
        self._queue.put_nowait(data)

    async def _run(self) -> None:
        while True:
            data = await self._queue.get()
            try:
                frame = await asyncio.to_thread(decode_frame, data, self._frame_size)
            except FrameDecodeError as exc:
                self._on_error(str(exc))
                continue
            self._on_frame(frame)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
