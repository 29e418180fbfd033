"""Camera frames encoded as they arrive, before a question samples them: the question's prefill only gathers their
vision tokens, its answer is the same token for token, and the encoder's work per worker loop stays bounded (one
frame at a time while answers are in flight; a prefill's new frames under a budget)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from omnigate.engines.omni.engine import OmniEngine
from omnigate.engines.omni.model import OmniModel, build_preset
from omnigate.engines.omni.request import EncoderCache, FrameInput, ThinkDone, ThinkOutput, ThinkRequest


class WatchedCache(EncoderCache):
    """An encoder cache that tells when it holds ``expected`` frames (the worker puts them)."""

    def __init__(self, expected: int) -> None:
        super().__init__(capacity=64)
        self.expected = expected
        self.full = threading.Event()

    def put(self, digest: bytes, tokens: torch.Tensor) -> None:
        super().put(digest, tokens)
        if len(self) >= self.expected:
            self.full.set()


def camera(count: int, seed: int = 7) -> list[FrameInput]:
    rng = np.random.default_rng(seed)
    return [FrameInput(bytes([seed, i]), rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)) for i in range(count)]


def record_encoder_calls(model: OmniModel) -> list[int]:
    """The number of frames of each vision encoder call the model makes from now on."""
    sizes: list[int] = []
    encode = model.encode_frames

    def counted(frames: Sequence[np.ndarray]) -> list[torch.Tensor]:
        sizes.append(len(frames))
        return encode(frames)

    model.encode_frames = counted  # type: ignore[method-assign]
    return sizes


async def answer(engine: OmniEngine, request: ThinkRequest) -> ThinkDone:
    finished: asyncio.Future[ThinkDone] = asyncio.get_running_loop().create_future()

    def sink(outputs: list[ThinkOutput]) -> None:
        for out in outputs:
            if isinstance(out, ThinkDone) and not finished.done():
                finished.set_result(out)

    engine.submit(request, sink)
    return await asyncio.wait_for(finished, 60)


def question(frames: Sequence[FrameInput], cache: EncoderCache, **fields: object) -> ThinkRequest:
    options: dict[str, object] = {"max_new_tokens": 24, "temperature": 0.9, "seed": 3, **fields}
    return ThinkRequest("system: look\n", "what moved?", tuple(frames), cache=cache, **options)  # type: ignore[arg-type]


async def test_frames_sent_before_a_question_are_encoded_before_it_and_the_answer_is_the_same() -> None:
    frames = camera(3)
    reference = OmniEngine(build_preset("tiny", seed=4, slots=2, max_context=256), encode_ahead=False)
    reference.start()
    try:
        expected = await answer(reference, question(frames, EncoderCache(capacity=64)))
    finally:
        await asyncio.to_thread(reference.stop)
    assert reference.frames_ahead_total == 0 and reference.frames_encoded_total == 3

    engine = OmniEngine(build_preset("tiny", seed=4, slots=2, max_context=256))
    cache = WatchedCache(expected=3)
    for frame in frames:
        engine.encode_ahead(frame, cache)
    engine.start()
    try:
        assert await asyncio.to_thread(cache.full.wait, 60), "the frames were not encoded before the question"
        assert engine.frames_ahead_total == 3
        got = await answer(engine, question(frames, cache))
    finally:
        await asyncio.to_thread(engine.stop)
    assert engine.frames_encoded_total == 3  # the prefill encoded nothing: it took the three from the cache
    assert cache.hits == 3
    assert (got.reason, got.text, got.tokens) == (expected.reason, expected.text, expected.tokens)
    assert got.tokens > 3


async def test_while_an_answer_is_in_flight_frames_are_encoded_ahead_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("omnigate.engines.omni.engine.AHEAD_BUSY_SHARE", 1.0)  # no pause between them
    model = build_preset("tiny", seed=4, slots=2, max_context=256)
    engine = OmniEngine(model)
    sizes = record_encoder_calls(model)
    frames = camera(13)
    cache = WatchedCache(expected=13)
    for frame in frames[:12]:
        engine.encode_ahead(frame, cache)
    done: asyncio.Future[ThinkDone] = asyncio.get_running_loop().create_future()

    def sink(outputs: list[ThinkOutput]) -> None:
        for out in outputs:
            if isinstance(out, ThinkDone):
                done.set_result(out)

    # Submitted before the worker starts: its first loop prefills the question (its frame encoded there), then every
    # loop that leaves the answer running encodes one queued frame; once it ends, the rest go in calls of 8.
    engine.submit(question(frames[12:], cache, max_new_tokens=6, temperature=0.0), sink)
    engine.start()
    try:
        finished = await asyncio.wait_for(done, 60)
        assert await asyncio.to_thread(cache.full.wait, 60)
    finally:
        await asyncio.to_thread(engine.stop)
    assert finished.reason == "max_tokens" and finished.tokens == 6
    assert sizes == [1, 1, 1, 1, 1, 1, 7]  # the prefill's frame, 5 frames beside steps 1-5, the other 7 at once
    assert engine.frames_ahead_total == 12 and engine.frames_encoded_total == 13


async def test_a_loop_encodes_at_most_its_frame_budget_for_the_prompts_it_prefills(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("omnigate.engines.omni.engine.PREFILL_FRAMES_PER_STEP", 4)
    model = build_preset("tiny", seed=4, slots=3, max_context=256)
    engine = OmniEngine(model, encode_ahead=False)
    sizes = record_encoder_calls(model)
    frames = camera(9)
    answers: list[asyncio.Future[ThinkDone]] = []
    for i in range(3):
        finished: asyncio.Future[ThinkDone] = asyncio.get_running_loop().create_future()
        answers.append(finished)

        def sink(outputs: list[ThinkOutput], finished: asyncio.Future[ThinkDone] = finished) -> None:
            for out in outputs:
                if isinstance(out, ThinkDone):
                    finished.set_result(out)

        engine.submit(question(frames[3 * i : 3 * i + 3], EncoderCache(capacity=8), max_new_tokens=4, seed=i), sink)
    engine.start()
    try:
        await asyncio.wait_for(asyncio.gather(*answers), 60)
    finally:
        await asyncio.to_thread(engine.stop)
    # Two questions' 6 new frames would exceed the loop's 4: one question (3 frames) per loop, in three forwards.
    assert sizes == [3, 3, 3]
    assert (engine.stats.prefill_forwards, engine.stats.prefilled_prompts) == (3, 3)


async def test_the_frames_of_an_ended_session_are_not_encoded() -> None:
    model = build_preset("tiny", seed=4, slots=2, max_context=64)
    engine = OmniEngine(model)
    sizes = record_encoder_calls(model)
    ended, live = EncoderCache(capacity=8), WatchedCache(expected=1)
    for frame in camera(2, seed=1):
        engine.encode_ahead(frame, ended)
    engine.encode_ahead(camera(1, seed=2)[0], live)
    engine.forget_frames(ended)
    engine.start()
    try:
        assert await asyncio.to_thread(live.full.wait, 60)
    finally:
        await asyncio.to_thread(engine.stop)
    assert sizes == [1] and len(ended) == 0


def test_encode_ahead_is_an_engine_option() -> None:
    with pytest.raises(ValueError, match="encode_ahead must be on or off"):
        OmniEngine.load("preset:tiny", encode_ahead="sometimes")


async def test_encoding_ahead_keeps_to_its_share_and_never_holds_up_a_question(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("omnigate.engines.omni.engine.AHEAD_FRAMES_IDLE", 1)
    monkeypatch.setattr("omnigate.engines.omni.engine.AHEAD_IDLE_SHARE", 1e-9)  # after one call, a pause for ever
    model = build_preset("tiny", seed=4, slots=2, max_context=256)
    engine = OmniEngine(model)
    sizes = record_encoder_calls(model)
    frames = camera(2)
    cache = WatchedCache(expected=1)
    for frame in frames:
        engine.encode_ahead(frame, cache)
    engine.start()
    try:
        assert await asyncio.to_thread(cache.full.wait, 60)
        got = await answer(engine, question(frames, cache, max_new_tokens=4))
    finally:
        await asyncio.to_thread(engine.stop)
    # The newest frame was encoded ahead; the other waited out the pause, and the question, not held up by it,
    # encoded it in its prefill.
    assert got.tokens > 0 and sizes == [1, 1]
    assert (engine.frames_ahead_total, engine.frames_encoded_total) == (1, 2)
    assert frames[1].digest in cache and cache.hits == 1
