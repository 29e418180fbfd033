"""Per-sentence voices on CPU: the streaming machinery the piper and hibari engines share.

Each text unit (a sentence, or the short first unit of an utterance, from the session's segmenter) is turned into
phoneme pieces and synthesized by onnxruntime calls of bounded length: a unit longer than ``piece_ms`` of audio is
cut into pieces at word boundaries (after punctuation where there is some), one call per step, so one long sentence
never holds a worker while other streams' deadlines pass. A unit's first piece is no longer than the audio its
stream has made so far (at least ``RAMP_MS``), so it is ready before that audio has played. A piece's audio is
buffered and handed out in chunks of at most ``chunk_ms`` as the stream's credit allows.

A family provides :meth:`UnitVoiceEngine.pieces` (text to phoneme-id pieces) and
:meth:`UnitVoiceEngine.synthesize_piece` (one piece to float audio); everything else is here.
"""

from __future__ import annotations

import abc
import ctypes
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Annotated, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from omnigate.engines.base import (
    AudioChunk,
    Engine,
    EngineInfo,
    EngineOutput,
    EngineStream,
    SegmentDone,
    SegmentStarted,
    StreamDone,
    SynthesisParams,
)


class UnitVoiceOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Options every per-sentence voice takes (a family's options add their own)."""

    workers: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    """0: one worker per core the process may use (cgroup quota and affinity)."""
    max_sessions: Annotated[int, msgspec.Meta(ge=1)] = 64
    chunk_ms: Annotated[int, msgspec.Meta(ge=10, le=1000)] = 100
    piece_ms: Annotated[int, msgspec.Meta(ge=200, le=60_000)] = 4000
    """The longest audio one onnxruntime call makes; longer units are cut at word boundaries."""


OptionsT = TypeVar("OptionsT", bound=UnitVoiceOptions)


def parse_options(
    kind: type[OptionsT], options: Mapping[str, int | str], error: type[ValueError], family: str
) -> OptionsT:
    """``options`` as ``kind``, strings (from the command line) converted; ``error`` names what does not parse."""
    try:
        return msgspec.convert(options, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise error(f"invalid {family} option: {exc}") from None


# A chunk is cut below chunk_ms to fit the credit only down to this length; tinier pieces wait for credit.
MIN_CUT_MS = 20
# The first piece of a stream's unit is at most this long, or as long as the audio the stream has made so far.
RAMP_MS = 2000.0
# glibc keeps freed synthesis buffers in its heaps; giving them back every this many calls holds RSS ~30 MiB lower
# at no measurable cost (docs/reliability/results.md, "Piper heap").
TRIM_EVERY_CALLS = 32
# Phonemes after which a piece may end, best first: clause and sentence marks, then a word boundary.
PIECE_MARKS = frozenset(",;:.!?")
# A unit's first piece is peak-normalized to PEAK (-1 dBFS), not to full scale (then every unit reached 32767, and a
# later piece louder than its unit's first was clipped); louder samples of later pieces bend along a soft knee
# towards CEILING and never reach full scale. The curve is per sample: no gain pumps between chunks.
PEAK = 0.89
CEILING = 0.98


class UnitVoiceStream(EngineStream):
    """One utterance: the unit being played out and where the stream stands."""

    def __init__(self, params: SynthesisParams) -> None:
        super().__init__(params)
        self.next_index = 0
        self.segment_index = -1
        # Samples of the current piece not yet emitted; None between pieces.
        self.audio: npt.NDArray[np.int16] | None = None
        self.position = 0
        self.emitted_samples = 0
        self.finished = False
        # Phoneme ids of the current unit's pieces not yet synthesized, and the gain its first piece set.
        self.pieces: deque[list[int]] = deque()
        self.gain = 1.0

    @property
    def has_work(self) -> bool:
        if self.finished:
            return False
        return self.audio is not None or bool(self.pieces) or bool(self.pending_text) or self.input_done


class UnitVoiceEngine(Engine):
    """A voice served to many streams, one piece of one stream per step (batching does not pay for these voices)."""

    def __init__(self, info: EngineInfo, chunk_ms: int, piece_ms: int) -> None:
        self.info = info
        self._sample_rate = info.sample_rate
        self._chunk_samples = chunk_ms * info.sample_rate // 1000
        self._min_cut_samples = min(MIN_CUT_MS, chunk_ms) * info.sample_rate // 1000
        self._piece_ms = piece_ms
        self._calls = 0
        self._libc = _glibc()

    @abc.abstractmethod
    def pieces(self, text: str, *, speed: float = 1.0, first_ms: float | None = None) -> list[list[int]]:
        """Phoneme ids of the onnxruntime calls that speak ``text``, none longer than ``piece_ms`` of audio
        (``first_ms`` for the first); empty when the text has nothing to speak."""

    @abc.abstractmethod
    def synthesize_piece(self, stream: UnitVoiceStream, ids: list[int]) -> npt.NDArray[np.float32]:
        """One onnxruntime call: the float audio (full scale 1.0) of one piece of ``stream``'s unit."""

    @abc.abstractmethod
    def _unit_stream(self, stream: EngineStream) -> UnitVoiceStream:
        """``stream`` as this family's stream type (a TypeError for another family's)."""

    def step(self, streams: Sequence[EngineStream], budget_ms: Sequence[float]) -> list[list[EngineOutput]]:
        return [self._step_one(self._unit_stream(s), b) for s, b in zip(streams, budget_ms, strict=True)]

    def close(self, stream: EngineStream) -> None:
        us = self._unit_stream(stream)
        us.finished = True
        us.audio = None
        us.pieces.clear()
        us.pending_text.clear()

    def normalized(self, audio: npt.NDArray[np.float32], gain: float | None) -> tuple[npt.NDArray[np.int16], float]:
        """``audio`` as int16, peak-normalized to PEAK by ``gain`` (the unit's first piece sets it: None), so a cut
        sentence does not change loudness where it was cut; returns the gain. Trims glibc's heaps now and then."""
        self._calls += 1
        if self._libc is not None and self._calls % TRIM_EVERY_CALLS == 0:
            self._libc.malloc_trim(0)
        if gain is None:
            peak = float(np.max(np.abs(audio))) if audio.size else 0.0
            gain = PEAK / peak if peak > 1e-8 else 0.0
        return to_int16(audio * gain), gain

    def _step_one(self, stream: UnitVoiceStream, budget_ms: float) -> list[EngineOutput]:
        out: list[EngineOutput] = []
        if stream.finished:
            return out
        if stream.audio is None:
            # input_done is read before pending_text: the pool appends text only before it sets input_done.
            ended = stream.input_done
            if stream.pieces:
                self._synthesize_next(stream)
            elif stream.pending_text:
                text = stream.pending_text.pop(0)
                stream.segment_index = stream.next_index
                stream.next_index += 1
                out.append(SegmentStarted(index=stream.segment_index, text=text))
                # The first piece of a unit is no longer than the audio the stream has made so far (at least
                # RAMP_MS): it is ready before that audio has played, even behind other streams' pieces.
                made_ms = stream.emitted_samples * 1000.0 / self._sample_rate
                first_ms = max(RAMP_MS, made_ms)
                stream.pieces.extend(self.pieces(text, speed=stream.params.speed, first_ms=first_ms))
                stream.gain = 0.0
                if stream.pieces:
                    self._synthesize_next(stream)
                else:
                    stream.audio = np.zeros(0, dtype=np.int16)
                    stream.position = 0
            elif ended:
                out.append(StreamDone(reason="completed"))
                stream.finished = True
                return out
            else:
                return out
        self._emit(stream, budget_ms, out)
        if (
            stream.audio is None
            and not stream.finished
            and stream.input_done
            and not stream.pending_text
            and not stream.pieces
        ):
            out.append(StreamDone(reason="completed"))
            stream.finished = True
        return out

    def _synthesize_next(self, stream: UnitVoiceStream) -> None:
        ids = stream.pieces.popleft()
        gain = stream.gain if stream.gain > 0.0 else None
        stream.audio, stream.gain = self.normalized(self.synthesize_piece(stream, ids), gain)
        stream.position = 0

    def _emit(self, stream: UnitVoiceStream, budget_ms: float, out: list[EngineOutput]) -> None:
        """Emit buffered audio of the current piece up to the budget and the stream's duration cap; the unit's
        segment ends with its last piece."""
        budget = int(budget_ms * self._sample_rate / 1000.0 + 1e-6)
        cap = stream.params.max_audio_ms * self._sample_rate // 1000
        while stream.audio is not None:
            remaining = len(stream.audio) - stream.position
            if remaining == 0:
                stream.audio = None
                if not stream.pieces:
                    out.append(SegmentDone(index=stream.segment_index))
                return
            allowed = cap - stream.emitted_samples
            if allowed <= 0:
                out.append(SegmentDone(index=stream.segment_index, reason="max_duration"))
                out.append(StreamDone(reason="max_duration"))
                self.close(stream)
                return
            n = min(self._chunk_samples, remaining, allowed)
            if n > budget:
                if budget < self._min_cut_samples:
                    return
                n = budget
            samples = stream.audio[stream.position : stream.position + n]
            out.append(
                AudioChunk(
                    segment_index=stream.segment_index,
                    pcm=samples.astype("<i2", copy=False).tobytes(),
                    sample_rate=self._sample_rate,
                )
            )
            stream.position += n
            stream.emitted_samples += n
            budget -= n


def to_int16(audio: npt.NDArray[np.float32]) -> npt.NDArray[np.int16]:
    """Samples scaled to full scale 1.0 as int16, with magnitudes above PEAK softly limited below CEILING."""
    loud = np.abs(audio) > PEAK
    if loud.any():
        over = audio[loud]
        knee = CEILING - PEAK
        audio[loud] = np.sign(over) * (PEAK + knee * np.tanh((np.abs(over) - PEAK) / knee))
    return (audio * 32767.0).astype(np.int16)


def piece_limits(piece_ms: float, ms_per_phoneme: float, speed: float, first_ms: float | None) -> tuple[int, int]:
    """Phonemes in a unit's first piece and in each later one, for pieces of ``piece_ms`` (``first_ms`` first)."""
    limit = max(8, int(piece_ms * speed / ms_per_phoneme))
    first = limit if first_ms is None else max(8, min(limit, int(first_ms * speed / ms_per_phoneme)))
    return first, limit


def split_pieces(phonemes: Sequence[str], first: int, limit: int) -> list[Sequence[str]]:
    """One sentence's phonemes cut into pieces of at most ``first`` (the unit's first) and ``limit`` phonemes, with
    no leading spaces, dropping pieces of punctuation and spaces alone."""
    out: list[Sequence[str]] = []
    while phonemes:
        cut = piece_end(phonemes, first if not out else limit)
        piece, phonemes = phonemes[:cut], phonemes[cut:]
        while phonemes and phonemes[0] == " ":
            phonemes = phonemes[1:]
        if any(p not in PIECE_MARKS and p != " " for p in piece):
            out.append(piece)
    return out


def piece_end(phonemes: Sequence[str], limit: int) -> int:
    """Where the piece starting ``phonemes`` ends. All of it when it fits in ``limit``; else the rest is shared out
    into as few pieces of about equal length as fit, and this one ends near its share: just after the clause mark
    nearest to it, else at the nearest word boundary, else at the limit (one very long word)."""
    length = len(phonemes)
    if length <= limit:
        return length
    target = length / math.ceil(length / limit)
    low, high = int(target * 0.6), min(limit, int(target * 1.4))
    best: tuple[bool, float, int] | None = None
    for index in range(max(1, low), min(high, length - 1) + 1):
        if phonemes[index] != " ":
            continue
        # clause marks first, then closeness to the share
        key = (phonemes[index - 1] not in PIECE_MARKS, abs(index - target), index)
        if best is None or key < best:
            best = key
    return best[2] if best is not None else limit


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None
    return libc if hasattr(libc, "malloc_trim") else None
