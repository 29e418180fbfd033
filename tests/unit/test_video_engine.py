"""The video engine on the tiny preset: refusals before work, streaming order, credit, cancel, slots, shutdown.

Order is proven from the engine's own timeline (what happened before what), never from elapsed time. Where a test
must wait for the worker to reach a state, it polls that state with a deadline that only bounds a failing run.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Callable, Iterator

import av
import numpy as np
import pytest

from omnigate.codecs.video import FragmentedMp4Writer
from omnigate.engines.base import EngineError
from omnigate.engines.video.engine import VideoEngine, VideoJob
from omnigate.engines.video.model import VideoModel, build_preset
from omnigate.engines.video.outputs import FrameGroup, VideoDone, decoded_before_first_consumed
from omnigate.engines.video.request import VideoOptions, VideoRequest

WINDOW = 5  # frames in flight: the first two latent frames (1 + 4 video frames), no more


@pytest.fixture(scope="module")
def model() -> VideoModel:
    return build_preset("tiny")


@pytest.fixture
def engine(model: VideoModel) -> Iterator[VideoEngine]:
    engine = VideoEngine(
        model, VideoOptions(max_sessions=2, max_frames_in_flight=WINDOW, max_video_pixels=64 * 64 * 17)
    )
    engine.start()
    yield engine
    engine.stop()


def request(engine: VideoEngine, **fields: object) -> VideoRequest:
    base: dict[str, object] = {"num_frames": 17, "steps": 2, "seed": 1}
    base.update(fields)
    return engine.resolve("a red fox in the snow", **base)  # type: ignore[arg-type]


def drain(job: VideoJob, consume: bool = True) -> tuple[list[FrameGroup], VideoDone]:
    groups: list[FrameGroup] = []
    while True:
        output = job.wait_output(timeout=60)
        if isinstance(output, VideoDone):
            return groups, output
        groups.append(output)
        if consume:
            job.consumed(output.count)


def wait_until(predicate: Callable[[], bool], limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("the engine never reached the expected state")
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"width": 60}, "invalid_size", "width"),
        ({"height": 0}, "invalid_size", "height"),
        ({"num_frames": 8}, "invalid_frames", "num_frames"),
        ({"num_frames": 0}, "invalid_frames", "num_frames"),
        ({"num_frames": 21}, "too_large", "num_frames"),
        ({"width": 128, "height": 128, "num_frames": 5}, "too_large", "num_frames"),
        ({"steps": 0}, "invalid_value", "steps"),
        ({"fps": 0}, "invalid_value", "fps"),
        ({"seed": -1}, "invalid_value", "seed"),
        ({"guidance_scale": 100.0}, "invalid_value", "guidance_scale"),
    ],
)
def test_invalid_requests_are_refused_before_any_work(
    engine: VideoEngine, fields: dict[str, object], code: str, param: str
) -> None:
    with pytest.raises(EngineError) as refused:
        engine.submit(request(engine, **fields))
    assert (refused.value.code, refused.value.param) == (code, param)
    assert engine.free_slots == 2
    assert (engine.prompts_encoded, engine.steps_run, engine.latent_frames_decoded) == (0, 0, 0)


def test_an_empty_prompt_is_refused(engine: VideoEngine) -> None:
    with pytest.raises(EngineError) as refused:
        engine.submit(engine.resolve("  ", seed=0))
    assert refused.value.param == "prompt"


def test_a_generation_streams_every_frame_in_order(engine: VideoEngine) -> None:
    job = engine.submit(request(engine))
    groups, done = drain(job)
    assert [g.count for g in groups] == [1, 4, 4, 4, 4]
    assert [g.first_frame for g in groups] == [0, 1, 5, 9, 13]
    assert [g.latent_index for g in groups] == [0, 1, 2, 3, 4]
    assert {g.frames.shape[1:] for g in groups} == {(64, 64, 3)}
    assert all(g.frames.dtype == np.uint8 for g in groups)
    assert (done.status, done.frames, done.latent_frames) == ("completed", 17, 5)
    assert engine.free_slots == 2 and engine.active == 0
    steps = [e.index for e in done.timeline if e.kind == "step"]
    assert steps == [1, 2]


def test_a_seed_fixes_the_video(engine: VideoEngine) -> None:
    def video(seed: int) -> np.ndarray:
        groups, _ = drain(engine.submit(request(engine, num_frames=5, seed=seed)))
        return np.concatenate([g.frames for g in groups])

    first = video(3)
    assert np.array_equal(first, video(3))
    assert not np.array_equal(first, video(4))


def test_the_first_fragment_leaves_before_the_last_latent_frame_is_decoded_and_the_stream_plays(
    engine: VideoEngine,
) -> None:
    """The consumer encodes each group to fMP4 as it arrives and reports it sent; the decoder may run at most
    WINDOW frames ahead, so the timeline must show the first send before the last decode."""
    job = engine.submit(request(engine))
    writer = FragmentedMp4Writer(64, 64, job.request.fps)
    stream = writer.begin()
    while True:
        output = job.wait_output(timeout=60)
        if isinstance(output, VideoDone):
            break
        stream += writer.push(output.frames)
        job.consumed(output.count)
    stream += writer.finish()
    kinds = [(e.kind, e.index) for e in output.timeline]
    first_sent = kinds.index(("consumed", 1))
    last_decoded = kinds.index(("decoded", 4))
    assert first_sent < last_decoded
    assert decoded_before_first_consumed(output.timeline) < output.latent_frames
    with av.open(io.BytesIO(stream)) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 17
    assert {(f.width, f.height) for f in frames} == {(64, 64)}
    assert writer.fragments == 5


def test_decoding_waits_for_the_consumer_and_resumes_with_credit(engine: VideoEngine) -> None:
    job = engine.submit(request(engine))
    first, second = job.wait_output(timeout=60), job.wait_output(timeout=60)
    assert isinstance(first, FrameGroup) and isinstance(second, FrameGroup)
    wait_until(lambda: job.parked)
    assert job.next_latent == 2  # nothing decoded past the window
    assert job.poll() is None
    job.consumed(first.count + second.count)
    groups, done = drain(job)
    assert [g.count for g in groups] == [4, 4, 4]
    assert done.status == "completed"


def test_cancel_while_decoding_stops_and_frees_everything(engine: VideoEngine) -> None:
    threads = threading.active_count()
    job = engine.submit(request(engine))
    first = job.wait_output(timeout=60)
    assert isinstance(first, FrameGroup)
    wait_until(lambda: job.parked)  # decoding, out of credit: cancel lands mid-clip
    job.cancel()
    groups, done = drain(job, consume=False)
    assert done.status == "cancelled"
    assert done.frames == 5  # the two latent frames decoded before the cancel, nothing after
    assert len(groups) == 1
    assert engine.active == 0 and engine.free_slots == 2
    assert job.decoder is None and job.vae_latents is None and job.denoiser is None
    assert threading.active_count() == threads
    job.cancel()  # idempotent once finished
    assert job.poll() is None


def test_cancel_while_denoising_stops_at_the_next_step(engine: VideoEngine) -> None:
    job = engine.submit(request(engine, steps=100))
    wait_until(lambda: any(e.kind == "step" for e in job.timeline))
    job.cancel()
    steps_at_cancel = sum(e.kind == "step" for e in job.timeline)
    _, done = drain(job)
    assert done.status == "cancelled" and done.frames == 0
    assert sum(e.kind == "step" for e in done.timeline) <= steps_at_cancel + 1
    assert engine.free_slots == 2


def test_generations_over_the_slot_count_are_refused_typed(engine: VideoEngine) -> None:
    jobs = [engine.submit(request(engine, steps=100)) for _ in range(2)]
    with pytest.raises(EngineError) as refused:
        engine.submit(request(engine))
    assert refused.value.code == "server_busy"
    for job in jobs:
        job.cancel()
    assert [drain(job)[1].status for job in jobs] == ["cancelled", "cancelled"]
    assert engine.free_slots == 2


def test_stop_cancels_generations_and_joins_the_worker(model: VideoModel) -> None:
    engine = VideoEngine(model, VideoOptions(max_sessions=1))
    engine.start()
    job = engine.submit(engine.resolve("a fox", num_frames=5, steps=100, seed=0))
    engine.stop()
    _, done = drain(job)
    assert (done.status, done.code) == ("cancelled", "shutting_down")
    assert not any(t.name == "omnigate-video" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(EngineError) as refused:
        engine.submit(engine.resolve("a fox", num_frames=5, seed=0))
    assert refused.value.code == "shutting_down"


async def test_outputs_can_be_awaited_on_an_event_loop(engine: VideoEngine) -> None:
    job = engine.submit(request(engine, num_frames=9), loop=asyncio.get_running_loop())
    counts = []
    while True:
        output = await asyncio.wait_for(job.next_output(), 60)
        if isinstance(output, VideoDone):
            break
        counts.append(output.count)
        job.consumed(output.count)
    assert counts == [1, 4, 4]
    assert output.status == "completed"
