"""The talker engine: continuous batching, chunk schedule, credit, slots, segments and stop reasons."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import pytest
import torch

from omnigate.engines.base import (
    AudioChunk,
    EngineError,
    EngineOutput,
    SegmentDone,
    SegmentStarted,
    StreamDone,
    SynthesisParams,
)
from omnigate.engines.pool import EnginePool
from omnigate.engines.registry import load_engine
from omnigate.engines.talker.context import ContextSegment
from omnigate.engines.talker.engine import STAGES, TalkerEngine, _profile_sizes
from omnigate.engines.talker.frames import CLOSING
from omnigate.engines.talker.model import build_preset
from omnigate.engines.talker.options import TalkerOptions
from omnigate.engines.talker.stream import TalkerStream

FRAME_MS = 80.0
UNLIMITED = 1e9


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Small tensors run fastest on one thread, and a shared CPU makes extra threads spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_engine(**options: Any) -> TalkerEngine:
    settings: dict[str, Any] = {
        "max_sessions": 4,
        "max_batch": 4,
        "dtype": "float64",
        "segment_ms_per_char": 0.0,  # random weights never stop by themselves: let units run to the caps tested
        **options,
    }
    return TalkerEngine(build_preset("tiny", seed=11), TalkerOptions(**settings))


@pytest.fixture(scope="module")
def engine() -> TalkerEngine:
    return make_engine()


def open_stream(
    engine: TalkerEngine, texts: Sequence[str], *, seed: int, max_audio_ms: int = 120_000, done: bool = True
) -> TalkerStream:
    stream = engine.open(SynthesisParams(voice="0", max_audio_ms=max_audio_ms), seed=seed)
    stream.pending_text.extend(texts)
    stream.input_done = done
    return stream


def drain(engine: TalkerEngine, stream: TalkerStream, budget: float = UNLIMITED) -> list[EngineOutput]:
    out: list[EngineOutput] = []
    while stream.has_work:
        out.extend(engine.step([stream], [budget])[0])
    return out


def audio_of(outputs: Sequence[EngineOutput]) -> bytes:
    return b"".join(o.pcm for o in outputs if isinstance(o, AudioChunk))


def chunk_frames(outputs: Sequence[EngineOutput]) -> list[int]:
    return [round(o.duration_ms / FRAME_MS) for o in outputs if isinstance(o, AudioChunk)]


def test_first_audio_leaves_after_one_step_then_chunks_ramp(engine: TalkerEngine) -> None:
    stream = open_stream(engine, ["Ramp up."], seed=1, max_audio_ms=2400)
    first = engine.step([stream], [UNLIMITED])[0]
    assert isinstance(first[0], SegmentStarted)
    assert isinstance(first[1], AudioChunk) and first[1].duration_ms == FRAME_MS
    assert first[1].sample_rate == 24_000
    rest = drain(engine, stream)
    assert chunk_frames(first + rest) == [1, 2, 4, 8, 8, 7]
    assert rest[-2:] == [SegmentDone(index=0, reason="max_duration"), StreamDone(reason="max_duration")]


def test_chunk_cap_is_configurable() -> None:
    capped = make_engine(chunk_first_frames=2, chunk_max_frames=4)
    outputs = drain(capped, open_stream(capped, ["Capped."], seed=1, max_audio_ms=1600))
    assert chunk_frames(outputs) == [2, 4, 4, 4, 4, 2]


def run_batched(engine: TalkerEngine, plan: dict[int, int], seeds: dict[int, int]) -> dict[int, bytes]:
    """Open stream ``k`` at step ``plan[k]`` and step every live stream together until all are done."""
    streams: dict[int, TalkerStream] = {}
    pcm: dict[int, bytes] = {k: b"" for k in plan}
    step = 0
    while len(streams) < len(plan) or any(s.has_work for s in streams.values()):
        for k, start in plan.items():
            if start == step:
                streams[k] = open_stream(engine, [f"Stream {k} speaks."], seed=seeds[k], max_audio_ms=800 + 160 * k)
        live = [k for k, s in streams.items() if s.has_work]
        outputs = engine.step([streams[k] for k in live], [UNLIMITED] * len(live))
        for k, out in zip(live, outputs, strict=True):
            pcm[k] += audio_of(out)
        step += 1
    return pcm


def test_a_stream_sounds_the_same_alone_or_batched_as_others_join_and_leave(engine: TalkerEngine) -> None:
    seeds = {0: 100, 1: 200, 2: 300}
    alone = {k: run_batched(engine, {k: 0}, seeds)[k] for k in seeds}
    # Stream 1 joins while 0 is mid-utterance and 2 joins later; they finish (leave) at different steps.
    together = run_batched(engine, {0: 0, 1: 3, 2: 5}, seeds)
    assert all(len(alone[k]) > 0 for k in seeds)
    assert together == alone
    assert alone[0] != alone[1]  # seeds matter
    assert engine.free_slots == engine.options.max_sessions


def test_a_new_stream_prefills_in_the_same_step_as_others_decode(engine: TalkerEngine) -> None:
    old = open_stream(engine, ["Already talking."], seed=1, max_audio_ms=800)
    engine.step([old], [UNLIMITED])
    new = open_stream(engine, ["Just joined."], seed=2, max_audio_ms=800)
    old_out, new_out = engine.step([old, new], [UNLIMITED, UNLIMITED])
    assert isinstance(new_out[0], SegmentStarted) and isinstance(new_out[1], AudioChunk)
    assert old_out == [] and old.draws == 2 and len(old.pending) == 1  # it decoded its next frame in the same step
    for stream in (old, new):
        engine.close(stream)


def test_abort_frees_the_slot_and_close_is_idempotent(engine: TalkerEngine) -> None:
    before = engine.free_slots
    streams = [open_stream(engine, ["Hold a slot."], seed=k) for k in range(3)]
    engine.step(streams, [UNLIMITED] * 3)
    assert engine.free_slots == before - 3
    engine.close(streams[1])
    assert engine.free_slots == before - 2
    engine.close(streams[1])
    assert engine.free_slots == before - 2
    assert not streams[1].has_work
    for stream in (streams[0], streams[2]):
        engine.close(stream)
    assert engine.free_slots == before


def test_budget_below_one_frame_does_not_advance(engine: TalkerEngine) -> None:
    stream = open_stream(engine, ["Wait for credit."], seed=3, max_audio_ms=800)
    assert engine.step([stream], [FRAME_MS - 1]) == [[]]
    assert stream.pending_text == ["Wait for credit."]
    engine.close(stream)


def test_audio_never_exceeds_credit(engine: TalkerEngine) -> None:
    stream = open_stream(engine, ["Paced by the client."], seed=4, max_audio_ms=2000)
    credit, emitted, grants = 250.0, 0.0, 0
    while stream.has_work:
        out = engine.step([stream], [credit])[0]
        produced = sum(o.duration_ms for o in out if isinstance(o, AudioChunk))
        assert produced <= credit
        credit -= produced
        emitted += produced
        if credit < FRAME_MS:  # the client drained its buffer: grant more, as a session would
            credit += 250.0
            grants += 1
    assert emitted == 2000.0 and grants >= 7


def test_each_text_unit_is_a_segment_with_earlier_ones_kept_as_context() -> None:
    eager = make_engine(eos_bias=1e4)  # every sampled frame is the end-of-audio frame
    stream = open_stream(eager, ["First.", "Second one."], seed=5, done=False)
    outputs = drain(eager, stream)
    assert outputs == [
        SegmentStarted(index=0, text="First."),
        SegmentDone(index=0, reason="completed"),
        SegmentStarted(index=1, text="Second one."),
        SegmentDone(index=1, reason="completed"),
    ]
    slot = stream.slot
    assert slot is not None
    first, second = (len(eager.model.segments.encode("0", t)) for t in ("First.", "Second one."))
    # The second prefill closed the first segment's audio with an end-of-audio frame and kept it all.
    assert eager.frames.cache.length(slot) == first + 1 + second
    stream.pending_text.append("Third.")
    stream.input_done = True
    assert drain(eager, stream)[-2:] == [SegmentDone(index=2, reason="completed"), StreamDone(reason="completed")]
    assert eager.free_slots == eager.options.max_sessions


def test_end_of_input_without_text_completes_the_stream(engine: TalkerEngine) -> None:
    stream = open_stream(engine, [], seed=6)
    assert drain(engine, stream) == [StreamDone(reason="completed")]


def test_max_duration_stops_the_utterance(engine: TalkerEngine) -> None:
    stream = open_stream(engine, ["Too long.", "Never said."], seed=7, max_audio_ms=250)
    outputs = drain(engine, stream)
    assert sum(o.duration_ms for o in outputs if isinstance(o, AudioChunk)) == 3 * FRAME_MS
    assert outputs[-2:] == [SegmentDone(index=0, reason="max_duration"), StreamDone(reason="max_duration")]


def test_a_full_context_window_ends_the_utterance() -> None:
    small = make_engine(max_context=40)
    text = "Thirty characters, give or take."
    outputs = drain(small, open_stream(small, [text, "Never said."], seed=12))
    frames = 40 - len(small.model.segments.encode("0", text)) + 1  # the prefill's frame, then one per free position
    assert sum(o.duration_ms for o in outputs if isinstance(o, AudioChunk)) == frames * FRAME_MS
    assert outputs[-2:] == [SegmentDone(index=0, reason="max_duration"), StreamDone(reason="max_duration")]


def test_a_unit_capped_by_its_length_ends_alone_and_the_utterance_goes_on() -> None:
    paced = make_engine(segment_ms_per_char=40.0)
    outputs = drain(paced, open_stream(paced, ["Six ch", "Eleven char"], seed=9))
    done = [o for o in outputs if not isinstance(o, (AudioChunk, SegmentStarted))]
    assert done == [
        SegmentDone(index=0, reason="max_duration"),
        SegmentDone(index=1, reason="max_duration"),
        StreamDone(reason="completed"),
    ]
    per_unit = [
        sum(o.duration_ms for o in outputs if isinstance(o, AudioChunk) and o.segment_index == i) for i in (0, 1)
    ]
    assert per_unit == [3 * FRAME_MS, 5 * FRAME_MS]  # floor(6 * 40 / 80), floor(11 * 40 / 80)


def test_presets_cap_units_at_speaking_pace_by_default() -> None:
    preset = TalkerEngine(build_preset("tiny", seed=11), TalkerOptions(max_sessions=1, max_batch=1))
    assert preset.segment_ms_per_char == 60.0


def test_a_silent_tail_stops_the_utterance() -> None:
    # A threshold above any signal makes every frame silent: the tail detector must trip after silence_s.
    hushed = make_engine(silence_dbfs=100.0, silence_s=0.4)
    outputs = drain(hushed, open_stream(hushed, ["Quiet.", "Never said."], seed=8))
    assert sum(o.duration_ms for o in outputs if isinstance(o, AudioChunk)) == 7 * FRAME_MS  # chunks 1, 2, 4
    assert outputs[-2:] == [SegmentDone(index=0, reason="silence"), StreamDone(reason="silence")]


def test_open_validates_voice(engine: TalkerEngine) -> None:
    with pytest.raises(EngineError) as caught:
        engine.open(SynthesisParams(voice="alloy"))
    assert caught.value.code == "unknown_voice"


def test_registry_loads_a_preset_with_string_options() -> None:
    loaded = load_engine("talker", "preset:tiny", max_sessions="3", temperature="0.7", chunk_max_frames="4")
    assert isinstance(loaded, TalkerEngine)
    info = loaded.info
    assert (info.family, info.model, info.sample_rate, info.max_sessions) == ("talker", "preset:tiny", 24_000, 3)
    assert info.synthetic and info.min_credit_ms == FRAME_MS
    assert loaded.options.temperature == 0.7 and loaded.schedule.cap == 4
    with pytest.raises(ValueError, match="invalid talker option"):
        load_engine("talker", "preset:tiny", top_k="-1")


async def test_served_through_the_engine_pool(engine: TalkerEngine) -> None:
    pool = EnginePool(engine)
    pool.start()
    received: list[EngineOutput] = []
    finished = asyncio.Event()

    def sink(items: list[EngineOutput]) -> None:
        received.extend(items)
        if any(isinstance(i, StreamDone) for i in items):
            finished.set()

    try:
        handle = pool.open(SynthesisParams(voice="1", max_audio_ms=640), sink, initial_credit_ms=UNLIMITED)
        pool.push_text(handle, "Through the pool.")
        pool.end_input(handle)
        await asyncio.wait_for(finished.wait(), timeout=60)
    finally:
        await asyncio.to_thread(pool.stop)
    assert chunk_frames(received) == [1, 2, 4, 1]
    assert received[-1] == StreamDone(reason="max_duration")
    assert engine.free_slots == engine.options.max_sessions


def tone_pcm(seconds: float) -> bytes:
    samples = torch.arange(int(24_000 * seconds), dtype=torch.float64)
    wave = 0.3 * torch.sin(2 * torch.pi * 220.0 * samples / 24_000)
    return (wave * 32767).round().to(torch.int16).numpy().astype("<i2").tobytes()


def test_reference_context_is_prefilled_before_the_first_unit(engine: TalkerEngine) -> None:
    context = [ContextSegment(speaker="1", text="Earlier words.", pcm=tone_pcm(0.5))]
    with_context = engine.open(SynthesisParams(voice="0", max_audio_ms=320), seed=21, context=context)
    with_context.pending_text.append("Now this.")
    with_context.input_done = True
    first = engine.step([with_context], [UNLIMITED])[0]
    assert isinstance(first[0], SegmentStarted)
    slot = with_context.slot
    assert slot is not None
    segments = engine.model.segments
    context_tokens = len(segments.encode("1", "Earlier words.")) + 7 + 1  # text, ceil(0.5 s / 80 ms) frames, end
    assert engine.frames.cache.length(slot) == context_tokens + len(segments.encode("0", "Now this."))
    with_audio = audio_of(first + drain(engine, with_context))
    plain = audio_of(drain(engine, open_stream(engine, ["Now this."], seed=21, max_audio_ms=320)))
    assert len(with_audio) == len(plain) and with_audio != plain


@pytest.mark.parametrize(
    "segment",
    [
        ContextSegment(speaker="7", text="Who?", pcm=b"\x00\x00"),
        ContextSegment(speaker="0", text="  ", pcm=b"\x00\x00"),
        ContextSegment(speaker="0", text="Odd bytes.", pcm=b"\x00"),
        ContextSegment(speaker="0", text="Too long.", pcm=bytes(2 * 24_000 * 31)),
    ],
)
def test_invalid_context_is_refused_at_open(engine: TalkerEngine, segment: ContextSegment) -> None:
    with pytest.raises(EngineError) as caught:
        engine.open(SynthesisParams(voice="0"), context=[segment])
    assert caught.value.code == "invalid_context"


def test_context_longer_than_the_window_is_refused_at_open() -> None:
    small = make_engine(max_context=64)
    with pytest.raises(EngineError, match="context window"):
        small.open(SynthesisParams(voice="0"), context=[ContextSegment(speaker="0", text="x", pcm=tone_pcm(6.0))])


def test_new_units_beyond_the_prefill_budget_start_next_step() -> None:
    budgeted = make_engine(prefill_tokens_per_step=20)
    streams = [open_stream(budgeted, ["A unit of some length."], seed=30 + k, max_audio_ms=400) for k in range(3)]
    first = budgeted.step(streams, [UNLIMITED] * 3)
    # The first unit always starts; the others exceed what is left of the budget and wait a step.
    assert [isinstance(out[0], SegmentStarted) if out else False for out in first] == [True, False, False]
    second = budgeted.step(streams, [UNLIMITED] * 3)
    assert isinstance(second[1][0], SegmentStarted)
    for stream in streams:
        budgeted.close(stream)


def test_a_unit_waiting_for_prefill_room_is_tokenized_once(monkeypatch: pytest.MonkeyPatch) -> None:
    budgeted = make_engine(prefill_tokens_per_step=20)
    encoded: list[str] = []
    encode = budgeted.model.segments.encode

    def counted(voice: str, text: str) -> list[int]:
        encoded.append(text)
        return encode(voice, text)

    monkeypatch.setattr(budgeted.model.segments, "encode", counted)
    texts = [f"Unit number {k} of some length." for k in range(4)]
    streams = [open_stream(budgeted, [text], seed=50 + k, max_audio_ms=400) for k, text in enumerate(texts)]
    started: set[int] = set()
    while len(started) < len(streams):  # one unit a step: the others wait for the budget, step after step
        for k, out in enumerate(budgeted.step(streams, [UNLIMITED] * len(streams))):
            if any(isinstance(item, SegmentStarted) for item in out):
                started.add(k)
    assert sorted(encoded) == sorted(texts)
    for stream in streams:
        budgeted.close(stream)


def test_top_p_and_repetition_penalty_change_the_draws_deterministically() -> None:
    plain = audio_of(drain(engine_a := make_engine(), open_stream(engine_a, ["Options."], seed=40, max_audio_ms=640)))
    for options in ({"top_p": 0.5}, {"repetition_penalty": 1.5, "repetition_window": 4}):
        tuned = make_engine(**options)
        once = audio_of(drain(tuned, open_stream(tuned, ["Options."], seed=40, max_audio_ms=640)))
        again = audio_of(drain(tuned, open_stream(tuned, ["Options."], seed=40, max_audio_ms=640)))
        assert once == again and len(once) == len(plain) and once != plain


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_steps_sound_the_same_as_eager_steps_on_the_gpu() -> None:
    audio = {}
    for graphs in (False, True):
        gpu = make_engine(device="cuda", dtype="float32", cuda_graphs=graphs, max_sessions=4, max_batch=4)
        assert (gpu.device_step.graphs is not None) == graphs
        stream = open_stream(gpu, ["On the device."], seed=50, max_audio_ms=1200)
        audio[graphs] = audio_of(drain(gpu, stream))
    assert len(audio[True]) == 15 * 1920 * 2 and audio[True] == audio[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_graphs_match_the_eager_prefill_and_leave_other_slots_alone() -> None:
    gpu = make_engine(device="cuda", dtype="float32", cuda_graphs=False, max_sessions=4, max_batch=4)
    frames = gpu.frames
    history = list(range(3, 10))
    units = [[5, 6, 7, 8, 9], [CLOSING, *range(20, 30)]]

    def prefill_twice() -> tuple[torch.Tensor, torch.Tensor]:
        for slot in range(4):
            frames.cache.reset(slot)
        frames.cache.keys.zero_()
        frames.cache.values.zero_()
        frames.prefill_ids([2], [history])  # slot 2 has context; slot 0 starts empty
        untouched = frames.cache.keys[:, 3].clone()
        out = frames.prefill_ids([0, 2], units)
        assert torch.equal(frames.cache.keys[:, 3], untouched)
        return out, frames.cache.keys[:, 2, : 7 + 11].clone()

    eager_out, eager_keys = prefill_twice()
    frames.capture_prefill(32)
    assert frames.prefill_graphs is not None and frames.prefill_graphs.buckets == [16, 32]
    graph_out, graph_keys = prefill_twice()
    torch.testing.assert_close(graph_out, eager_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graph_keys, eager_keys, rtol=1e-4, atol=1e-4)
    assert frames.cache.length(0) == 5 and frames.cache.length(2) == 7 + 11


def test_bucketed_prefills_of_every_size_equal_the_eager_prefill_and_leave_other_slots_alone() -> None:
    # The graphs' twin on the CPU: the same buckets, padding rows on the scratch slot and pieces, run eagerly.
    frames = make_engine().frames
    bucketed = frames.capture_prefill(24, capture=False)
    assert bucketed.buckets == [16, 24]
    history = list(range(3, 10))
    for tokens in range(1, 61):  # one bucket, the other, and prefills of two and three pieces
        share = tokens // 3
        sizes = [size for size in (share, tokens - 2 * share, share) if size]
        slots = [0, 1, 2][: len(sizes)]
        units = [[CLOSING, *(5 + (7 * k + j) % 90 for j in range(size - 1))] for k, size in enumerate(sizes)]
        results = []
        for graphs in (None, bucketed):
            frames.prefill_graphs = graphs
            for slot in range(4):
                frames.cache.reset(slot)
            frames.cache.keys.zero_()
            frames.cache.values.zero_()
            frames.prefill_ids([1], [history])  # slot 1 has context; the others start empty
            out = frames.prefill_ids(slots, units)
            lengths = [len(unit) + 7 * (slot == 1) for slot, unit in zip(slots, units, strict=True)]
            assert [frames.cache.length(slot) for slot in slots] == lengths
            streams = slice(0, frames.cache.scratch)  # every slot but the scratch one the padding rows write
            results.append((out, frames.cache.keys[:, streams].clone(), frames.cache.values[:, streams].clone()))
        (eager, eager_keys, eager_values), (graph, graph_keys, graph_values) = results
        assert graph.shape == (len(slots), eager.shape[1])
        torch.testing.assert_close(graph, eager, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(graph_keys, eager_keys, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(graph_values, eager_values, rtol=1e-9, atol=1e-9)


def test_prefill_from_ids_equals_the_prefill_of_their_embeddings() -> None:
    frames = make_engine().frames
    ids = [7, 8, 9, 10]
    embedded = torch.cat((frames.closing_embedding, frames.embed_text(ids)))
    for slot in (0, 1):
        frames.cache.reset(slot)
    from_ids = frames.prefill_ids([0], [[CLOSING, *ids]])
    from_embeddings = frames.prefill([1], [embedded])
    torch.testing.assert_close(from_ids, from_embeddings, rtol=0, atol=0)
    assert frames.cache.length(0) == frames.cache.length(1) == 5


def test_the_steps_time_is_counted_by_stage() -> None:
    timed = make_engine(overlap_steps=True)
    assert set(timed.stage_seconds()) == set(STAGES) and not any(timed.stage_seconds().values())
    drain(timed, open_stream(timed, ["Timed."], seed=1, max_audio_ms=800))
    stages = timed.stage_seconds()
    # every stage ran, and a stage's time is never negative (the device wait is not counted twice)
    assert all(seconds > 0 for seconds in stages.values()), stages


def test_the_step_time_by_batch_size_is_measured_at_load_and_prices_admission() -> None:
    fresh = make_engine()
    assert fresh.info.step_profile == ()  # a CPU step shares its cores: not priced by one measurement at load
    profile = tuple(fresh.device_step.time_steps(_profile_sizes(fresh.options.max_batch)))
    assert [rows for rows, _ in profile] == [1, 2, 4] and all(seconds > 0 for _, seconds in profile)
    fresh.info = msgspec.structs.replace(fresh.info, step_profile=profile)  # as a CUDA engine publishes it
    pool = EnginePool(fresh)  # not started: only its admission is read
    # Priced before any step ran: four streams stepped once per 80 ms frame, at least at the step of four rows.
    load = pool.admission.load(4)
    assert load is not None and load >= profile[-1][1] / 0.080 - 1e-12
