"""When a natively duplex model is speaking (sans-I/O): its frames grouped into responses.

A duplex model produces a frame every tick whether it speaks or listens; its text stream says which. A response
opens at the first speaking frame and closes after ``end_frames`` consecutive listening frames (the trailing quiet
belongs to it). Frames outside a response are the model listening and are not sent. After an interruption (the
client cancelled, or the user barged in) a new response opens only once the model has listened for a frame, or
after ``max_mute_frames`` (a model still talking that long after the cancel is saying something new): the audio
that was cut off does not resume at once.
"""

from __future__ import annotations

from typing import Literal

FrameRole = Literal["listen", "start", "speak", "end"]


class ModelTurns:
    """Classifies each frame: ``listen`` (not sent), ``start`` (opens a response), ``speak``, ``end`` (closes it)."""

    def __init__(self, end_frames: int, max_mute_frames: int) -> None:
        if end_frames < 1 or max_mute_frames < 1:
            raise ValueError("a turn ends after at least one listening frame, and a mute lasts at least one frame")
        self.end_frames = end_frames
        self.max_mute_frames = max_mute_frames
        self.speaking = False
        self.muted = False
        self._quiet = 0
        self._muted_for = 0

    def feed(self, listening: bool) -> FrameRole:
        if not self.speaking:
            if listening:
                self.muted = False
                return "listen"
            if self.muted and self._muted_for < self.max_mute_frames:
                self._muted_for += 1
                return "listen"
            self.muted = False
            self.speaking = True
            self._quiet = 0
            return "start"
        if not listening:
            self._quiet = 0
            return "speak"
        self._quiet += 1
        if self._quiet >= self.end_frames:
            self.speaking = False
            return "end"
        return "speak"

    def interrupt(self) -> None:
        """The response in progress was ended from outside; wait for the model to listen before the next one."""
        self.speaking = False
        self.muted = True
        self._quiet = 0
        self._muted_for = 0
