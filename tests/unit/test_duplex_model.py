"""The duplex engine's model pieces equal transformers' own computations: streaming Mimi encoder, ring-cached
temporal transformer, depth transformer; and a lockstep step is the same for a session alone or in any batch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from transformers import MimiConfig, MimiModel

from omnigate.engines.duplex import frames as frames_module
from omnigate.engines.duplex.backbone import SlotBackbone
from omnigate.engines.duplex.depth import DepthSampler
from omnigate.engines.duplex.frames import FrameModel, FrameSettings
from omnigate.engines.duplex.graphs import batch_buckets, bucket_rows
from omnigate.engines.duplex.mimi_encoder import MimiStreamEncoder
from omnigate.engines.duplex.model import DuplexModel, ModelSpecError, build_preset, load_duplex_model
from omnigate.engines.talker.model import randomize_codebooks

FRAME = 1920


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny64() -> DuplexModel:
    model = build_preset("tiny", seed=0, device="cpu", dtype=torch.float64)
    model.moshi.double()
    return model


def test_streaming_encoder_equals_a_full_encode_for_staggered_sessions() -> None:
    config = MimiConfig(
        hidden_size=64,
        num_filters=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        codebook_dim=32,
        vector_quantization_hidden_dimension=32,
        upsample_groups=64,
        num_quantizers=8,
        sliding_window=5,  # shorter than the stream: the window itself is exercised
    )
    torch.manual_seed(0)
    mimi: Any = MimiModel(config)
    mimi.eval().double()
    with torch.no_grad():
        randomize_codebooks(mimi, torch.Generator().manual_seed(0))
    frames = 9
    audio = torch.randn(2, frames * FRAME, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.3
    with torch.no_grad():
        full = mimi.encode(audio[:, None, :], num_quantizers=8).audio_codes  # [2, 8, frames]
    encoder = MimiStreamEncoder(mimi, 3, 8)
    encoder.reset(2)
    encoder.encode(audio[:1, :FRAME] * 0.5, [2])  # a previous session in slot 2, which reset must erase
    encoder.reset(2)
    got: list[list[torch.Tensor]] = [[], []]
    for t in range(frames + 3):  # stream 1 starts 3 frames later, in another slot, sharing the calls
        rows, slots, owners = [], [], []
        if t < frames:
            rows.append(audio[0, t * FRAME : (t + 1) * FRAME])
            slots.append(2)
            owners.append(0)
        if t >= 3:
            rows.append(audio[1, (t - 3) * FRAME : (t - 2) * FRAME])
            slots.append(0)
            owners.append(1)
        codes = encoder.encode(torch.stack(rows), slots)
        for row, owner in enumerate(owners):
            got[owner].append(codes[row])
    for owner in (0, 1):
        assert torch.equal(torch.stack(got[owner], dim=-1), full[owner])


def test_ring_backbone_equals_a_sliding_window_reference(tiny64: DuplexModel) -> None:
    moshi = tiny64.moshi
    k, steps, window = 8, 9, 4
    g = torch.Generator().manual_seed(2)
    text = torch.randint(0, 65, (2, steps), generator=g)
    codes = torch.randint(0, 257, (2, 2 * k, steps), generator=g)
    with torch.no_grad():
        embeds = moshi.decoder.model.embed_tokens(text) + sum(moshi.embed_tokens[c](codes[:, c]) for c in range(2 * k))
        full = moshi.decoder(inputs_embeds=embeds).last_hidden_state
        i = torch.arange(steps)
        allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        mask = torch.where(allowed, 0.0, float("-inf")).double()[None, None].expand(2, 1, steps, steps)
        windowed = moshi.decoder(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
    for ring, reference, slots in ((16, full, [3, 1]), (window, windowed, [1, 2])):
        backbone = SlotBackbone(moshi, slots=4, window=ring)
        out = []
        for t in range(steps):
            x = backbone.embed(text[:, t], codes[:, :k, t], codes[:, k:, t])
            out.append(backbone.forward(x, backbone.cache.step(slots)))
        torch.testing.assert_close(torch.stack(out, dim=1), reference, rtol=0, atol=1e-10)


def test_depth_sampler_equals_the_depth_decoder(tiny64: DuplexModel) -> None:
    moshi = tiny64.moshi
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, moshi.config.hidden_size, generator=g, dtype=torch.float64)
    text = torch.randint(0, 64, (3,), generator=g)
    logits: list[torch.Tensor] = []

    def greedy(scores: torch.Tensor, k: int) -> torch.Tensor:
        logits.append(scores)
        return scores.argmax(dim=-1)

    codes = DepthSampler(moshi.depth_decoder, 8).sample(hidden, text, greedy)
    with torch.no_grad():
        reference = moshi.depth_decoder(
            input_ids=torch.cat((text[:, None], codes[:, :-1]), dim=1), last_hidden_state=hidden[:, None, :]
        ).logits
    torch.testing.assert_close(torch.stack(logits, dim=1), reference, rtol=0, atol=1e-9)


def _run(model: FrameModel, slot_inputs: dict[int, np.ndarray], ticks: int) -> dict[int, tuple[list[int], bytes]]:
    out: dict[int, tuple[list[int], bytes]] = {slot: ([], b"") for slot in slot_inputs}
    for t in range(ticks):
        slots = sorted(slot_inputs)
        step = model.step(slots, np.stack([slot_inputs[s][t] for s in slots]))
        for row, slot in enumerate(slots):
            tokens, pcm = out[slot]
            out[slot] = ([*tokens, step.text[row]], pcm + step.pcm[row].tobytes())
    return out


def test_a_session_is_the_same_alone_in_a_batch_and_in_a_reused_slot() -> None:
    model = build_preset("tiny", seed=0, device="cpu", dtype=torch.float32)
    rng = np.random.default_rng(4)
    speech = (rng.standard_normal((5, FRAME)) * 3000).astype(np.int16)
    other = (rng.standard_normal((5, FRAME)) * 3000).astype(np.int16)
    frames = FrameModel(model, FrameSettings(slots=3))
    frames.reset(0, seed=7)
    alone = _run(frames, {0: speech}, 5)[0]
    frames.reset(2, seed=99)
    _run(frames, {2: other}, 3)  # an earlier session in slot 2
    frames.reset(1, seed=7)
    frames.reset(2, seed=7)
    batched = _run(frames, {1: speech, 2: speech}, 5)
    assert batched[1][0] == alone[0] and batched[2][0] == alone[0]
    for slot in (1, 2):
        a = np.frombuffer(alone[1], dtype=np.int16).astype(np.int64)
        b = np.frombuffer(batched[slot][1], dtype=np.int16).astype(np.int64)
        assert np.abs(a - b).max() <= 2  # float32 batching changes rounding only
    first = np.frombuffer(alone[1][: 2 * FRAME], dtype=np.int16)
    assert not first.any() and np.frombuffer(alone[1][2 * FRAME :], dtype=np.int16).any()  # frame 0: delay pattern


def test_ticks_are_planned_as_bucket_prefixes_whatever_slots_step() -> None:
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(5) == (1, 2, 4, 5)
    assert batch_buckets(64, (16, 48, 100)) == (16, 48, 64)
    buckets = batch_buckets(64)
    assert bucket_rows([0, 2], buckets) == (0, 1, 2, 3)
    assert bucket_rows([5], buckets) == tuple(range(8))
    every_but_one = [slot for slot in range(64) if slot != 17]  # a live session without credit, at full load
    assert bucket_rows(every_but_one, buckets) == tuple(range(64))
    assert bucket_rows([33, 40], buckets) == tuple(range(64))  # slots scattered by sessions that came and went
    with pytest.raises(ValueError, match="beyond the largest bucket"):
        bucket_rows([64], buckets)


Outputs = dict[int, tuple[list[int], bytes]]


def _sitting_out(
    model: DuplexModel, inputs: dict[int, np.ndarray], sit_out: set[int]
) -> tuple[Outputs, list[int], FrameModel]:
    """Every slot of ``inputs`` steps on each tick with its next input frame, except slot 1 on the ticks in
    ``sit_out``; the model plans its batches as with CUDA graphs (bucket prefixes, masked rows)."""
    frames = FrameModel(model, FrameSettings(slots=5, masked_rows=True))  # buckets 1, 2, 4, 5
    for slot in inputs:
        frames.reset(slot, seed=slot + 20)
    taken = dict.fromkeys(inputs, 0)
    out: Outputs = {slot: ([], b"") for slot in inputs}
    rows = []
    for tick in range(len(inputs[0])):
        slots = [s for s in sorted(inputs) if not (s == 1 and tick in sit_out)]
        step = frames.step(slots, np.stack([inputs[s][taken[s]] for s in slots]))
        rows.append(step.rows)
        assert step.graph == frames.use_graphs
        for row, slot in enumerate(slots):
            taken[slot] += 1
            tokens, pcm = out[slot]
            out[slot] = ([*tokens, step.text[row]], pcm + step.pcm[row].tobytes())
    return out, rows, frames


def test_a_session_that_sits_ticks_out_is_untouched_while_the_batch_stays_a_bucket() -> None:
    model = build_preset("tiny", seed=0, device="cpu", dtype=torch.float32)
    rng = np.random.default_rng(5)
    inputs = {slot: (rng.standard_normal((8, FRAME)) * 3000).astype(np.int16) for slot in (0, 1, 2)}
    always, always_rows, reference = _sitting_out(model, inputs, set())
    paused, paused_rows, frames = _sitting_out(model, inputs, {2, 3, 6})
    # Every tick computes slots 0..3 (slot 3 is free, slot 1 sometimes sits out): the batch a graph serves.
    assert always_rows == paused_rows == [4] * 8
    # The session that sat out three ticks continues exactly where it stopped: bit for bit the frames of a run
    # where it never sat out (its masked rows committed nothing: codec state, tokens, counters, cache).
    tokens, pcm = paused[1]
    assert len(tokens) == 5
    assert tokens == always[1][0][:5] and pcm == always[1][1][: 5 * 2 * FRAME]
    assert frames.steps[1] == frames.backbone.cache.position(1) == 5
    # A free slot computed as a masked row on every tick has not moved either.
    assert frames.steps[3] == frames.backbone.cache.position(3) == 0
    assert reference.steps[3] == reference.backbone.cache.position(3) == 0
    # The sessions that kept stepping are unaffected, bit for bit: every batch, codec stages included, had the same
    # rows in both runs.
    for slot in (0, 2):
        assert paused[slot] == always[slot]


class _CapturedOnCpu:
    """Stands in for a captured CUDA graph on the CPU: "capturing" runs the call three times on the capture inputs
    (as the real capture's warm-up and capture do, writes included); a replay runs it on the replay inputs."""

    captures = 0

    def __init__(self, call: Any, *inputs: Any) -> None:
        self.call = call
        captured = inputs[0] if len(inputs) == 1 and isinstance(inputs[0], tuple) else inputs
        for _ in range(3):
            call(*captured)
        _CapturedOnCpu.captures += 1

    def run(self, *inputs: Any) -> Any:
        return self.call(*(inputs[0] if len(inputs) == 1 and isinstance(inputs[0], tuple) else inputs))


def test_capturing_graphs_touches_no_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph path's own logic, on the CPU: captures (codec stages on scratch rows, the model on the tick's own
    rows) change no session's state, so a run that captures on live ticks equals one that never captures."""
    model = build_preset("tiny", seed=0, device="cpu", dtype=torch.float32)
    rng = np.random.default_rng(6)
    inputs = {slot: (rng.standard_normal((6, FRAME)) * 3000).astype(np.int16) for slot in (0, 1, 2)}
    eager, _, _ = _sitting_out(model, inputs, {1, 4})
    monkeypatch.setattr(frames_module, "CapturedCall", _CapturedOnCpu)
    monkeypatch.setattr(frames_module, "CapturedTick", _CapturedOnCpu)
    monkeypatch.setattr(FrameModel, "rows_for", lambda self, slots: bucket_rows(slots, self.buckets))
    original = FrameModel.__init__

    def with_graphs(self: FrameModel, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.use_graphs = True

    monkeypatch.setattr(FrameModel, "__init__", with_graphs)
    _CapturedOnCpu.captures = 0
    replayed, _, frames = _sitting_out(model, inputs, {1, 4})
    assert replayed == eager
    assert _CapturedOnCpu.captures == 3  # encode, model, decode: once each for the one bucket used (4 rows)
    assert set(frames._graphs) == {4} and set(frames._codec_graphs) == {("encode", 4), ("decode", 4)}


def test_model_specs() -> None:
    with pytest.raises(ModelSpecError, match="unknown duplex preset"):
        load_duplex_model("preset:nope", seed=0, device="cpu", dtype=torch.float32)
    with pytest.raises(ModelSpecError, match="neither"):
        load_duplex_model("/no/such/dir", seed=0, device="cpu", dtype=torch.float32)
    with pytest.raises(ModelSpecError, match="needs --model"):
        load_duplex_model(None, seed=0, device="cpu", dtype=torch.float32)
