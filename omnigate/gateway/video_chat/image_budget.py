"""The budget a camera frame is checked against before it is decoded (sans-I/O).

A frame's bytes come from the client: a few kilobytes may declare a picture of gigapixels, or hold a text or ICC
chunk that inflates to megabytes. Each cost is bounded before the step that pays it: the bytes before anything, the
PNG's compressed text and ICC chunks (inflated here at most to the budget) before Pillow reads them, and the pixel
count from the header before the pixels are decoded.
"""

from __future__ import annotations

import struct
import zlib

import msgspec

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Chunks Pillow inflates or keeps as text while it opens a PNG, before any pixel is decoded.
_TEXT_CHUNKS = frozenset({b"tEXt", b"zTXt", b"iTXt", b"iCCP"})


class FrameBudget(msgspec.Struct, frozen=True):
    """What one frame may cost."""

    max_bytes: int = 10 * 1024 * 1024  # the encoded picture
    max_pixels: int = 3840 * 2160  # the header's width x height (a 4K camera frame)
    max_text_bytes: int = 256 * 1024  # a PNG's text and ICC chunks, inflated, all together


class FrameRefused(ValueError):
    """A frame refused with a wire code (``invalid_frame``: not a picture; ``input_too_large``: over the budget)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def check_size(data: bytes, budget: FrameBudget) -> None:
    if len(data) > budget.max_bytes:
        raise FrameRefused("input_too_large", f"video.frame of {len(data)} bytes exceeds {budget.max_bytes} bytes")


def check_pixels(width: int, height: int, budget: FrameBudget) -> None:
    if width * height > budget.max_pixels:
        raise FrameRefused(
            "input_too_large", f"video.frame of {width}x{height} exceeds {budget.max_pixels} pixels; send it smaller"
        )


def check_png_text(data: bytes, budget: FrameBudget) -> None:
    """Refuse a PNG whose text and ICC chunks hold more than ``budget.max_text_bytes`` once inflated.

    Walks every chunk header, wherever it stands (Pillow reads text before and after the pixels); a truncated or
    malformed chunk list is left for the decoder to refuse. Inflating stops at the budget, so this costs at most
    that much.
    """
    left = budget.max_text_bytes
    at = len(PNG_SIGNATURE)
    while at + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, at)
        body = data[at + 8 : at + 8 + length]
        at += 12 + length
        if kind not in _TEXT_CHUNKS:
            continue
        left -= _text_size(kind, body, left)
        if left < 0:
            raise FrameRefused(
                "input_too_large",
                f"video.frame's PNG text and ICC chunks exceed {budget.max_text_bytes} bytes once inflated",
            )


def _text_size(kind: bytes, body: bytes, limit: int) -> int:
    """The chunk's text once inflated, counted up to ``limit + 1``."""
    name_end = body.find(b"\0")
    if kind == b"tEXt" or name_end < 0:
        return len(body)
    if kind == b"iTXt":
        # keyword \0 compressed-flag method language \0 translated-keyword \0 text
        flag = body[name_end + 1 : name_end + 2]
        language_end = body.find(b"\0", name_end + 3)
        keyword_end = body.find(b"\0", language_end + 1) if language_end >= 0 else -1
        if flag != b"\x01" or keyword_end < 0:
            return len(body)
        return _inflated_size(body[keyword_end + 1 :], limit)
    # zTXt and iCCP: name \0 method compressed-data
    return _inflated_size(body[name_end + 2 :], limit)


def _inflated_size(compressed: bytes, limit: int) -> int:
    try:
        return len(zlib.decompressobj().decompress(compressed, limit + 1))
    except zlib.error:
        return 0  # not inflatable: the decoder refuses it as corrupt
