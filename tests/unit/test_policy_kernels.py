"""The robot policy's kernels: attention over the cached prefix and Gemma's gated activation, each reference against
an independent computation (always), and each Triton kernel against its reference (on a CUDA machine, or on the CPU
under ``TRITON_INTERPRET=1`` with ``OMNIGATE_KERNELS=triton``)."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from omnigate.kernels.gelu_mul import gelu_tanh_mul_reference
from omnigate.kernels.prefix_attention import key_bias, prefix_attention_reference

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available()
triton_only = pytest.mark.skipif(
    not (HAS_TRITON and (ON_GPU or INTERPRETED)), reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)"
)
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
LOW = torch.bfloat16 if ON_GPU else torch.float32  # the GPU runs the engine's dtype; the interpreter float32
TOLERANCE = 1e-2 if ON_GPU else 1e-5


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def attention_case(
    batch: int, tokens: int, heads: int, head_dim: int, prefix: int, extra: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """Queries as the model passes them (a strided view of a fused projection), keys and values as views of larger
    caches, and a prefix with random padding plus a long padded run (a whole key block masked)."""
    g = torch.Generator().manual_seed(seed)
    length = prefix + extra
    query = torch.randn(batch, tokens, heads + 2, head_dim, generator=g)[:, :, :heads]
    keys = torch.randn(batch, length + 9, 1, head_dim, generator=g)[:, :length, 0]
    values = torch.randn(batch, length + 9, 1, head_dim, generator=g)[:, :length, 0]
    valid = torch.rand(batch, prefix, generator=g) > 0.3
    valid[:, 0] = True
    valid[:, prefix // 4 : prefix // 2] = False
    return query, keys, values, key_bias(valid, extra)


def test_the_key_bias_masks_only_the_prefix_padding() -> None:
    valid = torch.tensor([[True, False, True], [True, True, False]])
    bias = key_bias(valid, 2)
    assert bias.dtype == torch.float32 and bias.shape == (2, 5)
    assert bias.isinf().tolist() == [[False, True, False, False, False], [False, False, True, False, False]]
    assert float(bias.clamp(min=0).abs().sum()) == 0.0


def test_prefix_attention_reference_is_softmax_attention_over_the_unmasked_keys() -> None:
    query, keys, values, bias = attention_case(2, 5, 4, 32, 90, 6, seed=0)
    out = prefix_attention_reference(query, keys, values, bias)
    assert out.shape == (2, 5, 4 * 32)
    for b in range(2):
        seen = ~bias[b].isinf()
        scores = torch.einsum("thd,sd->ths", query[b].double(), keys[b][seen].double()) / math.sqrt(32)
        expected = torch.einsum("ths,sd->thd", scores.softmax(-1), values[b][seen].double()).reshape(5, -1)
        assert relative_error(out[b], expected) < 1e-6


def test_gelu_tanh_mul_reference_is_gemma_gated_activation() -> None:
    gate_up = torch.randn(3, 4, 2 * 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    gate, up = gate_up[..., :24], gate_up[..., 24:]
    gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
    assert torch.allclose(gelu_tanh_mul_reference(gate_up), gelu * up, atol=1e-12)


@triton_only
@pytest.mark.parametrize(
    ("batch", "tokens", "heads", "head_dim", "prefix", "extra", "blocks"),
    [
        (2, 5, 2, 32, 40, 6, (64, 64)),  # one chunk: the kernel writes the output itself
        (1, 1, 8, 32, 300, 1, (16, 64)),  # the state token: 8 rows, keys split into chunks and combined
        (3, 9, 4, 16, 250, 10, (32, 32)),  # several row blocks, splits with whole chunks masked
    ],
)
def test_the_prefix_attention_kernel_matches_its_reference(
    batch: int, tokens: int, heads: int, head_dim: int, prefix: int, extra: int, blocks: tuple[int, int]
) -> None:
    from omnigate.kernels import triton_policy_kernels

    case = attention_case(batch, tokens, heads, head_dim, prefix, extra, seed=prefix)
    query, keys, values, bias = (t.to(DEVICE) for t in case)
    query, keys, values = (t.to(LOW) for t in (query, keys, values))
    expected = prefix_attention_reference(query.float(), keys.float(), values.float(), bias)
    out = triton_policy_kernels.prefix_attention(query, keys, values, bias, block_m=blocks[0], block_n=blocks[1])
    assert out.shape == expected.shape and out.dtype == LOW
    assert relative_error(out, expected) < TOLERANCE


@triton_only
def test_the_gelu_tanh_mul_kernel_matches_its_reference() -> None:
    from omnigate.kernels import triton_policy_kernels

    gate_up = (torch.randn(5, 2 * 1100, generator=torch.Generator().manual_seed(2)) * 3).to(DEVICE, LOW)
    out = triton_policy_kernels.gelu_tanh_mul(gate_up)
    assert relative_error(out, gelu_tanh_mul_reference(gate_up)) < (1e-2 if ON_GPU else 1e-6)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton installed")
def test_a_gpu_the_attention_kernel_does_not_fit_gets_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.errors import OutOfResources

    from omnigate.kernels import prefix_attention as op
    from omnigate.kernels import triton_policy_kernels

    calls = []

    def too_large(*args: object) -> torch.Tensor:
        calls.append(args)
        raise OutOfResources(262_656, 101_376, "shared memory")

    monkeypatch.setenv("OMNIGATE_KERNELS", "triton")
    monkeypatch.setattr(triton_policy_kernels, "prefix_attention", too_large)
    monkeypatch.setattr(op, "_UNFIT", set())
    query, keys, values, bias = attention_case(2, 3, 2, 32, 50, 4, seed=9)
    expected = prefix_attention_reference(query, keys, values, bias)
    for _ in range(2):
        assert torch.equal(op.prefix_attention(query, keys, values, bias), expected)
    assert len(calls) == 1  # tried once, then the reference without asking again
