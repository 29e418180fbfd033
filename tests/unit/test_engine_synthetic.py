"""The synthetic engine driven directly: spec parsing, determinism, chunking, budgets and its cost model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from omnigate.engines import synthetic
from omnigate.engines.base import (
    AudioChunk,
    EngineError,
    EngineOutput,
    SegmentDone,
    SegmentStarted,
    StreamDone,
    SynthesisParams,
)
from omnigate.engines.registry import load_engine
from omnigate.engines.synthetic import SyntheticEngine, SyntheticSpecError, SyntheticStream

MAX_STEPS = 10_000


def params_for(**params: object) -> SynthesisParams:
    return msgspec.convert({"voice": "tone", **params}, SynthesisParams)


def open_stream(engine: SyntheticEngine, units: Sequence[str], **params: object) -> SyntheticStream:
    stream = engine.open(params_for(**params))
    stream.pending_text.extend(units)
    stream.input_done = True
    return stream


def run_to_end(engine: SyntheticEngine, stream: SyntheticStream, budget_ms: float = 60_000.0) -> list[EngineOutput]:
    outputs: list[EngineOutput] = []
    for _ in range(MAX_STEPS):
        outputs.extend(engine.step([stream], [budget_ms])[0])
        if outputs and isinstance(outputs[-1], StreamDone):
            return outputs
    raise AssertionError(f"no StreamDone after {MAX_STEPS} steps")


def chunks_of(outputs: Sequence[EngineOutput]) -> list[AudioChunk]:
    return [o for o in outputs if isinstance(o, AudioChunk)]


def pcm_of(outputs: Sequence[EngineOutput]) -> bytes:
    return b"".join(c.pcm for c in chunks_of(outputs))


def audio_ms(outputs: Sequence[EngineOutput]) -> float:
    return sum(c.duration_ms for c in chunks_of(outputs))


def test_defaults() -> None:
    for spec in (None, "", "synthetic"):
        info = SyntheticEngine.from_spec(spec).info
        assert (info.family, info.model, info.synthetic) == ("synthetic", "synthetic", True)
        assert (info.sample_rate, info.max_sessions, info.max_batch, info.workers) == (24_000, 1000, 64, 1)
        assert info.voice_ids() == {"tone", "noise"}
        assert info.default_voice == "tone"
        assert info.capabilities.speed


def test_spec_is_parsed_into_typed_options() -> None:
    engine = SyntheticEngine.from_spec("rtf=0.5, first_chunk_delay_ms=100,sample_rate=22050,chunk_ms=20")
    assert engine.config == synthetic.SyntheticConfig(
        rtf=0.5, first_chunk_delay_ms=100.0, sample_rate=22050, chunk_ms=20
    )
    assert engine.info.sample_rate == 22050


def test_keyword_options_combine_with_the_spec() -> None:
    engine = SyntheticEngine.from_spec("rtf=0.25", max_sessions=3, seed=7)
    assert (engine.config.rtf, engine.info.max_sessions, engine.config.seed) == (0.25, 3, 7)


def test_registry_loads_it() -> None:
    engine = load_engine("synthetic", "chunk_ms=20")
    assert isinstance(engine, SyntheticEngine)
    assert engine.config.chunk_ms == 20


@pytest.mark.parametrize(
    ("spec", "options", "match"),
    [
        ("rtf=fast", {}, r"\$\.rtf"),
        ("bogus=1", {}, "bogus"),
        ("rtf", {}, "key=value"),
        ("rtf=", {}, "key=value"),
        ("rtf=0.5,rtf=0.6", {}, "twice"),
        ("sample_rate=22050.5", {}, "sample_rate"),
        ("chunk_ms=0", {}, "chunk_ms"),
        ("rtf=-1", {}, "rtf"),
        ("max_batch=0", {}, "max_batch"),
        ("rtf=0.5", {"rtf": 0.2}, "both"),
        (None, {"workers": 2}, "workers"),
    ],
)
def test_bad_specs_raise_typed_errors(spec: str | None, options: dict[str, Any], match: str) -> None:
    with pytest.raises(SyntheticSpecError, match=match):
        SyntheticEngine.from_spec(spec, **options)


@pytest.mark.parametrize("voice", ["tone", "noise"])
def test_same_params_give_identical_bytes(voice: str) -> None:
    units = ["Hello there.", "A second sentence, longer than the first one."]
    runs = []
    for _ in range(2):
        engine = SyntheticEngine.from_spec("seed=3")
        runs.append(pcm_of(run_to_end(engine, open_stream(engine, units, voice=voice))))
    assert runs[0] == runs[1]
    assert len(runs[0]) > 0


def test_output_does_not_depend_on_how_credit_arrives() -> None:
    engine = SyntheticEngine.from_spec("seed=1")
    for voice in ("tone", "noise"):
        ample = pcm_of(run_to_end(engine, open_stream(engine, ["Some words here."], voice=voice), 1000.0))
        trickled = pcm_of(run_to_end(engine, open_stream(engine, ["Some words here."], voice=voice), 25.0))
        assert ample == trickled


def test_voices_and_seeds_differ() -> None:
    seed_1 = SyntheticEngine.from_spec("seed=1")
    seed_2 = SyntheticEngine.from_spec("seed=2")
    noise_1 = pcm_of(run_to_end(seed_1, open_stream(seed_1, ["abc"], voice="noise")))
    noise_2 = pcm_of(run_to_end(seed_2, open_stream(seed_2, ["abc"], voice="noise")))
    tone = pcm_of(run_to_end(seed_1, open_stream(seed_1, ["abc"])))
    assert len({noise_1, noise_2, tone}) == 3


def test_segments_and_chunk_sizes() -> None:
    engine = SyntheticEngine.from_spec("chunk_ms=40")
    outputs = run_to_end(engine, open_stream(engine, ["abcde", "...", "xyz"]))
    events = [o for o in outputs if not isinstance(o, AudioChunk)]
    assert events == [
        SegmentStarted(index=0, text="abcde"),
        SegmentDone(index=0),
        SegmentStarted(index=1, text="..."),
        SegmentDone(index=1),
        SegmentStarted(index=2, text="xyz"),
        SegmentDone(index=2),
        StreamDone(reason="completed"),
    ]
    # 300 ms = 7 x 40 + 20; 180 ms = 4 x 40 + 20: only the last chunk of a segment is short.
    assert [round(c.duration_ms) for c in chunks_of(outputs) if c.segment_index == 0] == [40] * 7 + [20]
    assert [round(c.duration_ms) for c in chunks_of(outputs) if c.segment_index == 2] == [40] * 4 + [20]


@pytest.mark.parametrize(
    ("text", "speed", "expected_ms"),
    [("abcde", 1.0, 300.0), ("ab cd", 1.0, 240.0), ("abcde", 2.0, 150.0), ("!?", 1.0, 0.0)],
)
def test_audio_length_follows_characters(text: str, speed: float, expected_ms: float) -> None:
    engine = SyntheticEngine.from_spec(None)
    assert audio_ms(run_to_end(engine, open_stream(engine, [text], speed=speed))) == pytest.approx(expected_ms)


def test_budget_is_respected() -> None:
    engine = SyntheticEngine.from_spec("chunk_ms=40")
    stream = open_stream(engine, ["a long enough sentence"])
    # One chunk per step at most, cut to the budget down to 20 ms, nothing below that.
    assert [round(c.duration_ms) for c in chunks_of(engine.step([stream], [100.0])[0])] == [40]
    assert [round(c.duration_ms) for c in chunks_of(engine.step([stream], [30.0])[0])] == [30]
    assert engine.step([stream], [19.0]) == [[]]
    assert stream.has_work


def test_max_audio_ms_stops_the_stream() -> None:
    engine = SyntheticEngine.from_spec(None)
    outputs = run_to_end(engine, open_stream(engine, ["abcde", "abcde"], max_audio_ms=500))
    assert audio_ms(outputs) == pytest.approx(500.0)
    assert outputs[-2:] == [SegmentDone(index=1, reason="max_duration"), StreamDone(reason="max_duration")]


def test_batch_step_advances_every_stream() -> None:
    engine = SyntheticEngine.from_spec(None)
    streams = [open_stream(engine, [f"stream {i}"]) for i in range(64)]
    outputs = engine.step(streams, [1000.0] * 64)
    assert len(outputs) == 64
    for out in outputs:
        assert isinstance(out[0], SegmentStarted)
        assert len(chunks_of(out)) == 1


def test_close_drops_state_and_is_idempotent() -> None:
    engine = SyntheticEngine.from_spec(None)
    stream = open_stream(engine, ["abcdef", "more"])
    engine.step([stream], [40.0])
    engine.close(stream)
    engine.close(stream)
    assert not stream.has_work
    assert stream.pending_text == []
    assert engine.step([stream], [1000.0]) == [[]]


def test_step_sleeps_for_simulated_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("omnigate.engines.synthetic.time.sleep", slept.append)
    engine = SyntheticEngine.from_spec("rtf=0.5,first_chunk_delay_ms=100,chunk_ms=40")
    streams = [open_stream(engine, ["abcdef"]), open_stream(engine, ["a"])]
    engine.step(streams, [1000.0, 1000.0])  # first audio of both: delay + 0.5 x 40 ms
    engine.step(streams, [1000.0, 1000.0])  # the longest chunk is 40 ms
    engine.step(streams, [30.0, 1000.0])  # budget cuts it to 30 ms; the other stream is done
    assert slept == pytest.approx([0.12, 0.02, 0.015])


@pytest.mark.parametrize(
    ("params", "code"),
    [
        ({"voice": "cello"}, "unknown_voice"),
        ({"speed": 8.0}, "invalid_speed"),
        ({"max_audio_ms": 0}, "invalid_value"),
    ],
)
def test_open_refuses_bad_params(params: dict[str, object], code: str) -> None:
    with pytest.raises(EngineError) as caught:
        SyntheticEngine.from_spec(None).open(params_for(**params))
    assert caught.value.code == code
