"""A simulated audio player with a jitter buffer, driven by the arrival times of audio chunks.

Sans-I/O: the caller feeds ``(arrival time, audio duration)`` pairs of one utterance and the time the utterance was
known to be complete; the player replays them against a real-time playout clock.

Rules:

- The clock starts at the first audio byte. Playback starts once ``jitter_ms`` of audio is buffered (or, for an
  utterance shorter than that, when the utterance is complete).
- Playback consumes audio in real time. When the buffer runs dry and more audio of the same utterance arrives later,
  that is one underrun; the player then refills the jitter buffer before it resumes, and the time from running dry
  to resuming is stalled time.
- Running dry after the last chunk is the end of the utterance, never an underrun.
"""

from __future__ import annotations

import msgspec


class PlayerResult(msgspec.Struct, frozen=True):
    """What a listener would have experienced for one utterance."""

    audio_ms: float
    underruns: int
    stall_ms: float
    start_delay_ms: float
    """From the first audio byte to the start of playback (the jitter buffer filling up)."""


class JitterBufferPlayer:
    """Replays one utterance's audio arrivals; see the module docstring for the rules."""

    def __init__(self, jitter_ms: float) -> None:
        if jitter_ms < 0:
            raise ValueError("jitter_ms must be >= 0")
        self._jitter_ms = jitter_ms
        self._first_s: float | None = None
        self._clock_s = 0.0
        self._buffered_ms = 0.0
        self._received_ms = 0.0
        self._playing = False
        self._started_s: float | None = None
        self._dry_since_s: float | None = None
        self._dry_confirmed = False
        self._underruns = 0
        self._stall_ms = 0.0

    def feed(self, arrival_s: float, audio_ms: float) -> None:
        """One chunk of ``audio_ms`` arrived at ``arrival_s`` (seconds, non-decreasing across calls)."""
        if audio_ms <= 0:
            return
        if self._first_s is None:
            self._first_s = arrival_s
            self._clock_s = arrival_s
        self._advance(arrival_s)
        if self._dry_since_s is not None and not self._dry_confirmed:
            # More audio after running dry: the listener heard a gap in the middle of the utterance.
            self._dry_confirmed = True
            self._underruns += 1
        self._buffered_ms += audio_ms
        self._received_ms += audio_ms
        if not self._playing and self._buffered_ms >= self._jitter_ms:
            self._start(arrival_s)

    def finish(self, complete_s: float) -> PlayerResult:
        """The utterance was known complete at ``complete_s``; play out what is buffered and report."""
        if self._first_s is None:
            return PlayerResult(audio_ms=0.0, underruns=0, stall_ms=0.0, start_delay_ms=0.0)
        end_s = max(complete_s, self._clock_s)
        self._advance(end_s)
        if not self._playing and self._buffered_ms > 0:
            # Less than a jitter buffer is left and no more will come: play it now.
            self._start(end_s)
        started_s = self._started_s if self._started_s is not None else end_s
        return PlayerResult(
            audio_ms=self._received_ms,
            underruns=self._underruns,
            stall_ms=self._stall_ms,
            start_delay_ms=(started_s - self._first_s) * 1000.0,
        )

    def _start(self, now_s: float) -> None:
        self._playing = True
        if self._started_s is None:
            self._started_s = now_s
        if self._dry_since_s is not None:
            if self._dry_confirmed:
                self._stall_ms += (now_s - self._dry_since_s) * 1000.0
            self._dry_since_s = None
            self._dry_confirmed = False

    def _advance(self, now_s: float) -> None:
        """Play from the last known instant up to ``now_s``."""
        elapsed_ms = (now_s - self._clock_s) * 1000.0
        self._clock_s = max(self._clock_s, now_s)
        if not self._playing or elapsed_ms <= 0:
            return
        if self._buffered_ms >= elapsed_ms:
            self._buffered_ms -= elapsed_ms
            return
        self._dry_since_s = now_s - (elapsed_ms - self._buffered_ms) / 1000.0
        self._buffered_ms = 0.0
        self._playing = False
