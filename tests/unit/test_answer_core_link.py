"""The core side of realtime answers (``ANSWER_*`` frames) on the real engine (``preset:tiny``, one slot): the
hello, an answer's outputs in order then one end, the engine's admission as the refusal, a dropped
connection's answer cancelled at once so that its slot answers another connection's, and a turn heard as it came
encoded window by window."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from omnigate.engines.core.answer_protocol import (
    ENCODER,
    AnswerEnded,
    AnswerInfo,
    AnswerOpen,
    AnswerOutputs,
    AudioChunk,
    TextDelta,
    TurnIn,
)
from omnigate.engines.core.answer_server import AnswerLink
from omnigate.engines.core.framing import Frame, FrameDecoder, FrameError, FrameKind, decode_body
from omnigate.engines.qwen3_omni.engine import Qwen3OmniEngine
from omnigate.engines.qwen3_omni.model import build_preset
from omnigate.engines.qwen3_omni.serving import Qwen3OmniServing
from tests.unit.test_qwen3_omni_encoder import counted


@pytest.fixture
async def serving() -> AsyncIterator[Qwen3OmniServing]:
    engine = Qwen3OmniServing(Qwen3OmniEngine(build_preset("tiny", slots=1, max_context=256)))
    yield engine
    await asyncio.to_thread(engine.shutdown)


class Gateway:
    """What a gateway connection receives, frame by frame."""

    def __init__(self) -> None:
        self.decoder = FrameDecoder()
        self.frames: list[Frame] = []
        self.changed = asyncio.Event()

    def send(self, data: bytes) -> None:
        self.frames += self.decoder.feed(data)
        self.changed.set()

    async def until(self, kind: FrameKind, call: int) -> Frame:
        async with asyncio.timeout(120):
            while True:
                for frame in self.frames:
                    if frame.kind is kind and frame.call == call:
                        return frame
                self.changed.clear()
                await self.changed.wait()


def open_frame(call: int, tokens: int, credit: int | None = None) -> Frame:
    request = AnswerOpen([TurnIn("user", "hello there")], "", "ethan", tokens, 8 * tokens, credit)
    return Frame(FrameKind.ANSWER_OPEN, call, ENCODER.encode(request))


async def test_an_answer_streams_its_outputs_then_ends_once(serving: Qwen3OmniServing) -> None:
    gateway = Gateway()
    link = AnswerLink(serving, gateway.send, lambda: 0)
    link.handle(Frame(FrameKind.ANSWER_HELLO, 0, b""))
    assert decode_body(gateway.frames[0].body, AnswerInfo).info == serving.info
    link.handle(open_frame(7, 4))
    ended = decode_body((await gateway.until(FrameKind.ANSWER_ENDED, 7)).body, AnswerEnded)
    assert ended.reason in ("stop", "length") and ended.code is None
    outputs = [
        o
        for f in gateway.frames
        if f.kind is FrameKind.ANSWER_OUTPUTS
        for o in decode_body(f.body, AnswerOutputs).outputs
    ]
    assert any(isinstance(o, TextDelta) for o in outputs) and any(isinstance(o, AudioChunk) for o in outputs)
    assert gateway.frames[-1].kind is FrameKind.ANSWER_ENDED  # last
    link.close()  # (stops the encoder counters it pushes since the hello)
    with pytest.raises(FrameError):
        link.handle(Frame(FrameKind.ANSWER_INFO, 0, b""))


async def test_a_dropped_connection_frees_its_slot_for_another(serving: Qwen3OmniServing) -> None:
    first, second = Gateway(), Gateway()
    dropped, other = AnswerLink(serving, first.send, lambda: 0), AnswerLink(serving, second.send, lambda: 0)
    dropped.handle(open_frame(1, 200, credit=2))  # pauses after two frames: it holds the slot
    await first.until(FrameKind.ANSWER_OUTPUTS, 1)
    other.handle(open_frame(1, 4))
    refused = decode_body((await second.until(FrameKind.ANSWER_ENDED, 1)).body, AnswerEnded)
    assert (refused.reason, refused.code) == ("error", "engine_busy")  # the engine's one slot, whoever asks
    second.frames.clear()
    dropped.close()
    other.handle(open_frame(2, 4))
    ended = decode_body((await second.until(FrameKind.ANSWER_ENDED, 2)).body, AnswerEnded)
    assert ended.code is None
    assert not [f for f in first.frames if f.kind is FrameKind.ANSWER_ENDED]  # the dropped answer said nothing more
    other.handle(Frame(FrameKind.ANSWER_CANCEL, 1, b""))  # a late cancel of an answer that ended changes nothing


async def test_a_connections_speech_is_encoded_once_for_all_its_answers(serving: Qwen3OmniServing) -> None:
    encoded: list[int] = []
    encode = serving.encode_audio

    async def counting(pcm: bytes) -> Any:
        encoded.append(len(pcm))
        return await encode(pcm)

    serving.encode_audio = counting  # type: ignore[method-assign]
    gateway = Gateway()
    link = AnswerLink(serving, gateway.send, lambda: 0)
    speech = (np.random.default_rng(0).standard_normal(12_000) * 3000).astype("<i2").tobytes()
    for call in (1, 2):
        turns = [TurnIn("user", "", speech, 5), TurnIn("assistant", "hi"), TurnIn("user", "and?")]
        request = AnswerOpen(turns, "", "ethan", 2, 4)
        link.handle(Frame(FrameKind.ANSWER_OPEN, call, ENCODER.encode(request)))
        ended = decode_body((await gateway.until(FrameKind.ANSWER_ENDED, call)).body, AnswerEnded)
        assert ended.code is None
    assert encoded == [len(speech)]


async def test_a_turn_heard_as_it_came_is_encoded_window_by_window_and_finished_by_its_answer() -> None:
    serving = Qwen3OmniServing(Qwen3OmniEngine(build_preset("tiny", slots=1, max_context=512)))
    try:
        gateway = Gateway()
        link = AnswerLink(serving, gateway.send, lambda: 0)
        speech = (np.random.default_rng(1).standard_normal(int(17.5 * 24_000)) * 3000).astype("<i2").tobytes()
        for start in range(0, len(speech), 4800):  # 100 ms pieces, as the gateway hears them
            link.handle(Frame(FrameKind.ANSWER_HEAR, 9, speech[start : start + 4800]))
        await counted(lambda: serving.encoder_stats.windows_ahead >= 2)  # both whole windows, before the turn ends
        request = AnswerOpen([TurnIn("user", "", speech, 9)], "", "ethan", 2, 4)
        link.handle(Frame(FrameKind.ANSWER_OPEN, 1, ENCODER.encode(request)))
        ended = decode_body((await gateway.until(FrameKind.ANSWER_ENDED, 1)).body, AnswerEnded)
        assert ended.code is None
        assert serving.encoder_stats.windows_kept == 2
        # a turn forgotten is dropped: its speech, if an answer carried it after all, is encoded whole
        link.handle(Frame(FrameKind.ANSWER_HEAR, 10, speech[:4800]))
        link.handle(Frame(FrameKind.ANSWER_FORGET, 10, b""))
        assert not link._hearings
    finally:
        await asyncio.to_thread(serving.shutdown)
