"""Fuzzing the pictures a route decodes (``video.frame`` of ``WS /v1/video/chat/stream``): the decompression-bomb
corpus of :mod:`tests.image_bombs`, valid pictures, and valid pictures with bytes flipped, cut short, carrying text
chunks of any inflated size or declaring other dimensions.

Properties, per picture: it gets at most one error, a typed frame refusal (``invalid_frame``, ``input_too_large``),
exactly the one the budget prescribes where the picture's cost is known, and none for a valid picture; afterwards
the session still answers a question. A frame's refusal comes from its decoder, after the reader has moved on, so
each picture is followed by a ``video.query``: the query waits for the frames sent before it, so whatever the
picture earned arrives before the query's ``response.start``.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from base64 import b64encode
from typing import Any

from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection, connect

from omnigate.gateway.video_chat.image_budget import FrameBudget
from tests import image_bombs
from tests.fuzz.harness import READ_LIMIT_S, Tally

PATH = "/v1/video/chat/stream"
FRAME_REFUSALS = frozenset({"invalid_frame", "input_too_large"})
ACCEPTED = ""  # the expectation of a picture that must decode
ANY = None  # at most one typed refusal
Picture = tuple[bytes, str | None]  # the bytes, and the refusal they must get (ACCEPTED, ANY or a code)

BUDGET = FrameBudget()


def corpus_pictures() -> list[Picture]:
    """The whole corpus, each with its refusal: a regression run on every fuzz run."""
    corpus = image_bombs.corpus()
    return [(corpus[name], code) for name, code in sorted(image_bombs.REFUSALS.items())]


sides = st.integers(min_value=1, max_value=200)
valid_pictures = st.one_of(
    st.builds(lambda w, h, seed: image_bombs.jpeg(w, h, seed), sides, sides, st.integers(0, 1000)),
    st.builds(image_bombs.png, sides, sides),
)


@st.composite
def pictures(draw: st.DrawFn) -> Picture:
    kind = draw(st.sampled_from(["corpus", "valid", "flipped", "truncated", "text", "dimensions"]))
    if kind == "corpus":
        return draw(st.sampled_from(corpus_pictures()))
    valid = draw(valid_pictures)
    if kind == "valid":
        return valid, ACCEPTED
    if kind == "flipped":
        data = bytearray(valid)
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data), ANY
    if kind == "truncated":
        return valid[: draw(st.integers(0, len(valid) - 1))], ANY
    if kind == "text":
        size = draw(st.integers(0, 2 * BUDGET.max_text_bytes))
        chunk = image_bombs.chunk(b"zTXt", b"Comment\0\0" + zlib.compress(b"\0" * size, 9))
        return image_bombs.png(extra=chunk), "input_too_large" if size > BUDGET.max_text_bytes else ACCEPTED
    side = draw(st.integers(1000, 65_000))
    return image_bombs.huge_jpeg_header(side), "input_too_large" if side * side > BUDGET.max_pixels else ANY


async def _send(ws: ClientConnection, event_type: str, **fields: Any) -> None:
    await ws.send(json.dumps({"type": event_type, **fields}))


async def _answer(ws: ClientConnection, query: int) -> list[dict[str, Any]]:
    """The events up to the query's ``response.text.done``."""
    events: list[dict[str, Any]] = []
    while True:
        message = await ws.recv()
        assert isinstance(message, str), "a binary message on a JSON route"
        event: dict[str, Any] = json.loads(message)
        events.append(event)
        if event["type"] == "response.text.done" and event["query_id"] == query:
            return events


async def run_picture_case(ws_url: str, batch: list[Picture]) -> Tally:
    """One session: each picture as a ``video.frame`` followed by a question; checks each picture's outcome and
    that every question is answered."""
    tally = Tally(sessions=1)
    async with connect(ws_url + PATH, max_size=None) as ws:
        await _send(ws, "session.config", modalities=["text"], max_new_tokens=1, enable_frame_filter=False)
        for query, (data, expected) in enumerate(batch):
            await _send(ws, "video.frame", data=b64encode(data).decode())
            await _send(ws, "video.query", text="fuzz")
            tally.messages += 2
            async with asyncio.timeout(READ_LIMIT_S):
                events = await _answer(ws, query)
            start = next(i for i, e in enumerate(events) if e["type"] == "response.start")
            errors = [e for e in events[:start] if e["type"] == "error"]
            assert len(errors) <= 1, errors
            assert all(e["code"] in FRAME_REFUSALS and e.get("param") == "video.frame" for e in errors), errors
            codes = [e["code"] for e in errors]
            if expected == ACCEPTED:
                assert not codes, f"a valid picture was refused: {errors}"
            elif expected is not None:
                assert codes == [expected], (expected, errors)
            assert events[-1]["status"] in ("completed", "max_tokens"), events[-1]
            tally.errors += len(errors)
    return tally
