"""When a talker segment stops besides its end-of-audio frame: a duration cap and a runaway silent tail."""

from __future__ import annotations

import math


def frame_limit(max_audio_ms: float, frame_ms: float) -> int:
    """Whole frames that fit in ``max_audio_ms`` of audio."""
    return max(0, math.floor(max_audio_ms / frame_ms + 1e-9))


class SilenceDetector:
    """Counts consecutive frames whose RMS is below a level; trips after a run of ``seconds``.

    RMS is measured against full scale 1.0 (a full-scale square wave is 0 dBFS).
    """

    def __init__(self, *, threshold_dbfs: float, seconds: float, frame_ms: float) -> None:
        self.threshold_rms = 10.0 ** (threshold_dbfs / 20.0)
        self.frames_needed = max(1, math.ceil(seconds * 1000.0 / frame_ms - 1e-9))
        self.run = 0

    def reset(self) -> None:
        """Start counting afresh (a new segment)."""
        self.run = 0

    def feed(self, frame_rms: list[float]) -> bool:
        """Account decoded frames in order; True once the silent run is long enough."""
        for rms in frame_rms:
            self.run = self.run + 1 if rms < self.threshold_rms else 0
            if self.run >= self.frames_needed:
                return True
        return False
