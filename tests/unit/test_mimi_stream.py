"""The streaming Mimi decoder equals a full ``MimiModel.decode``, for any chunking and for batched sessions."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import MimiConfig, MimiModel

from omnigate.engines.codec.mimi_stream import MimiStreamDecoder, UnsupportedCodec
from omnigate.engines.talker.model import randomize_codebooks

CODEBOOKS = 8


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Small tensors run fastest on one thread, and a shared CPU makes extra threads spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_mimi(*, sliding_window: int, dtype: torch.dtype, seed: int = 0, layer_scale: float = 0.01) -> Any:
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
        num_quantizers=CODEBOOKS,
        sliding_window=sliding_window,
        layer_scale_initial_scale=layer_scale,
    )
    torch.manual_seed(seed)
    mimi: Any = MimiModel(config)
    mimi.eval().to(dtype)
    with torch.no_grad():
        randomize_codebooks(mimi, torch.Generator().manual_seed(seed))
    return mimi


def full_decode(mimi: Any, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        audio: torch.Tensor = mimi.decode(codes).audio_values
    return audio[:, 0]


def random_chunks(total: int, rng: random.Random) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(min(rng.choice([1, 1, 2, 3, 4, 8]), total - sum(sizes)))
    return sizes


def stream_decode(decoder: MimiStreamDecoder, codes: torch.Tensor, sizes: list[int], slot: int) -> torch.Tensor:
    pieces, start = [], 0
    for size in sizes:
        pieces.append(decoder.decode(codes[..., start : start + size], [slot]))
        start += size
    return torch.cat(pieces, dim=-1)


# A window shorter than the chunks and the stream exercises eviction from the key/value window; 250 is Mimi's own.
@pytest.mark.parametrize(
    ("dtype", "window", "tolerance"),
    [(torch.float64, 5, 1e-10), (torch.float64, 250, 1e-10), (torch.float32, 5, 1e-4)],
)
def test_streaming_equals_full_decode_for_random_chunkings(dtype: torch.dtype, window: int, tolerance: float) -> None:
    mimi = tiny_mimi(sliding_window=window, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 2048, (1, CODEBOOKS, 21), generator=gen)
    reference = full_decode(mimi, codes)
    rng = random.Random(7)
    chunkings = [[1] * 21, [21], *(random_chunks(21, rng) for _ in range(3))]
    decoder = MimiStreamDecoder(mimi, max_slots=3)
    for sizes in chunkings:
        decoder.reset(1)
        streamed = stream_decode(decoder, codes, sizes, slot=1)
        assert streamed.shape == reference.shape == (1, 21 * decoder.samples_per_frame)
        torch.testing.assert_close(streamed, reference, rtol=0, atol=tolerance * reference.abs().max().item())


def test_codes_matter_after_codebook_randomization() -> None:
    mimi = tiny_mimi(sliding_window=250, dtype=torch.float64)
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, 2048, (1, CODEBOOKS, 4), generator=gen)
    b = torch.randint(0, 2048, (1, CODEBOOKS, 4), generator=gen)
    assert (full_decode(mimi, a) - full_decode(mimi, b)).abs().max() > 1e-3


def test_interleaved_sessions_batched_together_each_equal_their_full_decode() -> None:
    mimi = tiny_mimi(sliding_window=5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(0, 2048, (1, CODEBOOKS, 14), generator=gen)
    second = torch.randint(0, 2048, (1, CODEBOOKS, 14), generator=gen)
    decoder = MimiStreamDecoder(mimi, max_slots=4)
    slots = {0: 3, 1: 0}
    sources = {0: first, 1: second}
    done = {0: 0, 1: 0}
    pieces: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    # (frames of session 0, frames of session 1): equal counts decode in one batched call, others alone.
    plan = [(1, 0), (0, 1), (2, 2), (1, 3), (4, 4), (2, 0), (3, 3), (0, 1), (1, 0)]
    for sizes in plan:
        same = sizes[0] == sizes[1]
        groups = [[0, 1]] if same else [[s] for s in (0, 1) if sizes[s]]
        for group in groups:
            size = sizes[group[0]]
            codes = torch.cat([sources[s][..., done[s] : done[s] + size] for s in group])
            audio = decoder.decode(codes, [slots[s] for s in group])
            for row, s in enumerate(group):
                pieces[s].append(audio[row : row + 1])
                done[s] += size
    assert done == {0: 14, 1: 14}
    for s in (0, 1):
        reference = full_decode(mimi, sources[s])
        torch.testing.assert_close(torch.cat(pieces[s], dim=-1), reference, rtol=0, atol=1e-10)


def test_reset_slot_starts_a_new_stream() -> None:
    mimi = tiny_mimi(sliding_window=5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(4)
    old = torch.randint(0, 2048, (1, CODEBOOKS, 6), generator=gen)
    new = torch.randint(0, 2048, (1, CODEBOOKS, 5), generator=gen)
    decoder = MimiStreamDecoder(mimi, max_slots=2)
    decoder.decode(old, [1])
    decoder.reset(1)
    streamed = stream_decode(decoder, new, [2, 3], slot=1)
    torch.testing.assert_close(streamed, full_decode(mimi, new), rtol=0, atol=1e-10)


def test_a_fresh_row_starts_a_new_stream_without_a_reset_while_others_continue() -> None:
    mimi = tiny_mimi(sliding_window=5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(6)
    old = torch.randint(0, 2048, (2, CODEBOOKS, 6), generator=gen)
    new = torch.randint(0, 2048, (1, CODEBOOKS, 4), generator=gen)
    decoder = MimiStreamDecoder(mimi, max_slots=2)
    decoder.decode(old[..., :5], [0, 1])
    slots = torch.tensor([0, 1])
    first = decoder.decode_frames(torch.cat((new[..., :1], old[1:, :, 5:])), slots, fresh=torch.tensor([1, 0]))
    rest = decoder.decode(new[..., 1:], [0])
    torch.testing.assert_close(torch.cat((first[:1], rest), dim=-1), full_decode(mimi, new), rtol=0, atol=1e-10)
    torch.testing.assert_close(first[1:], full_decode(mimi, old[1:])[..., 5 * first.shape[-1] :], rtol=0, atol=1e-10)


def test_decode_refuses_repeated_slots() -> None:
    decoder = MimiStreamDecoder(tiny_mimi(sliding_window=5, dtype=torch.float32), max_slots=2)
    with pytest.raises(ValueError, match="distinct slot"):
        decoder.decode(torch.zeros(2, CODEBOOKS, 1, dtype=torch.long), [1, 1])


def test_non_causal_codec_is_refused() -> None:
    config = MimiConfig(
        hidden_size=64,
        num_filters=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        codebook_dim=32,
        vector_quantization_hidden_dimension=32,
        upsample_groups=64,
        num_quantizers=CODEBOOKS,
        use_causal_conv=False,
    )
    with pytest.raises(UnsupportedCodec):
        MimiStreamDecoder(MimiModel(config), max_slots=1)


def snr_db(signal: torch.Tensor, estimate: torch.Tensor) -> float:
    noise = (estimate.double() - signal.double()).pow(2).sum()
    return float(10 * torch.log10(signal.double().pow(2).sum() / noise))


# Rings of window - 1 + max_steps entries: max_steps 2 (one frame a call) and 3 (a frame split across pieces) wrap a
# 5-step window's ring every few frames; 250 is Mimi's own window, outgrown by the stream too.
@pytest.mark.parametrize(("window", "max_steps"), [(5, 2), (5, 3), (250, 16)])
def test_ring_window_read_in_place_equals_full_decode_over_a_long_stream_in_float32(
    window: int, max_steps: int
) -> None:
    # Layer scales of 1 (Mimi starts them at 0.01) make every key of the window count in the output.
    mimi = tiny_mimi(sliding_window=window, dtype=torch.float32, layer_scale=1.0)
    frames = 160  # 320 transformer steps: the ring wraps many times, the window evicts throughout
    codes = torch.randint(0, 2048, (2, CODEBOOKS, frames), generator=torch.Generator().manual_seed(8))
    reference = full_decode(mimi, codes)
    decoder = MimiStreamDecoder(mimi, max_slots=3, max_steps=max_steps)
    sizes = random_chunks(frames, random.Random(window + max_steps))
    pieces, start = [], 0
    for size in sizes:  # both sessions in one batched call, on slots whose rings sit apart
        pieces.append(decoder.decode(codes[..., start : start + size], [2, 0]))
        start += size
    streamed = torch.cat(pieces, dim=-1)
    scale = reference.abs().max().item()
    assert (streamed - reference).abs().max().item() <= 1e-4 * scale
    assert snr_db(reference, streamed) > 80.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bfloat16_decode_on_the_gpu_tracks_the_float32_reference_over_a_long_stream() -> None:
    # Mimi's published shapes (random weights), 30 s per session, one frame per call as the talker step decodes;
    # float32 without TF32, so that the float32 stream shows the ring's own error and bfloat16 the precision's.
    from omnigate.engines.codec.mimi_stream import cast_for_decoding

    torch.manual_seed(0)
    mimi: Any = MimiModel(MimiConfig()).eval()
    with torch.no_grad():
        randomize_codebooks(mimi, torch.Generator().manual_seed(3))
    mimi.cuda()
    frames, sessions = 375, 4
    codebooks = int(mimi.config.num_quantizers)
    codes = torch.randint(0, 2048, (sessions, codebooks, frames), generator=torch.Generator().manual_seed(9)).cuda()
    slots = [5, 0, 3, 1]
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        reference = full_decode(mimi, codes).float()
        streamed = {}
        for dtype in (torch.float32, torch.bfloat16):
            cast_for_decoding(mimi, dtype)
            decoder = MimiStreamDecoder(mimi, max_slots=8)
            pieces = [decoder.decode(codes[..., t : t + 1], slots).float() for t in range(frames)]
            streamed[dtype] = torch.cat(pieces, dim=-1)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    scale = reference.abs().max().item()
    errors = {dtype: (audio - reference).abs().max().item() / scale for dtype, audio in streamed.items()}
    snrs = {dtype: snr_db(reference, audio) for dtype, audio in streamed.items()}
    print(
        f"\nmimi stream vs float32 full decode, {sessions} sessions x {frames} frames: "
        f"float32 SNR {snrs[torch.float32]:.1f} dB, max error {errors[torch.float32]:.2e} of the peak; "
        f"bfloat16 SNR {snrs[torch.bfloat16]:.1f} dB, max error {errors[torch.bfloat16]:.2e} of the peak"
    )
    assert snrs[torch.float32] > 60.0
    assert snrs[torch.bfloat16] > 25.0
