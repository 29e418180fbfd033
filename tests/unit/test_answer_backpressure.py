"""A realtime session whose client is behind pauses its answer in the engine (``preset:tiny``, the real worker): the
audio waiting in the session stays within the credit while the engine goes on with other sessions' answers, the
answer completes once the client reads, and a cancel during the pause stops it at once and frees its slot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from omnigate.engines.qwen3_omni.engine import Qwen3OmniEngine
from omnigate.engines.qwen3_omni.model import build_preset
from omnigate.engines.qwen3_omni.serving import Qwen3OmniServing
from omnigate.gateway.realtime.answer_backend import CREDIT_CHUNKS, ModelAnswerBackend
from omnigate.sessions.realtime.config import default_config
from omnigate.sessions.realtime.conversation import Item, Part, Response
from tests.unit.test_answer_backend import SETTINGS, Sink

FRAME_BYTES = 2 * 1920  # one codec frame of the tiny preset's voice, s16le


@pytest.fixture
async def serving() -> AsyncIterator[Qwen3OmniServing]:
    engine = Qwen3OmniServing(Qwen3OmniEngine(build_preset("tiny", slots=2, max_context=256)))
    yield engine
    await asyncio.to_thread(engine.shutdown)


class Watched(ModelAnswerBackend):
    """Records the most audio that ever waited in the session, and when CREDIT_CHUNKS of it wait."""

    def __init__(self, engine: Qwen3OmniServing) -> None:
        super().__init__(engine)
        self.most = 0
        self.full = asyncio.Event()

    def hold(self, response: Response, output: Any) -> None:
        super().hold(response, output)
        waiting = sum(len(o) for _, o in self._held if isinstance(o, bytes))
        self.most = max(self.most, waiting)
        if waiting >= CREDIT_CHUNKS * FRAME_BYTES:
            self.full.set()


def question(text: str) -> list[Item]:
    return [Item(id="item_1", role="user", status="completed", content=[Part("input_text", text=text)])]


def response(rid: str, tokens: int) -> Response:
    return Response(rid, True, None, ("audio",), "ethan", "audio/pcm", tokens)


def session(engine: Qwen3OmniServing) -> tuple[Watched, Sink]:
    backend = Watched(engine)
    sink = Sink()
    backend.start(sink, default_config(backend.capabilities, "preset:tiny"))  # type: ignore[arg-type]
    return backend, sink


async def test_a_slow_reader_holds_the_credit_and_its_answer_completes(serving: Qwen3OmniServing) -> None:
    slow, slow_sink = session(serving)
    slow_sink.room.clear()  # the client reads nothing yet
    slow.answer(response("resp_1", 40), SETTINGS, question("tell me a long story"))
    await asyncio.wait_for(slow.full.wait(), 120)
    # Another session's whole answer runs meanwhile, in the same engine steps: the slow one makes nothing more.
    fast, fast_sink = session(serving)
    fast.answer(response("resp_2", 12), SETTINGS, question("hi"))
    await asyncio.wait_for(fast_sink.done.wait(), 120)
    assert len(fast_sink.audio) > 2 * CREDIT_CHUNKS
    assert slow.most == CREDIT_CHUNKS * FRAME_BYTES and not slow_sink.audio
    slow_sink.room.set()  # the client reads: the answer goes on to its end
    await asyncio.wait_for(slow_sink.done.wait(), 120)
    assert slow_sink.finished[0][0] in ("completed", "incomplete")
    assert len(slow_sink.audio) > CREDIT_CHUNKS and slow.most == CREDIT_CHUNKS * FRAME_BYTES
    slow.release()
    fast.release()


async def test_a_cancel_during_the_pause_stops_the_answer_and_frees_its_slot(serving: Qwen3OmniServing) -> None:
    paused, sink = session(serving)
    sink.room.clear()
    first = response("resp_1", 40)
    paused.answer(first, SETTINGS, question("tell me a long story"))
    await asyncio.wait_for(paused.full.wait(), 120)
    meanwhile, meanwhile_sink = session(serving)
    meanwhile.answer(response("resp_0", 8), SETTINGS, question("hi"))
    await asyncio.wait_for(meanwhile_sink.done.wait(), 120)
    meanwhile.release()
    assert paused.most == CREDIT_CHUNKS * FRAME_BYTES  # paused, not running ahead
    paused.cancel(first)
    sink.room.set()
    # Both slots answer: the paused turn's slot was freed; nothing of the cancelled answer reaches its session.
    others = [session(serving) for _ in range(2)]
    for i, (backend, _) in enumerate(others):
        backend.answer(response(f"resp_{i + 2}", 4), SETTINGS, question("hi"))
    for backend, other in others:
        await asyncio.wait_for(other.done.wait(), 120)
        assert other.finished[0][0] in ("completed", "incomplete")
        backend.release()
    assert sink.audio == [] and sink.finished == []
    paused.release()
