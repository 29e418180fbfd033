"""The state of one talker utterance between steps."""

from __future__ import annotations

from dataclasses import dataclass

from omnigate.engines.base import EngineOutput, EngineStream, SynthesisParams, UnitTokens
from omnigate.engines.talker.context import ContextSegment
from omnigate.engines.talker.stopping import SilenceDetector
from omnigate.engines.unit_tokens import valid_unit_ids


@dataclass
class Segment:
    """The text unit being spoken: CSM generates it as one segment, with the earlier ones as context."""

    index: int
    text: str
    frame_limit: int | None = None  # a cap on this unit's audio, if any
    frames: int = 0


class TalkerStream(EngineStream):
    """One utterance: its slot, its segment, and the audio of frames generated but not yet sent."""

    def __init__(
        self,
        params: SynthesisParams,
        *,
        seed: int,
        frame_limit: int,
        silence: SilenceDetector,
        context: tuple[ContextSegment, ...] = (),
        unit_tokens: UnitTokens | None = None,
    ) -> None:
        super().__init__(params)
        self.unit_tokens = unit_tokens
        # ids of queued units that came with their text (:meth:`push_text`), by the text object's identity
        self._given: dict[int, tuple[str, list[int]]] = {}
        self.seed = seed
        self.context = context  # spoken before the first unit, then dropped
        self.frame_limit = frame_limit
        self.silence = silence
        self.slot: int | None = None
        self.segment: Segment | None = None
        self.next_segment = 0
        self.has_context = False  # something is in the KV cache: a new segment first closes the previous audio
        # the next unit's text and its tokens, kept while it waits for room in a step's prefill (tokenized once)
        self.head_tokens: tuple[str, list[int]] | None = None
        # decoded frames (s16le PCM) not yet sent, one entry per frame (views of their step's PCM, copied once)
        self.pending: list[bytes | memoryview] = []
        self.pending_rms: list[float] = []  # their RMS levels, for the silence detector
        self.chunk = 0  # position in the chunk ramp
        self.restart_ramp = False  # the stream ran out of text, so its client's buffer may have drained
        self.audio_frames = 0
        self.draws = 0  # frames sampled, end-of-audio frames included: the stream's noise counter
        self.finished = False
        self.closed = False
        self.in_flight = False  # a frame of this stream is on the device, launched but not yet collected
        self.outbox: list[EngineOutput] = []  # outputs not yet returned by a step (the stream was not in its batch)

    def push_text(self, text: str, tokens: list[int] | None = None) -> None:
        self.pending_text.append(text)
        if tokens is not None and self.unit_tokens is not None and valid_unit_ids(self.unit_tokens, tokens):
            self._given[id(text)] = (text, tokens)

    def take_tokens(self, text: str) -> list[int] | None:
        """The ids that came with the queued unit ``text`` (this very object), if any; forgets them."""
        given = self._given.pop(id(text), None)
        return given[1] if given is not None and given[0] is text else None

    def forget_tokens(self) -> None:
        self._given.clear()

    @property
    def has_work(self) -> bool:
        if self.closed:
            return False
        if self.outbox or self.in_flight:
            return True
        if self.finished:
            return False
        return self.segment is not None or bool(self.pending_text) or self.input_done
