"""Overlapped talker steps (the next device step launched before the previous one's outputs are filed) give every
stream the same frames, chunks and events as steps that wait, whatever joins, leaves, is aborted or misses a step."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from omnigate.engines.base import AudioChunk, EngineOutput, SegmentStarted, StreamDone, SynthesisParams
from omnigate.engines.pool import EnginePool
from omnigate.engines.talker.engine import TalkerEngine
from omnigate.engines.talker.model import build_preset
from omnigate.engines.talker.options import TalkerOptions
from omnigate.engines.talker.stream import TalkerStream

FRAME_MS = 80.0
UNLIMITED = 1e9


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_engine(overlap: bool, **options: Any) -> TalkerEngine:
    settings: dict[str, Any] = {
        "max_sessions": 4,
        "max_batch": 4,
        "dtype": "float64",
        "segment_ms_per_char": 0.0,
        "overlap_steps": overlap,
        **options,
    }
    return TalkerEngine(build_preset("tiny", seed=11), TalkerOptions(**settings))


@dataclass
class Client:
    """One utterance and what its consumer received, with the credit a session would hold for it."""

    stream: TalkerStream
    credit: float
    received: list[EngineOutput] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # the step each output came from


@dataclass(frozen=True)
class Script:
    opens: dict[int, int]  # client -> step it opens at
    texts: dict[int, list[str]]
    max_audio_ms: dict[int, int]
    aborts: dict[int, int] = field(default_factory=dict)  # client -> step it is aborted at
    grant_ms: float = UNLIMITED  # credit each client gets back per step (its player draining)
    initial_ms: float = UNLIMITED


def simulate(engine: TalkerEngine, script: Script) -> dict[int, Client]:
    """Step the engine as the pool does: every stream with work and credit, at most ``max_batch`` a step, the batch
    rotating so that streams miss steps when there are more of them; credit spent as chunks arrive."""
    clients: dict[int, Client] = {}
    step = 0
    while len(clients) < len(script.opens) or any(c.stream.has_work for c in clients.values()):
        for k, start in script.opens.items():
            if start == step:
                stream = engine.open(SynthesisParams(voice="0", max_audio_ms=script.max_audio_ms[k]), seed=100 + k)
                stream.pending_text.extend(script.texts[k])
                stream.input_done = True
                clients[k] = Client(stream, script.initial_ms)
        for k, at in script.aborts.items():
            if at == step and k in clients:
                engine.close(clients[k].stream)
        ready = [k for k, c in clients.items() if c.stream.has_work and c.credit >= FRAME_MS]
        if ready:
            shift = step % len(ready)
            batch = (ready[shift:] + ready[:shift])[: engine.options.max_batch]
            outputs = engine.step([clients[k].stream for k in batch], [clients[k].credit for k in batch])
            for k, out in zip(batch, outputs, strict=True):
                spent = sum(o.duration_ms for o in out if isinstance(o, AudioChunk))
                assert spent <= clients[k].credit  # never more audio than the consumer has room for
                clients[k].credit -= spent
                clients[k].received.extend(out)
                clients[k].steps.extend([step] * len(out))
        for client in clients.values():
            client.credit += script.grant_ms
        step += 1
        assert step < 2_000
    return clients


def audio_by_segment(outputs: Sequence[EngineOutput]) -> dict[int, bytes]:
    audio: dict[int, bytes] = {}
    for o in outputs:
        if isinstance(o, AudioChunk):
            audio[o.segment_index] = audio.get(o.segment_index, b"") + o.pcm
    return audio


def events(outputs: Sequence[EngineOutput]) -> list[EngineOutput]:
    return [o for o in outputs if not isinstance(o, AudioChunk)]


def chunk_frames(outputs: Sequence[EngineOutput]) -> list[int]:
    return [round(o.duration_ms / FRAME_MS) for o in outputs if isinstance(o, AudioChunk)]


def test_overlap_is_on_by_default_only_for_cuda() -> None:
    engine = TalkerEngine(build_preset("tiny", seed=11), TalkerOptions(max_sessions=1, max_batch=1))
    assert engine.overlap_steps is False


def test_same_frames_chunks_and_events_as_waiting_steps_as_streams_join_and_leave() -> None:
    script = Script(
        opens={0: 0, 1: 2, 2: 5, 3: 9},
        texts={0: ["First one speaks.", "Then more."], 1: ["Second."], 2: ["Third, later."], 3: ["Last."]},
        max_audio_ms={0: 2000, 1: 800, 2: 1200, 3: 640},
    )
    waited = simulate(make_engine(False), script)
    overlapped = simulate(make_engine(True), script)
    for k in script.opens:
        assert overlapped[k].received == waited[k].received
        assert isinstance(waited[k].received[-1], StreamDone)
    assert chunk_frames(waited[0].received)[:4] == [1, 2, 4, 8]


def test_end_of_audio_frames_end_segments_the_same_way() -> None:
    # A large end-of-audio bias makes the random model stop its units after a few frames by itself.
    script = Script(
        opens={0: 0, 1: 1, 2: 1},
        texts={0: ["One.", "Two.", "Three."], 1: ["Another one.", "And more."], 2: ["Short."]},
        max_audio_ms={0: 4000, 1: 4000, 2: 4000},
    )
    waited = simulate(make_engine(False, eos_bias=9.0), script)
    overlapped = simulate(make_engine(True, eos_bias=9.0), script)
    completed = [e for c in waited.values() for e in events(c.received) if getattr(e, "reason", None) == "completed"]
    assert len(completed) >= 4  # segments ended by an end-of-audio frame, and streams completed
    for k in script.opens:
        assert overlapped[k].received == waited[k].received


def test_paced_credit_and_full_batches_keep_the_audio_and_events_of_every_stream() -> None:
    # Six streams in batches of four (each misses steps), each paced by a client that drains 100 ms a step.
    script = Script(
        opens={k: k for k in range(6)},
        texts={k: [f"Stream {k} speaks.", "Again."] for k in range(6)},
        max_audio_ms={k: 960 + 80 * k for k in range(6)},
        grant_ms=100.0,
        initial_ms=250.0,
    )
    options = {"max_sessions": 6, "max_batch": 4, "silence_dbfs": -300.0}
    waited = simulate(make_engine(False, **options), script)
    overlapped = simulate(make_engine(True, **options), script)
    for k in script.opens:
        assert audio_by_segment(overlapped[k].received) == audio_by_segment(waited[k].received)
        assert events(overlapped[k].received) == events(waited[k].received)
        assert sum(len(pcm) for pcm in audio_by_segment(waited[k].received).values()) == (960 + 80 * k) * 48


def test_silence_ends_the_utterance_and_the_frame_already_launched_is_dropped() -> None:
    script = Script(
        opens={0: 0, 1: 3}, texts={0: ["Quiet.", "Never said."], 1: ["Also quiet."]}, max_audio_ms={0: 9000, 1: 9000}
    )
    waited = simulate(make_engine(False, silence_dbfs=100.0, silence_s=0.4), script)
    engine = make_engine(True, silence_dbfs=100.0, silence_s=0.4)
    overlapped = simulate(engine, script)
    for k in script.opens:
        assert overlapped[k].received == waited[k].received
        assert overlapped[k].received[-1] == StreamDone(reason="silence")
    assert engine.free_slots == engine.options.max_sessions


def test_an_aborted_stream_drops_its_frame_in_flight_and_its_slot_serves_a_new_stream() -> None:
    script = Script(
        opens={0: 0, 1: 0, 2: 6},
        texts={0: ["Keeps talking."], 1: ["Cut off."], 2: ["Takes the freed slot."]},
        max_audio_ms={0: 1600, 1: 4000, 2: 960},
        aborts={1: 4},
    )
    options = {"max_sessions": 2, "max_batch": 2}
    waited = simulate(make_engine(False, **options), script)
    engine = make_engine(True, **options)
    overlapped = simulate(engine, script)
    for k in (0, 2):
        assert overlapped[k].received == waited[k].received
    # The aborted stream got what had been generated up to the abort, and nothing of the frame on the device.
    cut = audio_by_segment(overlapped[1].received)[0]
    assert cut and audio_by_segment(waited[1].received)[0].startswith(cut)
    assert not any(isinstance(o, StreamDone) for o in overlapped[1].received)
    assert engine.free_slots == 2


@pytest.mark.parametrize(
    ("script", "options"),
    [
        pytest.param(  # end-of-audio frames end units and streams: the filings ahead are undone
            Script(
                opens={0: 0, 1: 1, 2: 1},
                texts={0: ["One.", "Two.", "Three."], 1: ["Another one.", "And more."], 2: ["Short."]},
                max_audio_ms={0: 4000, 1: 4000, 2: 4000},
            ),
            {"eos_bias": 9.0},
            id="end-of-audio",
        ),
        pytest.param(  # units ended by end-of-audio frames start again as room in the prefill budget allows
            Script(
                opens={k: 0 for k in range(4)},
                texts={k: [f"Unit {k}.", f"Next {k}.", f"Last {k}."] for k in range(4)},
                max_audio_ms={k: 4000 for k in range(4)},
            ),
            {"eos_bias": 6.0, "prefill_tokens_per_step": 12},
            id="end-of-audio-and-prefill-room",
        ),
        pytest.param(  # unit and utterance caps reached by frames filed ahead, in batches that leave rows out;
            Script(
                opens={k: k for k in range(6)},
                texts={k: [f"Stream {k} speaks.", "Again."] for k in range(6)},
                max_audio_ms={k: 480 + 80 * k for k in range(6)},
                grant_ms=100.0,
                initial_ms=250.0,
            ),
            # a prefill budget that holds about one unit: units wait for room, in row order
            {
                "max_sessions": 6,
                "max_batch": 4,
                "silence_dbfs": -300.0,
                "segment_ms_per_char": 40.0,
                "prefill_tokens_per_step": 24,
            },
            id="caps-paced-credit-and-prefill-room",
        ),
        pytest.param(  # silence ends streams; a stream is aborted with a frame in flight
            Script(
                opens={0: 0, 1: 0, 2: 3},
                texts={0: ["Quiet.", "Never said."], 1: ["Cut off."], 2: ["Also quiet."]},
                max_audio_ms={0: 9000, 1: 9000, 2: 9000},
                aborts={1: 2},
            ),
            {"silence_dbfs": 100.0, "silence_s": 0.4},
            id="silence-and-abort",
        ),
        pytest.param(  # the silence detector reads each frame's level, which comes after the wait
            Script(
                opens={0: 0, 1: 1},
                texts={0: ["Spoken at a level."], 1: ["So is this."]},
                max_audio_ms={0: 1600, 1: 1600},
            ),
            {"silence_s": 0.4},
            id="frame-levels",
        ),
    ],
)
def test_filing_and_planning_ahead_of_the_wait_change_no_frame_chunk_or_event(
    script: Script, options: dict[str, Any]
) -> None:
    waited = simulate(make_engine(False, **options), script)
    after = simulate(make_engine(True, file_ahead=False, **options), script)
    filed_ahead = simulate(make_engine(True, plan_ahead=False, **options), script)
    ahead = make_engine(True, **options)
    assert ahead.file_ahead and ahead.plan_ahead
    planned_ahead = simulate(ahead, script)
    for k in script.opens:
        # the same outputs from the same steps: nothing started, ended or left a step earlier or later
        assert (filed_ahead[k].received, filed_ahead[k].steps) == (after[k].received, after[k].steps)
        assert (planned_ahead[k].received, planned_ahead[k].steps) == (after[k].received, after[k].steps)
        if k not in script.aborts:
            assert after[k].received == waited[k].received
            assert isinstance(waited[k].received[-1], StreamDone)
    assert ahead.free_slots == ahead.options.max_sessions


def test_first_audio_leaves_one_call_after_its_frame_is_launched() -> None:
    engine = make_engine(True)
    stream = engine.open(SynthesisParams(voice="0", max_audio_ms=800), seed=1)
    stream.pending_text.append("Hello.")
    stream.input_done = True
    first = engine.step([stream], [UNLIMITED])[0]
    assert [type(o) for o in first] == [SegmentStarted] and stream.in_flight and stream.has_work
    second = engine.step([stream], [UNLIMITED])[0]
    assert isinstance(second[0], AudioChunk) and second[0].duration_ms == FRAME_MS


async def test_served_through_the_engine_pool_with_overlap() -> None:
    engine = make_engine(True)
    pool = EnginePool(engine)
    pool.start()
    received: dict[int, list[EngineOutput]] = {0: [], 1: []}
    finished = asyncio.Event()

    def sink(k: int) -> Any:
        def deliver(items: list[EngineOutput]) -> None:
            received[k].extend(items)
            if all(r and isinstance(r[-1], StreamDone) for r in received.values()):
                finished.set()

        return deliver

    try:
        for k in received:
            handle = pool.open(
                SynthesisParams(voice="1", max_audio_ms=640 + 160 * k), sink(k), initial_credit_ms=UNLIMITED
            )
            pool.push_text(handle, f"Through the pool, {k}.")
            pool.end_input(handle)
        await asyncio.wait_for(finished.wait(), timeout=60)
    finally:
        await asyncio.to_thread(pool.stop)
    assert chunk_frames(received[0]) == [1, 2, 4, 1] and chunk_frames(received[1]) == [1, 2, 4, 3]
    assert received[1][-1] == StreamDone(reason="max_duration")
    assert engine.free_slots == engine.options.max_sessions


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlapped_cuda_graph_steps_give_the_same_outputs_as_waiting_ones_on_the_gpu() -> None:
    script = Script(
        opens={0: 0, 1: 2, 2: 5, 3: 6},
        texts={k: [f"Stream {k} speaks.", "More."] for k in range(4)},
        max_audio_ms={0: 2400, 1: 1600, 2: 1200, 3: 800},
        aborts={3: 9},
    )
    # Unlimited credit and a batch that holds everyone: both engines run the same rows in every device step, so
    # the same kernels see the same shapes and the audio must match bit for bit.
    options = {"device": "cuda", "dtype": "float32", "max_sessions": 4, "max_batch": 4, "silence_dbfs": -300.0}
    waited = simulate(make_engine(False, **options), script)
    engine = make_engine(True, **options)
    assert engine.device_step.graphs is not None
    overlapped = simulate(engine, script)
    for k in (0, 1, 2):
        assert audio_by_segment(overlapped[k].received) == audio_by_segment(waited[k].received)
        assert events(overlapped[k].received) == events(waited[k].received)
    assert engine.free_slots == 4
