"""The live engine's decode overlap: a chunk's VAE decode on the decode thread while the next chunk denoises, decodes
of several streams in one VAE call, a prompt applied from the next denoising step, and streams that end typed when
a decode fails or is cancelled (tiny preset, float32 on the CPU).

The worker and the decode thread are held at chosen points with events, never with sleeps; ``wait_until`` polls the
engine's counters and its deadline only bounds a failing run.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from omnigate.engines.video import live
from omnigate.engines.video.engine import VideoEngine
from omnigate.engines.video.live import LiveVideoEngine
from omnigate.engines.video.model import build_preset
from omnigate.engines.video.outputs import FrameGroup, PromptUpdated, VideoDone
from omnigate.engines.video.vae_stream import StreamingVaeDecoder, decode_together

STEPS = 4  # the tiny preset's default: 4 denoising forwards and one cache forward per chunk


def live_engine(**options: str) -> LiveVideoEngine:
    """The tiny live engine, decoding on its decode thread unless the options say otherwise."""
    engine = VideoEngine.load("preset:tiny-causal", max_live_seconds="5", **{"overlap_decode": "true", **options})
    assert isinstance(engine, LiveVideoEngine)
    return engine


def drain(job: Any) -> list[Any]:
    outputs: list[Any] = []
    while True:
        output = job.wait_output(120)
        outputs.append(output)
        if isinstance(output, FrameGroup):
            job.consumed(output.count)
        if isinstance(output, VideoDone):
            return outputs


def wait_until(predicate: Any, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "the engine never reached the expected state"
        time.sleep(0.01)


class HeldDecodes:
    """Wraps the engine's VAE call: each call waits until released (or raises what it was given)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, raise_: BaseException | None = None) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.calls = 0
        self.raise_ = raise_
        monkeypatch.setattr(live, "decode_together", self)

    def __call__(self, decoders: list[StreamingVaeDecoder], latents: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls += 1
        self.entered.release()
        if self.raise_ is not None:
            raise self.raise_
        assert self.release.wait(120)
        return decode_together(decoders, latents)


def run_with_switch(monkeypatch: pytest.MonkeyPatch, overlap: str, switch_at: int | None) -> list[Any]:
    """One live stream; its prompt is changed from inside the transformer forward number ``switch_at``, so the
    change lands at the same denoising step whatever the threads' timing."""
    engine = live_engine(overlap_decode=overlap)
    job = engine.submit(engine.resolve("a fox", live=True, seed=3))
    forward = live.causal_forward
    calls = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == switch_at:
            job.set_prompt("a dog")
        return forward(*args, **kwargs)

    monkeypatch.setattr(live, "causal_forward", counted)
    engine.start()
    try:
        return drain(job)
    finally:
        engine.stop()


def test_overlapped_decodes_give_the_serial_frames_bit_for_bit_with_a_prompt_switched_mid_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Forward 7 is chunk 1's second step (chunk 0 took forwards 1-5): the new prompt applies from its third step.
    overlapped = run_with_switch(monkeypatch, "true", switch_at=STEPS + 1 + 2)
    serial = run_with_switch(monkeypatch, "false", switch_at=STEPS + 1 + 2)
    unswitched = run_with_switch(monkeypatch, "true", switch_at=None)
    groups = [[o for o in outputs if isinstance(o, FrameGroup)] for outputs in (overlapped, serial, unswitched)]
    assert [g.count for g in groups[0]] == [9, 12, 12, 7]
    for ours, theirs in zip(groups[0], groups[1], strict=True):
        assert (ours.chunk_index, ours.prompt_id, ours.first_frame) == (
            theirs.chunk_index,
            theirs.prompt_id,
            theirs.first_frame,
        )
        assert np.array_equal(ours.frames, theirs.frames)
    for outputs in (overlapped, serial):
        update = next(o for o in outputs if isinstance(o, PromptUpdated))
        assert (update.prompt_id, update.chunk_index, update.step) == (1, 1, 2)
        chunks = [o for o in outputs if isinstance(o, FrameGroup)]
        assert outputs.index(chunks[0]) < outputs.index(update) < outputs.index(chunks[1])
        assert [g.prompt_id for g in chunks] == [0, 1, 1, 1]
    # The switch changed chunk 1 itself, not only the chunks after it.
    assert np.array_equal(groups[0][0].frames, groups[2][0].frames)
    assert not np.array_equal(groups[0][1].frames, groups[2][1].frames)


def test_a_new_prompt_reruns_the_last_step_of_a_clean_chunk_still_waiting_for_the_vae(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = HeldDecodes(monkeypatch)
    engine = live_engine()
    engine.start()
    try:
        job = engine.submit(engine.resolve("a fox", live=True, seed=3))
        assert held.entered.acquire(timeout=60)  # chunk 0 held in the VAE
        wait_until(lambda: engine.steps_run == 2 * STEPS and job.stage is live._Stage.DECODE)  # chunk 1 clean, waiting
        job.set_prompt("a dog")
        wait_until(lambda: engine.steps_run == 2 * STEPS + 1)  # its last step again, under the new prompt
        held.release.set()
        outputs = drain(job)
    finally:
        engine.stop()
    update = next(o for o in outputs if isinstance(o, PromptUpdated))
    assert (update.chunk_index, update.step) == (1, STEPS - 1)
    # Exactly what a prompt given just before chunk 1's last step makes (set during forward 8, chunk 1's third).
    monkeypatch.undo()
    expected = run_with_switch(monkeypatch, "false", switch_at=STEPS + 1 + 3)
    ours = [o for o in outputs if isinstance(o, FrameGroup)]
    theirs = [o for o in expected if isinstance(o, FrameGroup)]
    assert [g.prompt_id for g in ours] == [g.prompt_id for g in theirs] == [0, 1, 1, 1]
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(ours, theirs, strict=True))


def test_a_chunk_decodes_while_the_next_one_denoises(monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldDecodes(monkeypatch)
    engine = live_engine()
    engine.start()
    try:
        job = engine.submit(engine.resolve("a fox", live=True, seed=1))
        assert held.entered.acquire(timeout=60)  # chunk 0 is in the VAE, held there
        # The worker denoises chunk 1 meanwhile and waits to hand it over: one chunk past the one in the VAE.
        wait_until(lambda: engine.steps_run == 2 * STEPS and job.stage is live._Stage.DECODE)
        assert engine.chunks_decoded == 0 and job.poll() is None
        held.release.set()
        outputs = drain(job)
    finally:
        engine.stop()
    assert [o.count for o in outputs if isinstance(o, FrameGroup)] == [9, 12, 12, 7]
    assert outputs[-1].status == "completed"


def test_a_stream_cancelled_during_its_overlapped_decode_ends_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldDecodes(monkeypatch)
    engine = live_engine()
    engine.start()
    try:
        job = engine.submit(engine.resolve("a fox", live=True, seed=1))
        assert held.entered.acquire(timeout=60)
        job.cancel()
        # Its decoder is in use: the worker waits for the decode before it frees the stream.
        assert not job.finished and engine.active == 1
        held.release.set()
        done = drain(job)[-1]
        assert isinstance(done, VideoDone) and (done.status, done.code) == ("cancelled", None)
        assert engine.active == 0
        # The engine serves the next stream.
        after = drain(engine.submit(engine.resolve("a cat", live=True, seed=2)))
    finally:
        engine.stop()
    assert after[-1].status == "completed"


def test_a_failing_decode_ends_its_stream_typed_and_the_next_stream_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldDecodes(monkeypatch, raise_=RuntimeError("VAE exploded"))
    engine = live_engine()
    engine.start()
    try:
        failed = drain(engine.submit(engine.resolve("a fox", live=True, seed=1)))
        held.raise_ = None
        held.release.set()
        after = drain(engine.submit(engine.resolve("a cat", live=True, seed=2)))
    finally:
        engine.stop()
    done = failed[-1]
    assert (done.status, done.code, done.error) == ("error", "engine_error", "RuntimeError: VAE exploded")
    assert not [o for o in failed if isinstance(o, FrameGroup)]
    assert after[-1].status == "completed"


def test_a_forward_that_fails_during_its_streams_decode_ends_it_typed_after_the_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = HeldDecodes(monkeypatch)
    forward = live.causal_forward
    calls = 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == STEPS + 2:  # chunk 1's first step, once chunk 0 is in the VAE
            wait_until(lambda: held.calls >= 1)
            raise RuntimeError("transformer exploded")
        return forward(*args, **kwargs)

    monkeypatch.setattr(live, "causal_forward", failing)
    engine = live_engine()
    engine.start()
    try:
        job = engine.submit(engine.resolve("a fox", live=True, seed=1))
        assert held.entered.acquire(timeout=60)
        wait_until(lambda: job.failure is not None)
        # The VAE still holds its decoder: the stream ends only once that decode is over.
        assert not job.finished
        held.release.set()
        outputs = drain(job)
    finally:
        engine.stop()
    done = outputs[-1]
    assert (done.status, done.code, done.error) == ("error", "engine_error", "RuntimeError: transformer exploded")


class DecodeThreadKilled(BaseException):
    """Escapes the decode's error handling, as a bug in the thread itself would."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_streams_end_typed_when_the_decode_thread_dies(monkeypatch: pytest.MonkeyPatch) -> None:
    HeldDecodes(monkeypatch, raise_=DecodeThreadKilled())
    engine = live_engine()
    engine.start()
    try:
        first = drain(engine.submit(engine.resolve("a fox", live=True, seed=1)))
        later = drain(engine.submit(engine.resolve("a cat", live=True, seed=2)))  # not waiting on a dead thread
    finally:
        engine.stop()
    for outputs in (first, later):
        done = outputs[-1]
        assert (done.status, done.code, done.error) == ("error", "engine_error", "the video decode thread has stopped")


def test_decoders_decoded_together_continue_as_if_each_decoded_alone() -> None:
    model = build_preset("tiny-causal", seed=1)
    generator = torch.Generator().manual_seed(0)
    alone = [StreamingVaeDecoder(model.vae) for _ in range(2)]
    together = [StreamingVaeDecoder(model.vae) for _ in range(2)]
    with torch.inference_mode():
        for _ in range(3):  # the first chunk (caches empty), the second (one marker slot left), a later one
            chunk = [torch.randn(1, model.latent_channels, 3, 8, 8, generator=generator) for _ in range(2)]
            expected = [decoder.decode(latents) for decoder, latents in zip(alone, chunk, strict=True)]
            batched = decode_together(together, chunk)
            for ours, theirs in zip(batched, expected, strict=True):
                assert ours.shape == theirs.shape
                # Equal but for the summation order of a batched convolution.
                torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
        late = StreamingVaeDecoder(model.vae)
        late.decode(chunk[0])
        with pytest.raises(ValueError, match="decoded together"):
            decode_together([late, StreamingVaeDecoder(model.vae)], chunk)
