"""Server-side turn detection (sans-I/O): speech probabilities per window in, speech start and stop out.

Times are milliseconds of input audio since the session began. Speech starts at the first window at or above the
threshold; the reported start reaches back ``prefix_padding_ms`` (the audio a model should hear before the detected
onset). Speech stops once windows below the threshold have lasted ``silence_duration_ms``; the reported end is that
moment, so it includes the silence, as OpenAI's server VAD reports it.
"""

from __future__ import annotations

import msgspec


class TurnDetectionSettings(msgspec.Struct, frozen=True):
    """The server-VAD knobs of the OpenAI Realtime protocol, with its defaults."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500


class SpeechStarted(msgspec.Struct, frozen=True):
    audio_start_ms: int


class SpeechStopped(msgspec.Struct, frozen=True):
    audio_end_ms: int


TurnEvent = SpeechStarted | SpeechStopped


class TurnDetector:
    """Turns a stream of per-window speech probabilities into speech start and stop events."""

    def __init__(self, settings: TurnDetectionSettings, window_ms: float) -> None:
        self.settings = settings
        self.window_ms = window_ms
        self.position_ms = 0.0
        self.speaking = False
        self._silence_ms = 0.0

    def feed(self, probability: float) -> TurnEvent | None:
        """Account one window; returns the event it completes, if any."""
        start = self.position_ms
        self.position_ms += self.window_ms
        voiced = probability >= self.settings.threshold
        if not self.speaking:
            if voiced:
                self.speaking = True
                self._silence_ms = 0.0
                return SpeechStarted(max(0, round(start - self.settings.prefix_padding_ms)))
            return None
        if voiced:
            self._silence_ms = 0.0
            return None
        self._silence_ms += self.window_ms
        if self._silence_ms >= self.settings.silence_duration_ms:
            self.speaking = False
            self._silence_ms = 0.0
            return SpeechStopped(round(self.position_ms))
        return None

    def skip(self, ms: float) -> None:
        """Audio that was not scored (the detector fell behind and dropped it) still moves the clock."""
        self.position_ms += ms
