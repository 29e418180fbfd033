"""The realtime backend of an engine that answers the conversation itself: what goes to the engine (the
conversation, each spoken turn encoded once), how its answer ends a response (typed), and cancel."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from omnigate.engines.answering import AnswerSink, PromptTurn
from omnigate.engines.base import EngineCapabilities, EngineError, EngineInfo, VoiceInfo
from omnigate.gateway.realtime.answer_backend import CREDIT_CHUNKS, ModelAnswerBackend
from omnigate.sessions.realtime.config import ResponseSettings, default_config
from omnigate.sessions.realtime.conversation import Item, Part, Response, ResponseStatus

INFO = EngineInfo(
    family="qwen3-omni",
    model="preset:tiny",
    sample_rate=24000,
    voices=(VoiceInfo(id="ethan", name="ethan"),),
    default_voice="ethan",
    capabilities=EngineCapabilities(),
    max_sessions=1,
)
SETTINGS = ResponseSettings(("audio",), "ethan", "audio/pcm", None, True, None)


class Handle:
    cancelled = False

    def __init__(self) -> None:
        self.grants: list[int] = []

    def cancel(self) -> None:
        self.cancelled = True

    def grant(self, chunks: int) -> None:
        self.grants.append(chunks)


class Hearing:
    """A turn heard ahead, recording what it heard."""

    def __init__(self) -> None:
        self.heard = bytearray()
        self.closed = False

    def hear(self, pcm: bytes) -> None:
        assert not self.closed
        self.heard += pcm

    def close(self) -> None:
        self.closed = True


class Engine:
    """Records what it is asked; ``busy`` refuses as the real engine does with every slot answering; ``hears``
    hears turns as they come (``finish_busy``: the first finish is refused)."""

    info = INFO

    def __init__(
        self, busy: bool = False, encoder_busy: bool = False, hears: bool = False, finish_busy: bool = False
    ) -> None:
        self.busy = busy
        self.encoder_busy = encoder_busy
        self.hears = hears
        self.finish_busy = finish_busy
        self.hearings: list[Hearing] = []
        self.finished: list[tuple[Hearing, bytes]] = []
        self.encoded: list[bytes] = []
        self.asked: list[tuple[list[PromptTurn], AnswerSink, Handle]] = []
        self.credit: list[int | None] = []
        self.asked_event = asyncio.Event()

    async def encode_audio(self, pcm: bytes) -> Any:
        if self.encoder_busy:
            raise EngineError("engine_busy", "too many inputs wait for the encoder")
        self.encoded.append(pcm)
        return f"tokens of {len(pcm)} bytes"

    def turn_ahead(self) -> Hearing | None:
        if not self.hears:
            return None
        self.hearings.append(Hearing())
        return self.hearings[-1]

    async def finish_turn(self, ahead: Hearing, pcm: bytes) -> Any:
        self.finished.append((ahead, pcm))
        if self.finish_busy:
            self.finish_busy = False
            raise EngineError("engine_busy", "too many inputs wait for the encoder")
        return f"tokens of {len(ahead.heard)} heard, {len(pcm)} bytes"

    def answer(self, turns: Sequence[PromptTurn], sink: AnswerSink, **how: Any) -> Handle:
        if self.busy:
            raise EngineError("engine_busy", "every slot is answering")
        handle = Handle()
        self.credit.append(how.get("credit"))
        self.asked.append((list(turns), sink, handle))
        self.asked_event.set()
        return handle


class Sink:
    """The session's side, recording."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.audio: list[bytes] = []
        self.finished: list[tuple[ResponseStatus, str | None, tuple[str, str] | None]] = []
        self.done = asyncio.Event()
        self.room = asyncio.Event()  # the outbox has room for audio
        self.room.set()
        self.waiting = asyncio.Event()  # the backend waits for room

    async def wait_for_room(self) -> None:
        if not self.room.is_set():
            self.waiting.set()
        await self.room.wait()

    def response_text(self, response: Response, text: str, tokens: int) -> None:
        self.text.append(text)

    def response_audio(self, response: Response, pcm: bytes, sample_rate: int, engine_ms: float | None = None) -> bool:
        self.audio.append(pcm)
        return True

    def finish_response(
        self, response: Response, status: ResponseStatus, reason: str | None = None, error: Any = None
    ) -> None:
        self.finished.append((status, reason, error))
        self.done.set()

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the backend called {name}")


def response(rid: str) -> Response:
    return Response(rid, True, None, ("audio",), "ethan", "audio/pcm", None)


def user_audio(item_id: str) -> Item:
    return Item(id=item_id, role="user", status="completed", content=[Part(type="input_audio")])


async def started(engine: Engine) -> tuple[ModelAnswerBackend, Sink]:
    backend = ModelAnswerBackend(engine)  # type: ignore[arg-type]
    sink = Sink()
    backend.start(sink, default_config(backend.capabilities, "preset:tiny"))  # type: ignore[arg-type]
    return backend, sink


async def test_a_spoken_turn_is_encoded_once_and_answered_with_the_conversation() -> None:
    engine = Engine()
    backend, sink = await started(engine)
    backend.turn_audio("item_1", b"\x01\x00" * 100)
    first = response("resp_1")
    mine = Item(id="item_2", role="assistant", status="in_progress", content=[], response_id="resp_1")
    backend.answer(first, SETTINGS, [user_audio("item_1"), mine])
    await asyncio.wait_for(engine.asked_event.wait(), 5)
    [(turns, answer, _)] = engine.asked
    assert turns == [("user", "", "tokens of 200 bytes")]  # the response's own item is not in its prompt
    answer.text("hi")
    answer.audio(b"\x00\x00" * 4, 24000)
    answer.end("stop", None, None)
    await asyncio.wait_for(sink.done.wait(), 5)
    assert sink.text == ["hi"] and sink.audio == [b"\x00\x00" * 4] and sink.finished == [("completed", None, None)]
    engine.asked_event.clear()
    said = Item(id="item_2", role="assistant", status="completed", content=[Part("output_audio", transcript="hi")])
    text = Item(id="item_3", role="user", status="completed", content=[Part("input_text", text="more")])
    backend.answer(response("resp_2"), SETTINGS, [user_audio("item_1"), said, text])
    await asyncio.wait_for(engine.asked_event.wait(), 5)
    assert engine.asked[1][0] == [
        ("user", "", "tokens of 200 bytes"),
        ("assistant", "hi", None),
        ("user", "more", None),
    ]
    assert len(engine.encoded) == 1


async def test_a_busy_engine_fails_the_response_typed() -> None:
    backend, sink = await started(Engine(busy=True))
    backend.answer(response("resp_1"), SETTINGS, [])
    await asyncio.wait_for(sink.done.wait(), 5)
    assert sink.finished == [("failed", None, ("engine_busy", "every slot is answering"))]


async def test_an_encoder_refusing_the_turns_audio_fails_the_response_typed() -> None:
    engine = Engine(encoder_busy=True)
    backend, sink = await started(engine)
    backend.turn_audio("item_1", b"\x01\x00" * 100)
    backend.answer(response("resp_1"), SETTINGS, [user_audio("item_1")])
    await asyncio.wait_for(sink.done.wait(), 5)
    assert sink.finished == [("failed", None, ("engine_busy", "too many inputs wait for the encoder"))]
    assert not engine.asked


@pytest.mark.parametrize(
    ("reason", "code", "finished"),
    [
        ("length", None, ("incomplete", "max_output_tokens", None)),
        (
            "max_context",
            None,
            ("failed", None, ("context_length_exceeded", "the answer reached the model's context length")),
        ),
        ("error", "context_length_exceeded", ("failed", None, ("context_length_exceeded", "too long"))),
    ],
)
async def test_how_an_answer_ends_its_response(reason: str, code: str | None, finished: tuple[Any, ...]) -> None:
    engine = Engine()
    backend, sink = await started(engine)
    backend.answer(response("resp_1"), SETTINGS, [])
    await asyncio.wait_for(engine.asked_event.wait(), 5)
    engine.asked[0][1].end(reason, code, "too long" if code else None)
    await asyncio.wait_for(sink.done.wait(), 5)
    assert sink.finished == [finished]


async def test_cancel_stops_the_engine_turn_and_drops_what_it_still_delivers() -> None:
    engine = Engine()
    backend, sink = await started(engine)
    first = response("resp_1")
    backend.answer(first, SETTINGS, [])
    await asyncio.wait_for(engine.asked_event.wait(), 5)
    [(_, answer, handle)] = engine.asked
    backend.cancel(first)
    assert handle.cancelled
    answer.text("late")
    answer.end("stop", None, None)
    assert sink.text == [] and sink.finished == []  # the session core ends a cancelled response itself


async def test_audio_waits_for_outbox_room_in_order_and_a_cancel_drops_what_waits() -> None:
    engine = Engine()
    backend, sink = await started(engine)
    first = response("resp_1")
    backend.answer(first, SETTINGS, [])
    await asyncio.wait_for(engine.asked_event.wait(), 5)
    [(_, answer, handle)] = engine.asked
    sink.room.clear()
    answer.text("a")
    answer.audio(b"\x01\x00", 24000)
    answer.text("b")
    answer.end("stop", None, None)
    await asyncio.wait_for(sink.waiting.wait(), 5)
    assert sink.text == ["a"] and sink.audio == [] and sink.finished == []  # held behind the audio, in order
    sink.room.set()
    await asyncio.wait_for(sink.done.wait(), 5)
    assert sink.text == ["a", "b"] and sink.audio == [b"\x01\x00"] and sink.finished == [("completed", None, None)]
    # A cancelled answer's held outputs never reach the session.
    second = response("resp_2")
    engine.asked_event.clear()
    backend.answer(second, SETTINGS, [])
    await asyncio.wait_for(engine.asked_event.wait(), 5)
    answer, handle = engine.asked[1][1], engine.asked[1][2]
    sink.room.clear()
    sink.waiting.clear()
    answer.audio(b"\x02\x00", 24000)
    answer.text("c")
    await asyncio.wait_for(sink.waiting.wait(), 5)
    backend.cancel(second)
    sink.room.set()
    engine.asked_event.clear()
    sink.done.clear()
    backend.answer(response("resp_3"), SETTINGS, [])
    await asyncio.wait_for(engine.asked_event.wait(), 5)
    engine.asked[2][1].end("stop", None, None)
    await asyncio.wait_for(sink.done.wait(), 5)  # the loop ran the relay past the cancel
    assert handle.cancelled and sink.audio == [b"\x01\x00"] and sink.text == ["a", "b"]
    assert sink.finished == [("completed", None, None)] * 2


async def test_credit_returns_as_audio_reaches_the_outbox() -> None:
    engine = Engine()
    backend, sink = await started(engine)
    backend.answer(response("resp_1"), SETTINGS, [])
    await asyncio.wait_for(engine.asked_event.wait(), 5)
    [(_, answer, handle)] = engine.asked
    assert engine.credit == [CREDIT_CHUNKS]
    sink.room.clear()
    answer.audio(b"\x01\x00", 24000)
    answer.audio(b"\x02\x00", 24000)
    answer.end("stop", None, None)
    await asyncio.wait_for(sink.waiting.wait(), 5)
    assert handle.grants == []  # nothing reached the outbox: no credit back
    sink.room.set()
    await asyncio.wait_for(sink.done.wait(), 5)
    assert handle.grants == [CREDIT_CHUNKS + 1, CREDIT_CHUNKS + 2]


async def test_a_turn_heard_as_it_came_is_finished_once_with_the_whole_turn() -> None:
    engine = Engine(hears=True)
    backend, _ = await started(engine)
    assert backend.hears_turns
    backend.hear_turn_audio(b"\x01\x00" * 30)
    backend.hear_turn_audio(b"\x02\x00" * 20)
    backend.turn_audio("item_1", b"\x03\x00" * 10)
    [first] = engine.hearings
    assert first.heard == b"\x01\x00" * 30 + b"\x02\x00" * 20
    backend.answer(response("resp_1"), SETTINGS, [user_audio("item_1")])
    await asyncio.wait_for(engine.asked_event.wait(), 5)
    assert engine.asked[0][0] == [("user", "", "tokens of 100 heard, 120 bytes")]
    assert engine.finished == [(first, bytes(first.heard) + b"\x03\x00" * 10)] and not engine.encoded
    # the next turn is heard by a new hearing; one forgotten is closed and never finished
    backend.hear_turn_audio(b"\x04\x00" * 5)
    backend.forget_turn_audio()
    assert len(engine.hearings) == 2 and engine.hearings[1].closed
    backend.release()


async def test_a_heard_turn_whose_finish_is_refused_is_encoded_whole_by_the_next_response() -> None:
    engine = Engine(hears=True, finish_busy=True)
    backend, sink = await started(engine)
    backend.hear_turn_audio(b"\x01\x00" * 30)
    backend.turn_audio("item_1", b"\x03\x00" * 10)
    backend.answer(response("resp_1"), SETTINGS, [user_audio("item_1")])
    await asyncio.wait_for(sink.done.wait(), 5)
    assert sink.finished == [("failed", None, ("engine_busy", "too many inputs wait for the encoder"))]
    backend.answer(response("resp_2"), SETTINGS, [user_audio("item_1")])
    await asyncio.wait_for(engine.asked_event.wait(), 5)
    assert engine.asked[0][0] == [("user", "", "tokens of 80 bytes")]
    assert engine.encoded == [b"\x01\x00" * 30 + b"\x03\x00" * 10] and len(engine.finished) == 1
    backend.release()
    assert engine.hearings[0].closed
