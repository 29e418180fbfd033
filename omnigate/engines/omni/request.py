"""What crosses between a video-chat session and the omni engine: queries in, text out (no torch at import).

A query carries the frames sampled for it (decoded pixels and a digest of each), the question's audio, and the
prompt text around them; the answer comes back as :class:`TextDelta` pieces and one final :class:`ThinkDone`, and
from an engine that speaks its answers itself (``OmniInfo.voiced``) with :class:`AudioDelta` pieces of its voice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if TYPE_CHECKING:
    import torch

# ``max_context``: the answer filled its slot of the thinker's context (prompt and answer) before it ended.
ThinkStop = Literal["completed", "max_tokens", "max_context", "cancelled", "error"]
# The error code of a prompt longer than the thinker's context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
AUDIO_RATE = 16_000  # a question's audio: mono s16le at this rate (the audio encoder's)


class TextDelta(msgspec.Struct, frozen=True, tag="text.delta"):
    text: str


class AudioDelta(msgspec.Struct, frozen=True, tag="audio.delta"):
    """The answer's voice, mono s16le at ``sample_rate`` (only from a voiced engine)."""

    pcm: bytes
    sample_rate: int


class ThinkDone(msgspec.Struct, frozen=True, tag="think.done"):
    """The last output of a query; an ``error`` comes with a message and, when the client can act on it, a code."""

    reason: ThinkStop
    text: str
    tokens: int
    error: str | None = None
    code: str | None = None


ThinkOutput = TextDelta | AudioDelta | ThinkDone
ThinkSink = Callable[[list[ThinkOutput]], None]


class OmniInfo(msgspec.Struct, frozen=True):
    model: str
    max_sessions: int
    frame_size: int
    tokens_per_frame: int
    random_weights: bool
    voiced: bool = False  # the engine speaks its answers itself: no speech session on the pool


@dataclass(frozen=True)
class FrameInput:
    """One sampled frame: RGB pixels at the model's frame size and a digest of them (the encoder cache's key)."""

    digest: bytes
    pixels: Any  # numpy uint8 [frame_size, frame_size, 3]


class EncoderCache:
    """Vision tokens of a session's recent frames by digest, the least recently used forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, digest: bytes) -> torch.Tensor | None:
        tokens = self._entries.get(digest)
        if tokens is not None:
            self._entries.move_to_end(digest)
            self.hits += 1
        else:
            self.misses += 1
        return tokens

    def __contains__(self, digest: object) -> bool:
        """Whether the frame's tokens are held (not counted as a hit or a miss, and not refreshed)."""
        return digest in self._entries

    def put(self, digest: bytes, tokens: torch.Tensor) -> None:
        self._entries[digest] = tokens
        self._entries.move_to_end(digest)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class ThinkRequest:
    """Everything one answer needs. ``context`` is the prompt text before the user's turn (system and history)."""

    context: str
    question: str
    frames: tuple[FrameInput, ...] = ()
    audio: bytes = b""  # the question's audio, mono s16le 16 kHz
    max_new_tokens: int = 256
    temperature: float = 0.7
    seed: int = 0
    cache: EncoderCache | None = None
    speak: bool = True  # a voiced engine's answer also in its voice
    voice: str | None = None  # a voiced engine's voice; None: its default
