"""Pictures that cost far more to decode than they weigh, and broken ones: a decompression-bomb corpus for the
routes that decode client images (PNG text and ICC chunks that inflate to megabytes, headers declaring huge
dimensions, truncated files)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png(width: int = 8, height: int = 8, extra: bytes = b"") -> bytes:
    """A grey PNG (all rows zero, so even a huge one is a few kilobytes), ``extra`` chunks before its pixels."""
    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
    compressor = zlib.compressobj(9)
    row = b"\0" * (width + 1)
    pixels = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    return PNG_SIGNATURE + header + extra + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def ztxt_bomb(inflated: int = 2 * 1024 * 1024) -> bytes:
    """A PNG of a few kilobytes whose zTXt chunk inflates to ``inflated`` bytes."""
    return png(extra=chunk(b"zTXt", b"Comment\0\0" + zlib.compress(b"\0" * inflated, 9)))


def iccp_bomb(inflated: int = 2 * 1024 * 1024) -> bytes:
    """A PNG whose ICC profile inflates to ``inflated`` bytes."""
    return png(extra=chunk(b"iCCP", b"icc\0\0" + zlib.compress(b"\0" * inflated, 9)))


def itxt_bomb(inflated: int = 2 * 1024 * 1024) -> bytes:
    """A PNG whose compressed international text inflates to ``inflated`` bytes."""
    return png(extra=chunk(b"iTXt", b"Comment\0\x01\0en\0\0" + zlib.compress(b"a" * inflated, 9)))


def text_bomb(size: int = 1100 * 1024) -> bytes:
    """A PNG carrying ``size`` bytes of plain text (Pillow refuses a tEXt chunk over 1 MB with ValueError)."""
    return png(extra=chunk(b"tEXt", b"Comment\0" + b"a" * size))


def huge_png(side: int = 6000) -> bytes:
    """A PNG declaring ``side`` x ``side`` pixels in a few hundred kilobytes."""
    return png(side, side)


def huge_jpeg_header(side: int = 30_000) -> bytes:
    """A small JPEG whose frame header is rewritten to declare ``side`` x ``side`` pixels."""
    data = bytearray(jpeg(16, 16))
    sof = data.find(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, side, side)
    return bytes(data)


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def corpus() -> dict[str, bytes]:
    """Every bomb and broken picture, by name (each at most a few hundred kilobytes)."""
    return {
        "ztxt_bomb": ztxt_bomb(),
        "iccp_bomb": iccp_bomb(),
        "itxt_bomb": itxt_bomb(),
        "text_over_budget": png(
            extra=chunk(b"tEXt", b"a\0" + b"a" * 100_000) + chunk(b"zTXt", b"b\0\0" + zlib.compress(b"\0" * 200_000))
        ),
        "huge_png": huge_png(),
        "huge_jpeg_header": huge_jpeg_header(),
        "truncated_jpeg": truncated(jpeg(160, 120)),
        "truncated_png": truncated(png(64, 64)),
    }


# The typed refusal each picture of the corpus gets from the frame budget or the decoder.
REFUSALS = {
    "ztxt_bomb": "input_too_large",
    "iccp_bomb": "input_too_large",
    "itxt_bomb": "input_too_large",
    "text_over_budget": "input_too_large",
    "huge_png": "input_too_large",
    "huge_jpeg_header": "input_too_large",
    "truncated_jpeg": "invalid_frame",
    "truncated_png": "invalid_frame",
}
