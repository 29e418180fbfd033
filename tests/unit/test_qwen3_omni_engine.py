"""The Qwen3-Omni engine's worker: turns in, text deltas and 24 kHz PCM out on the caller's loop, one end each;
cancel stops a turn at once; a failing step ends every turn in flight typed (no session waits on a dead worker)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from omnigate.engines.base import EngineError
from omnigate.engines.qwen3_omni.engine import Qwen3OmniEngine, TurnAudio, TurnEnd, TurnOutput, TurnText
from omnigate.engines.qwen3_omni.model import build_preset
from omnigate.engines.qwen3_omni.runner import CONTEXT_LENGTH_EXCEEDED, TurnRequest


@pytest.fixture
async def engine() -> AsyncIterator[Qwen3OmniEngine]:
    model = build_preset("tiny", slots=2, max_context=256)
    engine = Qwen3OmniEngine(model)
    engine.start()
    yield engine
    await asyncio.to_thread(engine.stop)


class Collector:
    def __init__(self) -> None:
        self.outputs: list[TurnOutput] = []
        self.ended = asyncio.Event()
        self.first = asyncio.Event()

    def __call__(self, outputs: list[TurnOutput]) -> None:
        self.outputs.extend(outputs)
        self.first.set()
        if any(isinstance(o, TurnEnd) for o in outputs):
            self.ended.set()


def _request(engine: Qwen3OmniEngine, question: str, **kwargs: Any) -> TurnRequest:
    tok = engine.model.tokenizer
    return TurnRequest(prompt=tok.turn("user", tok.encode(question)) + tok.open_assistant(), **kwargs)


async def test_turn_streams_text_and_audio_then_ends_once(engine: Qwen3OmniEngine) -> None:
    sink = Collector()
    engine.submit(_request(engine, "hello", max_tokens=8, max_frames=6), sink)
    await asyncio.wait_for(sink.ended.wait(), 120)
    ends = [o for o in sink.outputs if isinstance(o, TurnEnd)]
    assert len(ends) == 1 and sink.outputs[-1] is ends[0]
    text = "".join(o.text for o in sink.outputs if isinstance(o, TurnText))
    assert text == ends[0].text and ends[0].code is None
    audio = [o for o in sink.outputs if isinstance(o, TurnAudio)]
    assert audio and all(a.sample_rate == 24_000 for a in audio)
    assert all(len(a.pcm) == 2 * engine.model.code2wav.samples_per_frame for a in audio)


async def test_prompt_past_the_context_ends_typed(engine: Qwen3OmniEngine) -> None:
    sink = Collector()
    engine.submit(_request(engine, "y" * 300), sink)
    await asyncio.wait_for(sink.ended.wait(), 120)
    [end] = sink.outputs
    assert isinstance(end, TurnEnd) and end.code == CONTEXT_LENGTH_EXCEEDED and end.reason == "error"


async def test_cancelled_turn_delivers_nothing_more_and_frees_its_slot(engine: Qwen3OmniEngine) -> None:
    first = Collector()
    handle = engine.submit(_request(engine, "hello", max_tokens=200, max_frames=400), first)
    await asyncio.wait_for(first.first.wait(), 120)
    handle.cancel()
    seen = len(first.outputs)
    # Both slots answer again after the cancel: the cancelled turn's slot was freed.
    others = [Collector(), Collector()]
    for sink in others:
        engine.submit(_request(engine, "x", max_tokens=4, max_frames=2), sink)
    for sink in others:
        await asyncio.wait_for(sink.ended.wait(), 120)
    assert len(first.outputs) <= seen + 1  # at most the outputs of the step already under way
    assert not any(isinstance(o, TurnEnd) for o in first.outputs)


async def test_more_turns_than_slots_are_refused_busy(engine: Qwen3OmniEngine) -> None:
    sinks = [Collector(), Collector()]
    for sink in sinks:
        engine.submit(_request(engine, "x", max_tokens=4, max_frames=2), sink)
    with pytest.raises(EngineError) as refused:
        engine.submit(_request(engine, "x"), Collector())
    assert refused.value.code == "engine_busy"
    for sink in sinks:
        await asyncio.wait_for(sink.ended.wait(), 120)


async def test_failing_step_ends_every_turn_typed_and_the_engine_goes_on(engine: Qwen3OmniEngine) -> None:
    model: Any = engine.model
    frame = model.talker_frame

    def broken(*args: Any) -> Any:
        raise RuntimeError("device lost")

    model.talker_frame = broken
    sinks = [Collector(), Collector()]
    for sink in sinks:
        engine.submit(_request(engine, "hello", max_tokens=8, max_frames=6), sink)
    for sink in sinks:
        await asyncio.wait_for(sink.ended.wait(), 120)
        end = sink.outputs[-1]
        assert isinstance(end, TurnEnd) and end.code == "internal_error" and "device lost" in (end.message or "")
    model.talker_frame = frame
    again = Collector()
    engine.submit(_request(engine, "hello", max_tokens=4, max_frames=2), again)
    await asyncio.wait_for(again.ended.wait(), 120)
    assert isinstance(again.outputs[-1], TurnEnd) and again.outputs[-1].code is None
