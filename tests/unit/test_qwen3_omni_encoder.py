"""The Qwen3-Omni input encoder: every waiting request encoded in one call per encoder on one thread, each result
equal to that input encoded alone; bounded; a failed call or a dead thread fails its waiters typed. And video chat:
a frame a session's earlier question is still encoding is awaited, not encoded twice.

Tolerance: float32 on CPU, batched against alone within rtol 1e-4, atol 1e-5 (the same kernels over more rows)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from omnigate.codecs.resample import StreamResampler
from omnigate.engines.base import EngineError
from omnigate.engines.omni.request import EncoderCache, FrameInput, ThinkDone, ThinkOutput, ThinkRequest
from omnigate.engines.qwen3_omni.encoder import InputEncoder
from omnigate.engines.qwen3_omni.engine import Qwen3OmniEngine
from omnigate.engines.qwen3_omni.model import Qwen3OmniModel, build_preset
from omnigate.engines.qwen3_omni.serving import Qwen3OmniServing
from omnigate.engines.qwen3_omni.video_chat import Qwen3VideoChat

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(scope="module")
def model() -> Qwen3OmniModel:
    return build_preset("tiny", slots=2, max_context=512)


@pytest.fixture
def encoder(model: Qwen3OmniModel) -> Iterator[InputEncoder]:
    encoder = InputEncoder(model, max_waiting=8)  # started by each test once its requests wait
    yield encoder
    encoder.stop()


async def queued(encoder: InputEncoder, *requests: Any) -> list[asyncio.Task[Any]]:
    """Tasks of ``requests`` (coroutines), each run up to its wait for the encoder."""
    tasks = [asyncio.create_task(r) for r in requests]
    await asyncio.sleep(0)  # one step of the loop: each task runs its first step, up to the wait (no timing)
    assert len(encoder._waiting) == len(tasks)
    return tasks


def speech(seconds: float, rate: int, seed: int) -> bytes:
    samples = int(seconds * rate)
    return (np.random.default_rng(seed).standard_normal(samples) * 3000).astype("<i2").tobytes()


def alone(model: Qwen3OmniModel, pcm: bytes, rate: int) -> torch.Tensor:
    """The turn's audio encoded by itself, as the realtime backend encoded it before (resampled, log-mel, encoder)."""
    resampler = StreamResampler(rate, 16_000)
    samples = resampler.process(pcm) + resampler.flush()
    audio = np.frombuffer(samples, dtype="<i2").astype(np.float32) / 32768.0
    extractor = WhisperFeatureExtractor(feature_size=int(model.config.thinker_config.audio_config.num_mel_bins))
    features: Any = extractor(audio, sampling_rate=16_000, return_tensors="pt", padding="longest", truncation=False)
    return model.encode_audio(features["input_features"][0])


async def test_waiting_turns_are_encoded_in_one_call_each_equal_to_its_encode_alone(
    model: Qwen3OmniModel, encoder: InputEncoder
) -> None:
    # Longer than the encoder's chunk (1 s) and its attention window (8 s), and shorter: two of the same length.
    turns = [(2.1, 24_000), (0.4, 24_000), (9.3, 24_000), (0.4, 16_000), (0.25, 16_000), (1.0, 16_000)]
    pcms = [speech(seconds, rate, seed) for seed, (seconds, rate) in enumerate(turns)]
    tasks = await queued(encoder, *(encoder.audio(pcm, rate) for pcm, (_, rate) in zip(pcms, turns, strict=True)))
    encoder.start()
    got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert (encoder.stats.audio_calls, encoder.stats.audio_items, encoder.stats.largest_audio_call) == (1, 6, 6)
    for tokens, pcm, (_, rate) in zip(got, pcms, turns, strict=True):
        expected = alone(model, pcm, rate)
        assert tokens.shape == expected.shape
        torch.testing.assert_close(tokens, expected, **TOLERANCE)


def frames(model: Qwen3OmniModel, count: int, seed: int) -> list[np.ndarray]:
    side = 2 * model.patch * model.merge
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(count)]


async def test_waiting_frames_are_encoded_in_one_call_each_equal_to_its_encode_alone(
    model: Qwen3OmniModel, encoder: InputEncoder
) -> None:
    asked = [frames(model, n, seed) for seed, n in enumerate((2, 1, 3))]
    tasks = await queued(encoder, *(encoder.frames(f) for f in asked))
    encoder.start()
    got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert (encoder.stats.frame_calls, encoder.stats.frames, encoder.stats.frame_requests) == (1, 6, 3)
    for tokens, request in zip(got, asked, strict=True):
        assert len(tokens) == len(request)
        for one, frame in zip(tokens, request, strict=True):
            torch.testing.assert_close(one, model.encode_frames([frame])[0].tokens, **TOLERANCE)


async def test_past_its_bound_a_request_is_refused_busy_and_stopping_fails_the_waiters(encoder: InputEncoder) -> None:
    encoder.max_waiting = 2
    tasks = await queued(
        encoder, encoder.audio(speech(0.5, 16_000, 0), 16_000), encoder.frames(frames(encoder.model, 1, 0))
    )
    with pytest.raises(EngineError) as busy:
        await encoder.audio(speech(0.5, 16_000, 1), 16_000)
    assert busy.value.code == "engine_busy"
    await asyncio.to_thread(encoder.stop)
    for outcome in await asyncio.gather(*tasks, return_exceptions=True):
        assert isinstance(outcome, EngineError) and outcome.code == "shutting_down"


async def test_a_failed_call_fails_its_waiters_typed_and_the_encoder_goes_on(
    model: Qwen3OmniModel, encoder: InputEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    encode = model.encode_frames
    monkeypatch.setattr(model, "encode_frames", lambda f: (_ for _ in ()).throw(RuntimeError("out of memory")))
    encoder.start()
    with pytest.raises(EngineError) as failed:
        await asyncio.wait_for(encoder.frames(frames(model, 1, 0)), 120)
    assert failed.value.code == "internal_error" and "out of memory" in failed.value.message
    monkeypatch.setattr(model, "encode_frames", encode)
    assert len(await asyncio.wait_for(encoder.frames(frames(model, 1, 0)), 120)) == 1
    assert encoder.stats.failed_calls == 1


async def test_a_turn_whose_audio_cannot_be_read_fails_alone(model: Qwen3OmniModel, encoder: InputEncoder) -> None:
    good = speech(0.5, 24_000, 0)
    tasks = await queued(encoder, encoder.audio(good[:-1], 24_000), encoder.audio(good, 24_000))  # half a sample
    encoder.start()
    bad, tokens = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
    assert isinstance(bad, EngineError) and bad.code == "invalid_audio"
    assert isinstance(tokens, torch.Tensor)
    torch.testing.assert_close(tokens, alone(model, good, 24_000), **TOLERANCE)
    assert (encoder.stats.audio_calls, encoder.stats.audio_items, encoder.stats.failed_calls) == (1, 1, 0)


class Died(BaseException):
    """What kills a thread outright (not an Exception a call's error handling takes)."""


async def test_a_dead_encoder_thread_fails_its_waiters_and_refuses_new_requests_typed(
    model: Qwen3OmniModel, encoder: InputEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    def die(features: Any) -> Any:
        raise Died("the thread is gone")

    monkeypatch.setattr(model, "encode_audios", die)
    waiting = await queued(encoder, encoder.audio(speech(0.5, 16_000, 0), 16_000), encoder.frames(frames(model, 1, 0)))
    encoder.start()
    outcomes = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 120)
    # The frames were encoded before the audio call killed the thread; the audio's waiter hears it, typed.
    assert isinstance(outcomes[0], EngineError) and outcomes[0].code == "internal_error"
    assert isinstance(outcomes[1], list) and len(outcomes[1]) == 1
    with pytest.raises(EngineError) as refused:
        await encoder.frames(frames(model, 1, 1))
    assert refused.value.code == "internal_error"


@pytest.fixture
async def video_chat(model: Qwen3OmniModel) -> AsyncIterator[Qwen3VideoChat]:
    engine = Qwen3OmniEngine(model)
    engine.start()
    yield Qwen3VideoChat(engine, frame_size=2 * model.patch * model.merge)
    await asyncio.to_thread(engine.stop)


async def test_a_frame_an_earlier_question_still_encodes_is_awaited_not_encoded_again(
    video_chat: Qwen3VideoChat,
) -> None:
    [pixels] = frames(video_chat.turns.model, 1, 7)
    cache = EncoderCache(8)
    request = ThinkRequest("", "what is this?", (FrameInput(b"frame-1", pixels),), max_new_tokens=2, speak=False,
                           cache=cache)  # fmt: skip
    ends: list[ThinkDone] = []
    done = asyncio.Event()

    def sink(outputs: list[ThinkOutput]) -> None:
        ends.extend(o for o in outputs if isinstance(o, ThinkDone))
        if len(ends) == 2:
            done.set()

    video_chat.submit(request, sink)
    video_chat.submit(request, sink)  # asked again before the first question's frame is encoded
    await asyncio.wait_for(done.wait(), 120)
    assert [e.error for e in ends] == [None, None]
    assert (video_chat.frames_encoded_total, video_chat.frames_reused_total) == (1, 1)
    assert video_chat.turns.encoder.stats.frames == 1 and b"frame-1" in cache


def speech_with_gaps(seconds: float, rate: int, seed: int, peak_s: float) -> bytes:
    """Noise with digital silence in every 8-s window (values the log-mel clamp lifts to the turn's loudest frame
    minus 8, so they change when a louder frame comes) and a loud burst at ``peak_s``, the turn's loudest."""
    samples = (np.random.default_rng(seed).standard_normal(int(seconds * rate)) * 3000).clip(-9000, 9000)
    for start in range(2, int(seconds), 4):
        samples[int(start * rate) : int((start + 0.5) * rate)] = 0
    burst = int(peak_s * rate)
    samples[burst : burst + rate // 5] = 30000 * np.sin(np.arange(rate // 5) * 0.3)
    return samples.astype("<i2").tobytes()


def hear(ahead: Any, pcm: bytes, rate: int) -> None:
    """``pcm`` heard in 100 ms pieces, as a session's turn in progress comes."""
    piece = rate // 10 * 2
    for start in range(0, len(pcm), piece):
        ahead.hear(pcm[start : start + piece])


async def counted(predicate: Any) -> None:
    """Until the encoder's counters say so (the deadline only bounds a failing run)."""
    deadline = asyncio.get_running_loop().time() + 120
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "the encoder never reached the expected count"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(("peak_s", "kept"), [(1.0, 2), (18.5, 0)])
async def test_a_turn_heard_as_it_comes_equals_its_whole_encode_with_the_windows_whose_features_stand(
    model: Qwen3OmniModel, encoder: InputEncoder, peak_s: float, kept: int
) -> None:
    rate = 24_000
    pcm = speech_with_gaps(19.0, rate, seed=3, peak_s=peak_s)
    encoder.start()
    ahead = encoder.turn_ahead(rate)
    heard = int(17.5 * rate) * 2  # two whole 8-s windows and their margin, the rest comes at the end
    hear(ahead, pcm[:heard], rate)
    await counted(lambda: encoder.stats.windows_ahead >= 2)
    tokens = await asyncio.wait_for(encoder.finish_turn(ahead, pcm), 120)
    # a peak in the last seconds lifts every window's clamp: none stands, the whole turn is encoded at its end
    assert encoder.stats.windows_kept == kept
    expected = alone(model, pcm, rate)
    assert tokens.shape == expected.shape
    torch.testing.assert_close(tokens, expected, **TOLERANCE)


async def test_a_window_whose_features_a_louder_frame_changed_is_encoded_again_while_heard(
    model: Qwen3OmniModel, encoder: InputEncoder
) -> None:
    rate = 24_000
    pcm = speech_with_gaps(19.0, rate, seed=4, peak_s=10.0)
    encoder.start()
    ahead = encoder.turn_ahead(rate)
    first = int(8.5 * rate) * 2
    hear(ahead, pcm[:first], rate)
    await counted(lambda: encoder.stats.windows_ahead >= 1)
    heard = int(17.5 * rate) * 2
    hear(ahead, pcm[first:heard], rate)
    await counted(lambda: encoder.stats.windows_ahead >= 3)  # window 1, and window 0 again under the new clamp
    tokens = await asyncio.wait_for(encoder.finish_turn(ahead, pcm), 120)
    assert (encoder.stats.windows_ahead, encoder.stats.windows_kept) == (3, 2)
    torch.testing.assert_close(tokens, alone(model, pcm, rate), **TOLERANCE)


async def test_a_turn_whose_heard_audio_cannot_be_read_fails_typed(encoder: InputEncoder) -> None:
    encoder.start()
    ahead = encoder.turn_ahead(24_000)
    ahead.hear(b"\x00\x00" * 10)
    with pytest.raises(EngineError) as refused:
        await asyncio.wait_for(encoder.finish_turn(ahead, b"\x00" * 21), 120)  # half a sample at the end
    assert refused.value.code == "invalid_audio"


async def test_a_turn_whose_heard_pieces_cannot_be_read_is_encoded_whole_at_its_end(
    model: Qwen3OmniModel, encoder: InputEncoder
) -> None:
    rate = 24_000
    pcm = speech(9.0, rate, seed=5)
    encoder.start()
    ahead = encoder.turn_ahead(rate)
    ahead.hear(b"\x00" * 3)  # half a sample: the heard audio is unreadable from here on
    hear(ahead, pcm, rate)
    await counted(lambda: ahead.broken)  # the encoder's thread read the pieces for the first window, and failed
    tokens = await asyncio.wait_for(encoder.finish_turn(ahead, pcm), 120)
    assert encoder.stats.windows_kept == 0
    torch.testing.assert_close(tokens, alone(model, pcm, rate), **TOLERANCE)


def test_the_audio_ahead_option_turns_hearing_ahead_off_and_a_bad_value_is_refused() -> None:
    assert Qwen3OmniServing(Qwen3OmniEngine.load("preset:tiny")).turn_ahead() is not None  # on by default
    assert Qwen3OmniServing(Qwen3OmniEngine.load("preset:tiny", audio_ahead="false")).turn_ahead() is None
    with pytest.raises(ValueError, match="audio_ahead must be true or false, not 'off-ish'"):
        Qwen3OmniEngine.load("preset:tiny", audio_ahead="off-ish")
