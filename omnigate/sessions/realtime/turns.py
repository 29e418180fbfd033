"""Server-side turn detection (sans-I/O): speech probabilities per window in, speech start and stop out.

Times are milliseconds of input audio since the session began. Speech starts at the first window at or above the
threshold; the reported start reaches back ``prefix_padding_ms`` (the audio a model should hear before the detected
onset). Speech stops once windows below the threshold have lasted ``silence_duration_ms``; the reported end is that
moment, so it includes the silence, as OpenAI's server VAD reports it.

A turn has a maximum length (``max_turn_ms``): a monologue, or a television in the room, that never pauses that long
ends there (``SpeechStopped.forced``), and the next voiced window starts a new turn, so detection never stalls.
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
    forced: bool = False  # the turn reached the maximum length, not a silence


TurnEvent = SpeechStarted | SpeechStopped


class TurnDetector:
    """Turns a stream of per-window speech probabilities into speech start and stop events."""

    def __init__(self, settings: TurnDetectionSettings, window_ms: float, max_turn_ms: float | None = None) -> None:
        self.settings = settings
        self.window_ms = window_ms
        self.max_turn_ms = max_turn_ms
        self.position_ms = 0.0
        self.speaking = False
        self._silence_ms = 0.0
        self._turn_start_ms = 0.0
        self._last_end_ms = 0.0

    def feed(self, probability: float) -> TurnEvent | None:
        """Account one window; returns the event it completes, if any."""
        start = self.position_ms
        self.position_ms += self.window_ms
        voiced = probability >= self.settings.threshold
        if not self.speaking:
            if voiced:
                self.speaking = True
                self._silence_ms = 0.0
                # The padding never reaches back into the turn before.
                self._turn_start_ms = max(self._last_end_ms, start - self.settings.prefix_padding_ms)
                return SpeechStarted(max(0, round(self._turn_start_ms)))
            return None
        if voiced:
            self._silence_ms = 0.0
            if self.max_turn_ms is not None and self.position_ms - self._turn_start_ms >= self.max_turn_ms:
                return self._stop(forced=True)  # (a turn in its closing silence ends by itself soon)
            return None
        self._silence_ms += self.window_ms
        if self._silence_ms >= self.settings.silence_duration_ms:
            return self._stop(forced=False)
        return None

    def _stop(self, *, forced: bool) -> SpeechStopped:
        self.speaking = False
        self._silence_ms = 0.0
        self._last_end_ms = self.position_ms
        return SpeechStopped(round(self.position_ms), forced)

    def skip(self, ms: float) -> None:
        """Audio that was not scored (the detector fell behind and dropped it) still moves the clock."""
        self.position_ms += ms
