"""Text units tokenized where the text arrives: the gateway's ids equal the engine's, a unit that comes with its ids
is not tokenized again by the engine, and through the engine core the ids cross with the text."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from omnigate.engines.admission import AdmissionSettings
from omnigate.engines.base import (
    AudioChunk,
    EngineOutput,
    SegmentStarted,
    StreamDone,
    SynthesisParams,
    UnitTokens,
)
from omnigate.engines.core.client import connect_core_pool
from omnigate.engines.core.server import serve_core
from omnigate.engines.remote.replica import ReplicaCore
from omnigate.engines.talker.engine import TalkerEngine
from omnigate.engines.talker.model import build_preset
from omnigate.engines.talker.options import TalkerOptions
from omnigate.engines.talker.stream import TalkerStream
from omnigate.engines.unit_tokens import load_unit_encoder

UNLIMITED = 1e9
TEXTS = ["Grüße aus Köln, 3 × 4 = 12.", "A plain sentence."]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_engine(ms_per_char: float = 0.0) -> TalkerEngine:
    options = TalkerOptions(max_sessions=4, max_batch=4, dtype="float64", segment_ms_per_char=ms_per_char)
    return TalkerEngine(build_preset("tiny", seed=11), options)


@pytest.fixture(scope="module")
def engine() -> TalkerEngine:
    return make_engine()


class CountedEncode:
    """Counts the units the engine tokenizes itself."""

    def __init__(self, engine: TalkerEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.texts: list[str] = []
        encode = engine.model.segments.encode

        def counted(voice: str, text: str) -> list[int]:
            self.texts.append(text)
            return encode(voice, text)

        monkeypatch.setattr(engine.model.segments, "encode", counted)


def test_the_gateway_makes_the_engines_ids_from_the_bytes_or_a_tokenizer_file(
    engine: TalkerEngine, tmp_path: Path
) -> None:
    spec = engine.info.unit_tokens
    assert spec is not None and spec.tokenizer == "bytes" and spec.template == "csm"
    encoder = load_unit_encoder(spec)
    assert encoder is not None
    for voice in ("0", "1"):
        for text in TEXTS:
            assert encoder.encode(voice, text) == engine.model.segments.encode(voice, text)
    # A checkpoint's tokenizer travels as its tokenizer.json: the same file gives the same ids.
    file = tmp_path / "tokenizer.json"
    engine.model.tokenizer.backend_tokenizer.save(str(file))
    from_file = load_unit_encoder(UnitTokens("csm", str(file), spec.bos_id, spec.eos_id, spec.vocab_size))
    assert from_file is not None
    assert [from_file.encode("0", t) for t in TEXTS] == [engine.model.segments.encode("0", t) for t in TEXTS]
    # A file this process cannot read leaves the tokenization to the engine.
    missing = UnitTokens("csm", str(tmp_path / "absent.json"), spec.bos_id, spec.eos_id, spec.vocab_size)
    assert load_unit_encoder(missing) is None


def _audio(engine: TalkerEngine, stream: TalkerStream) -> bytes:
    out: list[EngineOutput] = []
    while stream.has_work:
        out.extend(engine.step([stream], [UNLIMITED])[0])
    assert out[-1] == StreamDone(reason="max_duration")
    return b"".join(o.pcm for o in out if isinstance(o, AudioChunk))


def test_a_unit_that_comes_with_its_ids_is_not_tokenized_again_and_sounds_the_same(
    engine: TalkerEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = engine.info.unit_tokens
    encoder = load_unit_encoder(spec)
    assert spec is not None and encoder is not None
    counted = CountedEncode(engine, monkeypatch)
    params = SynthesisParams(voice="0", max_audio_ms=800)
    given = engine.open(params, seed=5)
    for text in TEXTS:
        given.push_text(text, encoder.encode("0", text))
    given.input_done = True
    with_ids = _audio(engine, given)
    assert counted.texts == []
    plain = engine.open(params, seed=5)
    for text in TEXTS:
        plain.push_text(text)
    plain.input_done = True
    assert _audio(engine, plain) == with_ids
    assert counted.texts == TEXTS[:1]  # the engine tokenized the unit it spoke
    # Ids that cannot be the unit's (outside the vocabulary, or not framed by bos and eos) are not used.
    bad = engine.open(params, seed=5)
    bad.push_text(TEXTS[0], [spec.bos_id, spec.vocab_size, spec.eos_id])
    bad.push_text(TEXTS[1], [7, 8, 9])
    bad.input_done = True
    assert _audio(engine, bad) == with_ids
    assert counted.texts == TEXTS[:1] * 2


async def test_through_the_engine_core_the_ids_cross_with_the_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = make_engine(ms_per_char=4.0)  # each unit a frame or two
    counted = CountedEncode(served, monkeypatch)
    core = ReplicaCore(served, "core-under-test", admission=AdmissionSettings(policy="slots"))
    path = str(tmp_path / "core.sock")
    stop, ready = asyncio.Event(), asyncio.Event()
    server = asyncio.create_task(serve_core(core, path, stop, ready))
    try:
        async with asyncio.timeout(60):
            await ready.wait()
            pool, transport = await connect_core_pool(path)
            outputs: list[EngineOutput] = []
            audio, done = asyncio.Event(), asyncio.Event()

            def sink(items: list[EngineOutput]) -> None:
                outputs.extend(items)
                if any(isinstance(item, AudioChunk) for item in items):
                    audio.set()
                if any(isinstance(item, StreamDone) for item in items):
                    done.set()

            stream = pool.open(SynthesisParams(voice="1"), sink, initial_credit_ms=UNLIMITED)
            pool.push_text(stream, TEXTS[0])  # rides with the open call
            await audio.wait()  # admitted and speaking: the next unit goes through the control channel
            pool.push_text(stream, TEXTS[1])
            pool.end_input(stream)
            await done.wait()
            await pool.close()
            await transport.close()
        assert any(isinstance(item, AudioChunk) and item.pcm for item in outputs)
        assert outputs[-1] == StreamDone(reason="completed")
        assert [o.text for o in outputs if isinstance(o, SegmentStarted)] == TEXTS
        assert counted.texts == []  # the gateway side made the ids: the engine tokenized nothing
    finally:
        stop.set()
        await server
        await asyncio.to_thread(core.shutdown)
