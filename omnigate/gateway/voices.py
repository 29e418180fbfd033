"""Voice names clients send, mapped to the voices an engine serves.

Voice-agent frameworks send OpenAI's voice names whatever the server; they are aliases of served voices, so those
clients work unchanged.
"""

from __future__ import annotations

from omnigate.engines.base import EngineInfo

OPENAI_VOICES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse", "marin", "cedar",
)  # fmt: skip


def resolve_voice(info: EngineInfo, name: str | None) -> str | None:
    """The served voice id for ``name``; unknown names pass through for the session to refuse, typed."""
    if name is None:
        return None
    served = info.voice_ids()
    if name in served:
        return name
    lowered = name.lower()
    for voice in info.voices:
        if voice.id.lower() == lowered or voice.name.lower() == lowered:
            return voice.id
    if lowered in OPENAI_VOICES:
        ids = sorted(served)
        # A stable spread of aliases over the served voices.
        return ids[OPENAI_VOICES.index(lowered) % len(ids)] if len(ids) > 1 else info.default_voice
    return name
