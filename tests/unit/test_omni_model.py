"""The omni thinker: presets, a local checkpoint directory, vision tokens per frame, and the engine's answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from omnigate.engines.base import EngineError
from omnigate.engines.omni.engine import OmniEngine
from omnigate.engines.omni.model import OmniModelError, build_preset, load_omni_model
from omnigate.engines.omni.request import EncoderCache, FrameInput, TextDelta, ThinkDone, ThinkOutput, ThinkRequest


def test_a_saved_checkpoint_directory_loads_with_the_same_weights(tmp_path: Path) -> None:
    model = build_preset("tiny", seed=3)
    model.thinker.save_pretrained(tmp_path)
    loaded = load_omni_model(str(tmp_path), dtype="float32", frame_size=56)
    assert not loaded.random_weights and loaded.name == str(tmp_path)
    frame = np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    [a] = model.encode_frames([frame])
    [b] = loaded.encode_frames([frame])
    assert a.shape == (model.tokens_per_frame, 64)
    assert np.allclose(a.numpy(), b.numpy())


def test_unknown_specs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(OmniModelError):
        load_omni_model("preset:nope")
    with pytest.raises(OmniModelError):
        load_omni_model(str(tmp_path))  # no config.json


async def test_answers_stream_and_cancel_ends_with_one_done() -> None:
    engine = OmniEngine(build_preset("tiny"), max_sessions=2)
    engine.start()
    try:
        frame = FrameInput(b"f1", np.zeros((56, 56, 3), dtype=np.uint8))
        cache = EncoderCache(4)
        outputs: dict[str, list[ThinkOutput]] = {"a": [], "b": []}
        finished = {"a": asyncio.Event(), "b": asyncio.Event()}

        def sink(name: str):  # type: ignore[no-untyped-def]
            def take(batch: list[ThinkOutput]) -> None:
                outputs[name].extend(batch)
                if any(isinstance(o, ThinkDone) for o in batch):
                    finished[name].set()

            return take

        request = ThinkRequest("ctx ", "what?", (frame,), max_new_tokens=12, cache=cache, seed=1)
        engine.submit(request, sink("a"))
        await asyncio.wait_for(finished["a"].wait(), 30)
        done = outputs["a"][-1]
        assert isinstance(done, ThinkDone) and done.reason in ("completed", "max_tokens")
        assert done.text == "".join(o.text for o in outputs["a"] if isinstance(o, TextDelta))
        assert (cache.misses, cache.hits) == (1, 0)
        job = engine.submit(ThinkRequest("ctx ", "again", (frame,), max_new_tokens=1024, cache=cache), sink("b"))
        job.cancel()
        await asyncio.wait_for(finished["b"].wait(), 30)
        dones = [o for o in outputs["b"] if isinstance(o, ThinkDone)]
        assert len(dones) == 1 and dones[0].reason == "cancelled"
    finally:
        await asyncio.to_thread(engine.stop)


async def test_a_cancelled_query_frees_its_slot_for_the_next_at_once() -> None:
    engine = OmniEngine(build_preset("tiny"), max_sessions=1)  # not started: the jobs stay queued, as submitted
    request = ThinkRequest("ctx ", "what?")
    first = engine.submit(request, lambda outputs: None)
    with pytest.raises(EngineError) as refused:
        engine.submit(request, lambda outputs: None)
    assert refused.value.code == "engine_busy"
    first.cancel()  # a new question cancels the one in flight before the worker has dropped it
    engine.submit(request, lambda outputs: None)
