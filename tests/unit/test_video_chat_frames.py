"""Camera frame decoding under its budget: every bomb and broken picture of the corpus is refused typed before the
step it would make expensive; a decoder that dies tells its session."""

from __future__ import annotations

import asyncio
import zlib

import pytest

from omnigate.gateway.video_chat.frames import FrameDecodePool, FrameDecoder, decode_frame
from omnigate.gateway.video_chat.image_budget import FrameBudget, FrameRefused, check_png_text
from omnigate.sessions.video_chat import DecodedFrame
from tests import image_bombs

BUDGET = FrameBudget()


@pytest.mark.parametrize("name", sorted(image_bombs.REFUSALS))
def test_every_bomb_and_broken_picture_is_refused_typed(name: str) -> None:
    with pytest.raises(FrameRefused) as refused:
        decode_frame(image_bombs.corpus()[name], 56, BUDGET)
    assert refused.value.code == image_bombs.REFUSALS[name], refused.value.message


def test_text_pillow_refuses_with_value_error_is_a_typed_refusal() -> None:
    # 70 zTXt chunks of 1 MB each: within a budget this loose, past Pillow's own 64 MB of text (ValueError)
    megabyte = image_bombs.chunk(b"zTXt", b"c\0\0" + zlib.compress(b"\0" * (1024 * 1024 - 64), 9))
    data = image_bombs.png(extra=megabyte * 70)
    with pytest.raises(FrameRefused) as refused:
        decode_frame(data, 56, FrameBudget(max_text_bytes=128 * 1024 * 1024))
    assert refused.value.code == "invalid_frame" and "MAX_TEXT_MEMORY" in refused.value.message


def test_text_within_the_budget_passes_and_inflating_stops_at_the_budget() -> None:
    check_png_text(image_bombs.ztxt_bomb(inflated=1000), FrameBudget(max_text_bytes=1000))
    with pytest.raises(FrameRefused):
        check_png_text(image_bombs.ztxt_bomb(inflated=1001), FrameBudget(max_text_bytes=1000))


def test_a_large_jpeg_decodes_at_a_reduced_scale_to_the_models_frame() -> None:
    decoded = decode_frame(image_bombs.jpeg(3840, 2160), 56, BUDGET)
    assert decoded.frame.pixels.shape == (56, 56, 3)


async def test_a_decoder_that_dies_tells_its_session_once() -> None:
    pool = FrameDecodePool(1, 4, BUDGET)
    died: list[str] = []
    dead = asyncio.Event()

    def on_frame(frame: DecodedFrame) -> None:
        raise RuntimeError("a bug after decoding")

    def on_died(message: str) -> None:
        died.append(message)
        dead.set()

    decoder = FrameDecoder(pool, 56, on_frame, lambda code, message: None, on_died, capacity=4)
    decoder.put(image_bombs.jpeg(64, 48))
    decoder.put(image_bombs.jpeg(64, 48, seed=1))
    await asyncio.wait_for(dead.wait(), 30)
    assert died == ["the frame decoder stopped: RuntimeError: a bug after decoding"]
    assert pool.held == 1  # the frame still queued, until the session closes the decoder
    await decoder.close()
    assert pool.held == 0
    pool.close()
