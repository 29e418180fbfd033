"""The streaming Code2Wav equals Qwen3-Omni's full ``Code2Wav.forward`` for any chunking, rows joining at any time."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnigate.engines.qwen3_omni.code2wav_stream import Code2WavStream, InvalidPush, NoFreeRow

QUANTIZERS = 4
CODEBOOK = 64
# float32 against float32: the same operations in another order (split convolutions, a gathered attention window).
ATOL_F32 = 1e-5


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Small tensors run fastest on one thread, and a shared CPU makes extra threads spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_code2wav(*, window: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """The released layout (upsampling 2x2, decoder 8x5x4x3) at toy widths, with weights that give audible output:
    the default initialization (zero Snake parameters, 0.01 layer scales, 0.02 weights) decodes to ~1e-7. Weights at
    0.7 / sqrt(fan-in) give audio of std ~0.08 that never clips, and keep float32 within ~1e-6 of float64; larger
    ones make the decoder chaotic (float32 rounding alone then moves samples by 1e-2)."""
    config = Qwen3OmniMoeCode2WavConfig(
        codebook_size=CODEBOOK,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=window,
        intermediate_size=64,
        num_hidden_layers=2,
        num_quantizers=QUANTIZERS,
        decoder_dim=32,
    )
    torch.manual_seed(seed)
    model: Any = Qwen3OmniMoeCode2Wav(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("alpha", "beta")):
                param.copy_(torch.rand(param.shape, generator=gen) - 0.5)
            elif name.endswith("scale") or name.endswith("gamma"):
                param.fill_(0.5)
            elif param.dim() > 1:
                fan_in = param[0].numel() if not name.startswith("code_embedding") else 1
                param.copy_(0.7 * torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
            elif "norm" not in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model.to(dtype)


def full_decode(model: Any, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        wav: torch.Tensor = model(codes)
    return wav[:, 0]


def random_codes(rows: int, frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CODEBOOK, (rows, QUANTIZERS, frames), generator=torch.Generator().manual_seed(seed))


def random_chunks(total: int, rng: random.Random) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(min(rng.choice([1, 1, 2, 3, 5, 8]), total - sum(sizes)))
    return sizes


def undelayed(stream: Code2WavStream, wav: torch.Tensor) -> torch.Tensor:
    """The streamed audio without its leading ``delay_samples`` of silence, which must be exact zeros."""
    assert torch.equal(wav[..., : stream.delay_samples], torch.zeros_like(wav[..., : stream.delay_samples]))
    return wav[..., stream.delay_samples :]


def test_the_released_decoder_layout_delays_555_samples_per_stream() -> None:
    stream = Code2WavStream(tiny_code2wav(window=4), 1, "cpu", torch.float32)
    # 8x5x4x3 transposed convolutions of kernel 2*stride each trim one input sample's block: 8*5*4*3 + 5*4*3 + 4*3 + 3.
    assert (stream.samples_per_frame, stream.delay_samples) == (1920, 555)


# Window 4 over 2 layers is shorter than the streams (eviction from the key/value window); 72 is the released one.
@pytest.mark.parametrize("window", [4, 72])
@pytest.mark.parametrize("chunking", ["one frame at a time", "irregular", "all at once"])
def test_streaming_equals_full_forward_for_any_chunking(window: int, chunking: str) -> None:
    model = tiny_code2wav(window=window)
    codes = random_codes(1, 23, seed=1)
    expected = full_decode(model, codes)[0]
    assert expected.abs().max() > 0.1
    sizes = {"one frame at a time": [1] * 23, "irregular": random_chunks(23, random.Random(2)), "all at once": [23]}
    stream = Code2WavStream(model, 2, "cpu", torch.float32)
    row = stream.open()
    pieces, start = [], 0
    for size in sizes[chunking]:
        piece = stream.push([row], codes[..., start : start + size])
        assert piece.shape == (1, size * stream.samples_per_frame) and piece.dtype == torch.float32
        pieces.append(piece[0])
        start += size
    got = undelayed(stream, torch.cat(pieces))
    torch.testing.assert_close(got, expected, atol=ATOL_F32, rtol=0)


def test_float64_streaming_is_exact_to_rounding() -> None:
    # transformers' Code2Wav RMSNorm computes in float32 whatever the input dtype, so float64 agrees to float32
    # rounding of the normalized activations (~3e-8 here), not to float64 rounding.
    model = tiny_code2wav(window=4, dtype=torch.float64)
    codes = random_codes(1, 17, seed=3)
    stream = Code2WavStream(model, 1, "cpu", torch.float64)
    row = stream.open()
    got = torch.cat([stream.push([row], codes[..., t : t + 1])[0] for t in range(17)])
    torch.testing.assert_close(undelayed(stream, got).double(), full_decode(model, codes)[0], atol=1e-7, rtol=0)


@pytest.mark.parametrize(
    ("device", "pad_rows"),
    [
        ("cpu", False),
        ("cpu", True),
        pytest.param("cuda", None, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_rows_joining_and_leaving_one_batch_each_equal_their_full_forward(
    device: str, pad_rows: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With pad_rows, pushes of 3 rows run as batches of 4 (the scratch row fills them). On CUDA the pushes replay
    # captured graphs (one per bucket and frame count), fresh rows masked inside them, rows padded by default; the
    # convolutions run in true float32 there (cuDNN's default TF32 would differ by ~1e-3 between any two splits).
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = tiny_code2wav(window=4).to(device)
    stream = Code2WavStream(model, 5, device, torch.float32, pad_rows=pad_rows)
    assert stream.graphs == (device == "cuda")
    for frames in (1, 2, 3):
        stream.prepare(frames)  # on CUDA, the pushes below replay these graphs
    rng = random.Random(5)
    codes = {name: random_codes(1, 20, seed=10 + i)[0] for i, name in enumerate("abcd")}
    joins = {"a": 0, "b": 2, "c": 3, "d": 7}  # the step at which each session starts
    rows: dict[str, int] = {}
    done: dict[str, int] = {name: 0 for name in codes}
    heard: dict[str, list[torch.Tensor]] = {name: [] for name in codes}
    step = 0
    while any(done[name] < 20 for name in codes):
        for name, at in joins.items():
            if at == step:
                rows[name] = stream.open()
        live = [name for name in rows if done[name] < 20]
        # Rows with nothing new this step sit out; the rest push the same frame count.
        pushing = [name for name in live if rng.random() < 0.7] or live[:1]
        size = min(rng.choice([1, 2, 3]), *(20 - done[name] for name in pushing))
        batch = torch.stack([codes[name][:, done[name] : done[name] + size] for name in pushing])
        out = stream.push([rows[name] for name in pushing], batch)
        for i, name in enumerate(pushing):
            heard[name].append(out[i])
            done[name] += size
            if done[name] == 20:
                stream.close(rows[name])
        step += 1
    for name in codes:
        expected = full_decode(model, codes[name][None].to(device))[0]
        torch.testing.assert_close(undelayed(stream, torch.cat(heard[name])), expected, atol=ATOL_F32, rtol=0)


def test_close_forgets_the_stream_of_a_row_reused_by_the_next_session() -> None:
    model = tiny_code2wav(window=4)
    stream = Code2WavStream(model, 1, "cpu", torch.float32)
    first = stream.open()
    stream.push([first], random_codes(1, 9, seed=20))
    stream.close(first)
    second = stream.open()
    assert second == first
    codes = random_codes(1, 6, seed=21)
    got = torch.cat([stream.push([second], codes[..., :2])[0], stream.push([second], codes[..., 2:])[0]])
    torch.testing.assert_close(undelayed(stream, got), full_decode(model, codes)[0], atol=ATOL_F32, rtol=0)


def test_restart_starts_a_new_stream_on_the_same_row() -> None:
    model = tiny_code2wav(window=4)
    stream = Code2WavStream(model, 1, "cpu", torch.float32)
    row = stream.open()
    stream.push([row], random_codes(1, 5, seed=30))
    stream.restart(row)
    codes = random_codes(1, 4, seed=31)
    got = stream.push([row], codes)[0]
    torch.testing.assert_close(undelayed(stream, got), full_decode(model, codes)[0], atol=ATOL_F32, rtol=0)


def test_limits_are_typed_errors() -> None:
    stream = Code2WavStream(tiny_code2wav(window=4), 2, "cpu", torch.float32, max_frames=4)
    a, b = stream.open(), stream.open()
    with pytest.raises(NoFreeRow) as busy:
        stream.open()
    assert busy.value.code == "engine_busy"
    codes = random_codes(2, 2, seed=40)
    refused = {
        "too many frames": lambda: stream.push([a], random_codes(1, 5, seed=41)),
        "no frames": lambda: stream.push([a], codes[:1, :, :0]),
        "rows and codes disagree": lambda: stream.push([a], codes),
        "a row twice": lambda: stream.push([a, a], codes),
        "wrong quantizer count": lambda: stream.push([a], codes[:1, :2]),
        "float codes": lambda: stream.push([a], codes[:1].float()),
        "code out of range": lambda: stream.push([a], codes[:1] + CODEBOOK),
        "negative code": lambda: stream.push([a], codes[:1] - CODEBOOK),
        "a closed row": lambda: (stream.close(b), stream.push([b], codes[:1])),
        "no rows": lambda: stream.push([], codes[:0]),
        "graphs for too many frames": lambda: stream.prepare(5),
    }
    for why, call in refused.items():
        with pytest.raises(InvalidPush) as refusal:
            call()
        assert refusal.value.code == "invalid_value", why
    # A refused push changes nothing: the row still decodes its stream from the start.
    good = random_codes(1, 3, seed=42)
    torch.testing.assert_close(
        undelayed(stream, stream.push([a], good)[0]), full_decode(stream._model, good)[0], atol=ATOL_F32, rtol=0
    )
    assert stream.open() == b


def test_against_chunked_decode_equal_where_it_is_exact_and_where_it_drops_samples() -> None:
    model = tiny_code2wav(window=4)
    spf, codes = 1920, random_codes(1, 30, seed=50)
    forward = full_decode(model, codes)[0]
    stream = Code2WavStream(model, 1, "cpu", torch.float32)
    row = stream.open()
    streamed = undelayed(stream, torch.cat([stream.push([row], codes[..., t : t + 5])[0] for t in range(0, 30, 5)]))
    with torch.no_grad():
        one_chunk = model.chunked_decode(codes, chunk_size=300)[0, 0]
        two_chunks = model.chunked_decode(codes, chunk_size=20, left_context_size=25)[0, 0]
    # One chunk is a full forward.
    torch.testing.assert_close(streamed, one_chunk, atol=ATOL_F32, rtol=0)
    # The second chunk re-decodes the whole prefix (20 frames <= 25 of left context), so its samples are exact, but
    # the first chunk ends 555 samples short of 20 frames and the second starts at 20 frames: chunked_decode drops
    # delay_samples at every chunk boundary, a discontinuity in the audio.
    cut = 20 * spf - stream.delay_samples
    assert two_chunks.shape[0] == forward.shape[0] - stream.delay_samples
    torch.testing.assert_close(two_chunks[:cut], streamed[:cut], atol=ATOL_F32, rtol=0)
    torch.testing.assert_close(two_chunks[cut:], streamed[20 * spf :], atol=ATOL_F32, rtol=0)


def test_chunked_decode_differs_from_forward_when_its_left_context_is_shorter_than_the_attention_reach() -> None:
    # Two layers of a 72-frame window see 142 frames back; chunked_decode's 25 frames of left context do not.
    model = tiny_code2wav(window=72)
    spf, codes = 1920, random_codes(1, 60, seed=60)
    forward = full_decode(model, codes)[0]
    with torch.no_grad():
        chunked = model.chunked_decode(codes, chunk_size=30, left_context_size=25)[0, 0]
    # Chunk two re-decodes frames 5..59 and keeps 30..59: aligned with the forward's samples from frame 30 on.
    later = chunked[30 * spf - 555 :]
    assert (later - forward[30 * spf :]).abs().max() > 1e-3
