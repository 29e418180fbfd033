"""Reference context for a talker utterance: earlier speech (text and its audio) that CSM continues from.

CSM conditions on preceding segments, each ``<bos>[speaker]text<eos>`` followed by its audio frames and an
end-of-audio frame; a voice is cloned or a conversation continued by giving such segments before the first unit.
Everything is checked when the stream opens, before any engine work.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from omnigate.engines.base import EngineError

MAX_CONTEXT_TEXT_CHARS = 2000


class ContextSegment(msgspec.Struct, frozen=True):
    """One earlier utterance: who spoke, what was said, and the audio as mono s16le PCM at the engine's rate."""

    speaker: str
    text: str
    pcm: bytes


def validate_context(
    context: Sequence[ContextSegment], *, speakers: frozenset[str], sample_rate: int, max_audio_s: float
) -> None:
    """Refuse context the engine cannot use. Raises :class:`EngineError` (code ``invalid_context``)."""
    total_samples = 0
    for i, segment in enumerate(context):
        if segment.speaker not in speakers:
            raise EngineError("invalid_context", f"context segment {i}: unknown speaker {segment.speaker!r}", "context")
        if not segment.text.strip() or len(segment.text) > MAX_CONTEXT_TEXT_CHARS:
            raise EngineError(
                "invalid_context", f"context segment {i}: text must have 1..{MAX_CONTEXT_TEXT_CHARS} chars", "context"
            )
        if not segment.pcm or len(segment.pcm) % 2:
            raise EngineError("invalid_context", f"context segment {i}: audio must be non-empty s16le PCM", "context")
        total_samples += len(segment.pcm) // 2
    if total_samples > max_audio_s * sample_rate:
        raise EngineError("invalid_context", f"context audio exceeds {max_audio_s:g} s", "context")
