"""Streaming audio encoders: every served format decodes back to the input, and bytes leave while encoding."""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Iterator

import av
import numpy as np
import numpy.typing as npt
import pytest

from omnigate.codecs import FORMATS, AudioEncoder, StreamResampler, UnsupportedFormat, encode_all, get_format
from omnigate.codecs.formats import AAC_RATES, MP3_RATES, OPUS_RATES

INPUT_RATE = 22050
TONE_HZ = 440.0
CLIP_SAMPLES = int(1.3 * INPUT_RATE)
# Odd byte counts on purpose: pieces split samples, and their sizes follow no codec frame.
PIECE_MS = (37, 1, 250, 13, 120, 3, 500, 71)


def sine(samples: int, rate: int = INPUT_RATE, freq: float = TONE_HZ) -> bytes:
    t = np.arange(samples) / rate
    return (0.5 * 32767 * np.sin(2 * np.pi * freq * t)).astype("<i2").tobytes()


def pieces(pcm: bytes, rate: int = INPUT_RATE) -> Iterator[bytes]:
    """Cut ``pcm`` into pieces of PIECE_MS durations (cycled), rounded to bytes, not samples."""
    pos, index = 0, 0
    while pos < len(pcm):
        size = round(PIECE_MS[index % len(PIECE_MS)] * rate * 2 / 1000) | 1
        yield pcm[pos : pos + size]
        pos += size
        index += 1


def decode(data: bytes, fmt: str, raw_rate: int = INPUT_RATE) -> tuple[int, int, npt.NDArray[np.float64]]:
    """Decode with PyAV: (sample rate, channels, mono float samples)."""
    options = {"sample_rate": str(raw_rate), "ch_layout": "mono"} if fmt == "pcm" else {}
    with av.open(io.BytesIO(data), "r", format="s16le" if fmt == "pcm" else None, options=options) as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray().astype(np.float64) for frame in container.decode(stream)]
        # fltp frames come as (channels, samples); s16 ones as (1, samples * channels).
        samples = np.concatenate([frame.reshape(-1) for frame in frames]) if frames else np.zeros(0)
        return stream.rate, stream.channels, samples


def dominant_hz(samples: npt.NDArray[np.float64], rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum)) * rate / len(samples)


# Decoded length minus input length (at the decoded rate), in samples, as (low, high):
# - pcm, wav, flac: exact; FLAC's last block is as short as the input left.
# - opus: Ogg carries the pre-skip and the final granule, so the decoder trims to the input length; the
#   22.05 -> 48 kHz conversion may round by one sample.
# - mp3: LAME primes 576 + 529 = 1105 samples, which a stream without the (seek-written) LAME tag cannot tell
#   the decoder to drop, then pads to the next whole frame (MPEG-2 Layer III at 22.05 kHz: 576 samples);
#   LAME adds a frame when the input fills the last one exactly, hence up to 1105 + 576.
# - aac: the encoder primes 1024 samples, which ADTS cannot signal, and pads the last 1024-sample frame.
# Holdback: input the encoder still holds before flush. Opus: 6.5 ms lookahead + a frame being filled +
# one complete 20 ms frame + the resampler's filter delay; LAME: 50 ms priming + the frames its psychoacoustic
# lookahead keeps buffered (up to 4 x 26 ms over random piece sizes); AAC: 46 ms priming + 2 frames of 46 ms;
# FLAC: less than one 2304-sample block (104.5 ms); raw formats nothing.
EXPECTED = {
    # name: (decoded rate, (low, high) excess samples, max holdback ms)
    "pcm": (INPUT_RATE, (0, 0), 0.0),
    "wav": (INPUT_RATE, (0, 0), 0.0),
    "flac": (INPUT_RATE, (0, 0), 105.0),
    "opus": (48000, (-1, 1), 50.0),
    "mp3": (INPUT_RATE, (1105, 1105 + 576), 155.0),
    "aac": (INPUT_RATE, (1024, 1024 + 1024), 140.0),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_streamed_pieces_decode_to_the_input_tone(name: str) -> None:
    assert set(EXPECTED) == set(FORMATS)
    rate, (low, high), max_holdback_ms = EXPECTED[name]
    encoder = AudioEncoder(name, INPUT_RATE)
    before_flush = b"".join(encoder.encode(piece) for piece in pieces(sine(CLIP_SAMPLES)))
    data = before_flush + encoder.flush()

    assert before_flush, "nothing left the encoder before flush"
    assert encoder.input_samples == CLIP_SAMPLES
    assert encoder.encoded_bytes == len(data)
    assert encoder.output_rate == rate
    decoded_rate, channels, samples = decode(data, name)
    assert (decoded_rate, channels) == (rate, 1)
    expected = CLIP_SAMPLES * rate / INPUT_RATE
    assert low <= len(samples) - expected <= high
    assert dominant_hz(samples, rate) == pytest.approx(TONE_HZ, abs=2.0)

    _, _, streamed = decode(before_flush, name)
    held_back_ms = (expected + low - len(streamed)) * 1000 / rate
    assert held_back_ms <= max_holdback_ms


def ogg_pages(data: bytes) -> list[int]:
    """Granule positions of the Ogg pages in ``data`` (which must hold whole pages)."""
    granules, pos = [], 0
    while pos < len(data):
        assert data[pos : pos + 4] == b"OggS"
        (granule,) = struct.unpack_from("<q", data, pos + 6)
        segments = data[pos + 26]
        body = sum(data[pos + 27 : pos + 27 + segments])
        granules.append(granule)
        pos += 27 + segments + body
    assert pos == len(data)
    return granules


def test_opus_pages_leave_while_encoding() -> None:
    encoder = AudioEncoder("opus", INPUT_RATE)
    ten_ms = INPUT_RATE // 100 * 2
    pcm = sine(CLIP_SAMPLES)
    out = b""
    fed_ms = 0
    while not any(granule > 0 for granule in ogg_pages(out)):
        out += encoder.encode(pcm[fed_ms // 10 * ten_ms : (fed_ms // 10 + 1) * ten_ms])
        fed_ms += 10
        assert fed_ms <= 100, "no Opus audio page within the first 100 ms of input"
    # Each 20 ms packet leaves in its own page: about 50 pages per second of input.
    rest = encoder.encode(pcm[fed_ms // 10 * ten_ms :])
    audio_pages = [granule for granule in ogg_pages(out + rest) if granule > 0]
    assert len(audio_pages) >= 1.3 * 50 - 3
    assert ogg_pages(encoder.flush())


def test_wav_header_comes_first_with_unknown_sizes() -> None:
    encoder = AudioEncoder("wav", INPUT_RATE, 24000)
    first = encoder.encode(b"\x01")  # half a sample: nothing to write but the header
    assert len(first) == 44
    riff, riff_size, wave, fmt_id, fmt_size = struct.unpack_from("<4sI4s4sI", first)
    audio_format, channels, rate, byte_rate, block_align, bits = struct.unpack_from("<HHIIHH", first, 20)
    data_id, data_size = struct.unpack_from("<4sI", first, 36)
    assert (riff, wave, fmt_id, data_id) == (b"RIFF", b"WAVE", b"fmt ", b"data")
    assert riff_size == data_size == 0xFFFFFFFF
    assert (fmt_size, audio_format, channels, rate, byte_rate, block_align, bits) == (
        16,
        1,
        1,
        24000,
        48000,
        2,
        16,
    )
    assert not encoder.encode(b"\x00").startswith(b"RIFF")


def test_empty_wav_stream_is_a_header() -> None:
    assert len(AudioEncoder("wav", INPUT_RATE).flush()) == 44


def test_pcm_passthrough_is_byte_exact() -> None:
    pcm = sine(CLIP_SAMPLES)
    encoder = AudioEncoder("pcm", INPUT_RATE)
    out = b"".join(encoder.encode(piece) for piece in pieces(pcm)) + encoder.flush()
    assert out == pcm
    assert not encoder.costly


def test_pcm_resampled_to_requested_rate() -> None:
    pcm = sine(CLIP_SAMPLES)
    encoder = AudioEncoder("pcm", INPUT_RATE, 24000)
    assert encoder.costly
    out = b"".join(encoder.encode(piece) for piece in pieces(pcm)) + encoder.flush()
    assert len(out) % 2 == 0
    samples = np.frombuffer(out, dtype="<i2").astype(np.float64)
    assert len(samples) == pytest.approx(CLIP_SAMPLES * 24000 / INPUT_RATE, abs=1)
    assert dominant_hz(samples, 24000) == pytest.approx(TONE_HZ, abs=2.0)


def test_stream_resampler_pieces_equal_one_shot() -> None:
    pcm = sine(CLIP_SAMPLES)
    whole = StreamResampler(INPUT_RATE, 24000)
    one_shot = whole.process(pcm) + whole.flush()
    streamed = StreamResampler(INPUT_RATE, 24000)
    cuts = range(0, len(pcm), 2 * 331)
    out = b"".join(streamed.process(pcm[cut : cut + 2 * 331]) for cut in cuts) + streamed.flush()
    assert out == one_shot
    assert len(out) // 2 == pytest.approx(CLIP_SAMPLES * 24000 / INPUT_RATE, abs=1)


def test_stream_resampler_webrtc_frames() -> None:
    resampler = StreamResampler(24000, 48000)
    out = b"".join(resampler.process(sine(480, 24000)) for _ in range(50)) + resampler.flush()
    assert len(out) // 2 == pytest.approx(50 * 960, abs=1)


def test_stream_resampler_rejects_split_samples_and_reuse() -> None:
    resampler = StreamResampler(INPUT_RATE, 48000)
    with pytest.raises(ValueError, match="whole samples"):
        resampler.process(b"\x00\x00\x00")
    resampler.flush()
    with pytest.raises(RuntimeError):
        resampler.process(b"\x00\x00")


def test_encode_all_raw_formats() -> None:
    pcm = sine(CLIP_SAMPLES)
    assert encode_all("pcm", pcm, INPUT_RATE) == pcm
    wav = encode_all("wav", pcm, INPUT_RATE)
    assert wav[44:] == pcm


def test_encode_all_opus_at_requested_rate() -> None:
    data = encode_all("opus", sine(CLIP_SAMPLES), INPUT_RATE, 16000)
    rate, channels, samples = decode(data, "opus")
    # Opus decoders always output 48 kHz; the requested rate is the one the encoder ran at.
    assert (rate, channels) == (48000, 1)
    assert len(samples) == pytest.approx(CLIP_SAMPLES * 48000 / INPUT_RATE, abs=1)
    assert dominant_hz(samples, rate) == pytest.approx(TONE_HZ, abs=2.0)


@pytest.mark.parametrize("name", ["opus", "mp3", "aac", "flac"])
def test_codec_formats_are_costly_and_finish_once(name: str) -> None:
    encoder = AudioEncoder(name, 24000)
    assert encoder.costly
    encoder.encode(sine(2400, 24000))
    encoder.flush()
    assert encoder.finished
    with pytest.raises(RuntimeError, match="finished"):
        encoder.encode(b"\x00\x00")
    with pytest.raises(RuntimeError, match="finished"):
        encoder.flush()


def test_close_abandons_a_stream() -> None:
    encoder = AudioEncoder("aac", INPUT_RATE)
    encoder.encode(sine(5000))
    encoder.close()
    encoder.close()
    assert encoder.finished
    with pytest.raises(RuntimeError):
        encoder.encode(b"\x00\x00")


def test_unknown_format_is_refused_with_the_valid_names() -> None:
    with pytest.raises(UnsupportedFormat) as refused:
        get_format("ogg-vorbis")
    assert isinstance(refused.value, ValueError)
    assert refused.value.valid == tuple(FORMATS)
    for name in FORMATS:
        assert name in str(refused.value)
    with pytest.raises(UnsupportedFormat):
        AudioEncoder("g729", INPUT_RATE)
    assert get_format("MP3") is FORMATS["mp3"]


def test_content_types_follow_openai() -> None:
    assert {name: fmt.content_type for name, fmt in FORMATS.items()} == {
        "pcm": "audio/pcm",
        "wav": "audio/wav",
        "opus": "audio/ogg",
        "mp3": "audio/mpeg",
        "aac": "audio/aac",
        "flac": "audio/flac",
    }


@pytest.mark.parametrize(
    ("name", "input_rate", "requested", "expected"),
    [
        ("opus", 22050, None, 48000),
        ("opus", 24000, None, 48000),
        ("opus", 22050, 16000, 16000),
        ("opus", 22050, 24000, 24000),
        ("opus", 22050, 44100, 48000),
        ("mp3", 22050, None, 22050),
        ("mp3", 23000, None, 22050),
        ("mp3", 23100, None, 24000),
        ("mp3", 22050, 44100, 44100),
        ("mp3", 96000, None, 48000),
        ("aac", 7000, None, 7350),
        ("aac", 24000, 96000, 96000),
        ("aac", 50000, None, 48000),
        ("flac", 22050, None, 22050),
        ("flac", 22050, 16000, 16000),
        ("pcm", 22050, None, 22050),
        ("pcm", 22050, 24000, 24000),
        ("wav", 16000, 8000, 8000),
    ],
)
def test_output_rate_rules(name: str, input_rate: int, requested: int | None, expected: int) -> None:
    assert FORMATS[name].output_rate(input_rate, requested) == expected


def test_output_rate_refuses_non_positive_rates() -> None:
    with pytest.raises(ValueError, match="positive"):
        FORMATS["pcm"].output_rate(0)
    with pytest.raises(ValueError, match="positive"):
        FORMATS["mp3"].output_rate(22050, -1)


def test_declared_rates_are_what_the_bundled_encoders_accept() -> None:
    for fmt in FORMATS.values():
        if fmt.codec is None:
            continue
        codec = av.Codec(fmt.codec, "w")
        assert codec.type == "audio"
        if fmt.sample_rates is not None:
            assert set(fmt.sample_rates) <= set(codec.audio_rates or ())
    assert (FORMATS["opus"].sample_rates, FORMATS["mp3"].sample_rates) == (OPUS_RATES, MP3_RATES)
    assert FORMATS["aac"].sample_rates == AAC_RATES


def test_stream_resampler_matches_pyav_and_starts_no_thread() -> None:
    from omnigate.codecs.resample import _frames_to_pcm, pcm_to_frame

    rng = np.random.default_rng(7)
    for in_rate, out_rate in [(24000, 16000), (8000, 24000), (24000, 48000), (22050, 24000)]:
        pcm = (rng.standard_normal(in_rate) * 3000).astype("<i2").tobytes()
        pieces = [pcm[start : start + 962] for start in range(0, len(pcm), 962)]
        threads_before = len(os.listdir("/proc/self/task"))
        ours = StreamResampler(in_rate, out_rate)
        got = b"".join(ours.process(piece) for piece in pieces)
        assert len(os.listdir("/proc/self/task")) == threads_before
        got += ours.flush()
        reference, pts, expected = av.AudioResampler(format="s16", layout="mono", rate=out_rate), 0, b""
        for piece in pieces:
            frame = pcm_to_frame(piece, in_rate, pts)
            pts += frame.samples
            expected += _frames_to_pcm(reference.resample(frame))
        assert got == expected + _frames_to_pcm(reference.resample(None))
