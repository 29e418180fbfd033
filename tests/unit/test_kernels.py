"""The talker's kernels: each plain-torch reference against an independent computation (always), and each Triton
kernel against its reference (on a CUDA machine, or on the CPU under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from transformers.models.csm.modeling_csm import CsmRMSNorm

from omnigate.kernels import backend
from omnigate.kernels.activation import silu_mul_reference
from omnigate.kernels.attention import slot_attention_reference
from omnigate.kernels.norm import rms_norm_reference
from omnigate.kernels.pcm import PACK_EXTRA, pack_pcm_reference, unpack_rms
from omnigate.kernels.rope import apply_rope, rope_store_reference
from omnigate.kernels.sampling import sample_tokens_reference, uniform_noise
from omnigate.kernels.sampling_types import SamplingRows, Vocabulary

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available()
triton_only = pytest.mark.skipif(
    not (HAS_TRITON and (ON_GPU or INTERPRETED)), reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)"
)
# The GPU runs the kernels in bfloat16 as the engine does; the interpreter (numpy) in float32.
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
LOW = torch.bfloat16 if ON_GPU else torch.float32
LOOSE = ON_GPU  # bfloat16 inputs: compare at bfloat16's precision


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, device: torch.device = DEVICE) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(seed)).to(device=device, dtype=dtype)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


# ---- references against independent computations ------------------------------------------------------------------


def test_rms_norm_reference_is_the_model_norm() -> None:
    norm = CsmRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(randn(48, seed=1, device=torch.device("cpu")))
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(6, 48, seed=2, dtype=dtype, device=torch.device("cpu"))
        torch.testing.assert_close(rms_norm_reference(x, norm.weight.to(dtype), 1e-5), norm.to(dtype)(x))


def test_silu_mul_reference_gates_the_second_half_by_the_first() -> None:
    gate_up = randn(3, 10, seed=3, device=torch.device("cpu"))
    torch.testing.assert_close(silu_mul_reference(gate_up), F.silu(gate_up[:, :5]) * gate_up[:, 5:])


def test_rope_store_reference_rotates_and_writes_only_the_rows_positions() -> None:
    heads, kv_heads, dim, rows = 4, 2, 8, 3
    cpu = torch.device("cpu")
    qkv = randn(rows, (heads + 2 * kv_heads) * dim, seed=4, device=cpu)
    cos, sin = randn(rows, dim, seed=5, device=cpu), randn(rows, dim, seed=6, device=cpu)
    keys, values = torch.full((3, 10, kv_heads, dim), 7.0), torch.full((3, 10, kv_heads, dim), 7.0)
    slots, positions = torch.tensor([2, 0, 2]), torch.tensor([4, 9, 5])
    q = rope_store_reference(qkv, cos, sin, keys, values, slots, positions, heads, kv_heads)
    parts = qkv.view(rows, 1, heads + 2 * kv_heads, dim)
    expected_q = apply_rope(parts[:, :, :heads], cos[:, None], sin[:, None])[:, 0]
    expected_k = apply_rope(parts[:, :, heads : heads + kv_heads], cos[:, None], sin[:, None])[:, 0]
    torch.testing.assert_close(q, expected_q)
    for r in range(rows):
        torch.testing.assert_close(keys[slots[r], positions[r]], expected_k[r])
        torch.testing.assert_close(values[slots[r], positions[r]], parts[r, 0, heads + kv_heads :])
    untouched = torch.ones(3, 10, dtype=torch.bool)
    untouched[slots, positions] = False
    assert bool((keys[untouched] == 7.0).all()) and bool((values[untouched] == 7.0).all())


def naive_slot_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    rows, heads, dim = q.shape
    group = heads // keys.shape[2]
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for r in range(rows):
        for h in range(heads):
            k = keys[slots[r], : lengths[r], h // group].double()
            v = values[slots[r], : lengths[r], h // group].double()
            out[r, h] = torch.softmax(k @ q[r, h].double() * scale, dim=0) @ v
    return out.reshape(rows, heads * dim)


@pytest.mark.parametrize(
    "slot_ids",
    [[3, 0, 3, 1, 2], [3, 0, 4, 1, 2]],
    ids=["rows-sharing-a-slot", "a-slot-per-row"],
)
def test_slot_attention_reference_reads_each_rows_own_slot_up_to_its_length(slot_ids: list[int]) -> None:
    cpu = torch.device("cpu")
    keys, values = randn(5, 12, 2, 8, seed=7, device=cpu), randn(5, 12, 2, 8, seed=8, device=cpu)
    q = randn(5, 4, 8, seed=9, device=cpu)
    slots, lengths = torch.tensor(slot_ids), torch.tensor([1, 12, 7, 4, 9])
    out = slot_attention_reference(q, keys, values, slots, lengths, 0.3)
    torch.testing.assert_close(
        out.double(), naive_slot_attention(q, keys, values, slots, lengths, 0.3), rtol=1e-5, atol=1e-6
    )


def sampling_rows(
    count: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    penalty: float = 1.0,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> SamplingRows:
    g = generator(seed)
    return SamplingRows(
        temperature=torch.full((count,), temperature, device=device),
        top_k=torch.full((count,), top_k, dtype=torch.int32, device=device),
        top_p=torch.full((count,), top_p, device=device),
        penalty=torch.full((count,), penalty, device=device),
        seeds=torch.randint(0, 2**62, (count,), generator=g).to(device),
        counters=torch.randint(0, 10_000, (count,), generator=g).to(device),
        history_slots=torch.arange(count, device=device),
        ring=torch.randint(0, 4, (count,), generator=g).to(device),
    )


CPU = torch.device("cpu")
NO_HISTORY = torch.zeros(64, 0, dtype=torch.int64)


def test_sampling_reference_temperature_zero_is_argmax_with_the_eos_bias() -> None:
    logits = randn(64, 40, seed=10, device=CPU)
    vocab = Vocabulary(valid_ids=32, eos_id=3, eos_bias=2.5)
    tokens = sample_tokens_reference(logits, sampling_rows(64, temperature=0.0, device=CPU), NO_HISTORY, 0, vocab)
    biased = logits[:, :32].clone()
    biased[:, 3] += 2.5
    assert torch.equal(tokens, biased.argmax(dim=-1))


def test_sampling_reference_stays_within_top_k_and_top_p() -> None:
    logits = randn(64, 50, seed=11, device=CPU) * 2
    vocab = Vocabulary(valid_ids=50, eos_id=0)
    ranks = logits.argsort(dim=-1, descending=True).argsort(dim=-1)
    for draw in range(20):
        top_k = sample_tokens_reference(logits, sampling_rows(64, top_k=3, device=CPU), NO_HISTORY, draw, vocab)
        assert bool((ranks.gather(1, top_k[:, None]) < 3).all())
    probs = torch.softmax(logits, dim=-1)
    ordered = probs.sort(dim=-1, descending=True).values
    needed = ((ordered.cumsum(dim=-1) - ordered) < 0.5).sum(dim=-1)  # the smallest set holding half the mass
    seen_outside = torch.zeros(64, dtype=torch.bool)
    for draw in range(20):
        top_p = sample_tokens_reference(logits, sampling_rows(64, top_p=0.5, device=CPU), NO_HISTORY, draw, vocab)
        assert bool((ranks.gather(1, top_p[:, None])[:, 0] < needed).all())
        plain = sample_tokens_reference(logits, sampling_rows(64, device=CPU), NO_HISTORY, draw, vocab)
        seen_outside |= ranks.gather(1, plain[:, None])[:, 0] >= needed
    assert bool(seen_outside.any())  # without the cut, draws do leave that set


def test_sampling_reference_penalises_recent_tokens_and_records_the_draw() -> None:
    logits = torch.zeros(2, 16)
    logits[:, 5] = 3.0
    logits[:, 6] = 2.0
    history = torch.full((2, 4), -1, dtype=torch.int64)
    history[0, 1] = 5  # row 0 said 5 recently, row 1 did not
    rows = sampling_rows(2, temperature=0.0, penalty=2.0, device=CPU)
    rows = replace(rows, ring=torch.tensor([3, 0]))
    tokens = sample_tokens_reference(logits, rows, history, 0, Vocabulary(valid_ids=16, eos_id=0))
    assert tokens.tolist() == [6, 5]  # 3.0 / 2 < 2.0 for row 0 only
    assert history.tolist() == [[-1, 5, -1, 6], [5, -1, -1, -1]]


def test_sampling_reference_rows_are_independent_of_the_batch() -> None:
    logits = randn(32, 30, seed=12, device=CPU)
    rows = sampling_rows(32, top_k=10, top_p=0.9, device=CPU)
    vocab = Vocabulary(valid_ids=30, eos_id=0)
    together = sample_tokens_reference(logits, rows, NO_HISTORY, 4, vocab)
    alone = [sample_tokens_reference(logits[r : r + 1], rows_at(rows, r), NO_HISTORY, 4, vocab) for r in range(32)]
    assert torch.equal(together, torch.cat(alone))


def rows_at(rows: SamplingRows, r: int) -> SamplingRows:
    return SamplingRows(*(getattr(rows, f.name)[r : r + 1] for f in fields(rows)))


def test_uniform_noise_is_deterministic_and_uniform() -> None:
    seeds, counters = torch.tensor([1, 2**61 + 5]), torch.tensor([0, 7])
    noise = uniform_noise(seeds, counters, 50_000)
    assert torch.equal(noise, uniform_noise(seeds, counters, 50_000))
    assert float(noise.min()) > 0.0 and float(noise.max()) < 1.0
    assert abs(float(noise.mean()) - 0.5) < 0.01 and abs(float(noise.var()) - 1 / 12) < 0.005
    assert not torch.equal(noise[0], noise[1])


def test_pack_pcm_reference_clamps_rounds_and_carries_rms_and_flags() -> None:
    audio = torch.tensor([[0.5, -1.5, 2.0, 0.25 / 32767], [0.0, 0.0, 0.0, 1.5 / 32767]])
    out = torch.zeros(2, 4 + PACK_EXTRA, dtype=torch.int16)
    pack_pcm_reference(audio, torch.tensor([False, True]), out)
    packed = out.numpy()
    assert packed[:, :4].tolist() == [[16384, -32767, 32767, 0], [0, 0, 0, 2]]  # 16383.5 and 1.5 round to even
    clamped = audio.clamp(-1, 1)
    np.testing.assert_allclose(unpack_rms(packed, 4), clamped.pow(2).mean(-1).sqrt().numpy(), rtol=1e-6)
    assert packed[:, 6].tolist() == [0, 1]


def test_cpu_tensors_take_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNIGATE_KERNELS", raising=False)
    assert not backend.use_triton(torch.zeros(1))
    monkeypatch.setenv("OMNIGATE_KERNELS", "reference")
    assert not backend.use_triton(torch.zeros(1, device="meta"))


# ---- Triton kernels against their references -----------------------------------------------------------------------


@pytest.fixture
def kernels() -> Any:
    return backend.triton_kernels()


@triton_only
def test_triton_rms_norm_and_silu_mul_match(kernels: Any) -> None:
    for hidden in (1024, 2048):
        x, w = randn(37, hidden, seed=20, dtype=LOW), randn(hidden, seed=21, dtype=LOW)
        out = kernels.rms_norm(x, w, 1e-5)
        ref = rms_norm_reference(x, w, 1e-5)
        assert relative_error(out, ref) < (4e-3 if LOOSE else 1e-6)
    gate_up = randn(37, 2 * 8192, seed=22, dtype=LOW)
    out = kernels.silu_mul(gate_up)
    assert relative_error(out, silu_mul_reference(gate_up)) < (4e-3 if LOOSE else 1e-6)


@triton_only
def test_triton_rope_store_matches(kernels: Any) -> None:
    heads, kv_heads, dim, rows = 32, 8, 64, 19
    qkv = randn(rows, (heads + 2 * kv_heads) * dim, seed=23, dtype=LOW)
    cos, sin = randn(rows, dim, seed=24, dtype=LOW), randn(rows, dim, seed=25, dtype=LOW)
    keys = randn(5, 40, kv_heads, dim, seed=26, dtype=LOW)
    values = randn(5, 40, kv_heads, dim, seed=27, dtype=LOW)
    slots = torch.randint(0, 5, (rows,), generator=generator(28)).to(DEVICE)
    positions = torch.randperm(40, generator=generator(29))[:rows].to(DEVICE)  # distinct (slot, position) pairs
    k2, v2 = keys.clone(), values.clone()
    q = kernels.rope_store(qkv, cos, sin, keys, values, slots, positions, heads, kv_heads)
    q_ref = rope_store_reference(qkv, cos, sin, k2, v2, slots, positions, heads, kv_heads)
    close = 4e-3 if LOOSE else 1e-6  # bfloat16: the device may round a product differently in the last place
    assert relative_error(q, q_ref) < close and relative_error(keys, k2) < close and torch.equal(values, v2)
    # the depth decoder passes one position's table broadcast to every row (stride 0)
    q = kernels.rope_store(
        qkv, cos[:1].expand(rows, -1), sin[:1].expand(rows, -1), keys, values, slots, positions, heads, kv_heads
    )
    q_ref = rope_store_reference(
        qkv, cos[:1].expand(rows, -1), sin[:1].expand(rows, -1), k2, v2, slots, positions, heads, kv_heads
    )
    assert relative_error(q, q_ref) < close and relative_error(keys, k2) < close


@triton_only
def test_triton_slot_attention_matches(kernels: Any) -> None:
    for heads, kv_heads, dim in ((32, 8, 64), (8, 2, 128)):
        keys = randn(9, 300, kv_heads, dim, seed=30, dtype=LOW)
        values = randn(9, 300, kv_heads, dim, seed=31, dtype=LOW)
        q = randn(23, heads, dim, seed=32, dtype=LOW)
        slots = torch.randint(0, 9, (23,), generator=generator(33)).to(DEVICE)
        lengths = torch.randint(1, 301, (23,), generator=generator(34)).to(DEVICE)
        lengths[0], lengths[1] = 1, 300
        out = kernels.slot_attention(q, keys, values, slots, lengths, dim**-0.5)
        ref = naive_slot_attention(q.cpu(), keys.cpu(), values.cpu(), slots.cpu(), lengths.cpu(), dim**-0.5)
        assert relative_error(out.cpu(), ref) < (1e-2 if LOOSE else 1e-5)


@triton_only
def test_triton_sampling_matches(kernels: Any) -> None:
    count, valid = 256, 2048
    logits = randn(count, 2051, seed=40, dtype=LOW) * 4
    vocab = Vocabulary(valid_ids=valid, eos_id=0, eos_bias=1.5)
    g = generator(41)
    temperature = torch.where(torch.rand(count, generator=g) < 0.2, 0.0, 0.2 + torch.rand(count, generator=g))
    rows = SamplingRows(
        temperature=temperature.to(DEVICE),
        top_k=torch.randint(0, 100, (count,), generator=g, dtype=torch.int32).to(DEVICE),
        top_p=torch.where(torch.rand(count, generator=g) < 0.5, 1.0, torch.rand(count, generator=g)).to(DEVICE),
        penalty=(1.0 + torch.rand(count, generator=g)).to(DEVICE),
        seeds=torch.randint(0, 2**62, (count,), generator=g).to(DEVICE),
        counters=torch.randint(0, 100_000, (count,), generator=g).to(DEVICE),
        history_slots=torch.randperm(count, generator=g).to(DEVICE),
        ring=torch.randint(0, 16, (count,), generator=g).to(DEVICE),
    )
    history = torch.randint(-1, valid, (count, 16), generator=g).to(DEVICE)
    history_ref = history.clone()
    out = kernels.sample_tokens(logits, rows, history, 3, vocab)
    ref = sample_tokens_reference(logits, rows, history_ref, 3, vocab)
    greedy = temperature == 0.0
    assert torch.equal(out.cpu()[greedy], ref.cpu()[greedy])
    # Sampled rows may differ only where the device's log rounds differently at a near tie: a rare event.
    assert float((out == ref).float().mean()) >= 0.98
    assert torch.equal(history[rows.history_slots, rows.ring], out)
    assert bool(((out >= 0) & (out < valid)).all())


@triton_only
def test_triton_pack_pcm_matches(kernels: Any) -> None:
    audio = randn(33, 1920, seed=50, dtype=torch.float32) * 0.7
    flags = torch.arange(33, device=DEVICE) % 3 == 0
    out = torch.zeros(33, 1920 + PACK_EXTRA, dtype=torch.int16, device=DEVICE)
    ref = out.clone()
    kernels.pack_pcm(audio, flags, out)
    pack_pcm_reference(audio, flags, ref)
    # Samples agree to one step of s16 (the device's float multiply may land a sample on the other side of .5).
    difference = (out[:, :1920].int() - ref[:, :1920].int()).abs()
    assert int(difference.max()) <= 1 and float((difference > 0).float().mean()) < 1e-3
    assert torch.equal(out[:, -1], ref[:, -1])
    packed, packed_ref = out.cpu().numpy(), ref.cpu().numpy()
    np.testing.assert_allclose(unpack_rms(packed, 1920), unpack_rms(packed_ref, 1920), rtol=1e-5)
