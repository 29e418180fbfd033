"""Voice names clients send, mapped to the voices an engine serves.

Voice-agent frameworks send OpenAI's voice names whatever the server; they are aliases of served voices
(:meth:`EngineInfo.voice_aliases`), so those clients work unchanged.
"""

from __future__ import annotations

from omnigate.engines.base import EngineInfo


def resolve_voice(info: EngineInfo, name: str | None) -> str | None:
    """The served voice id for ``name``; unknown names pass through for the session to refuse, typed."""
    if name is None:
        return None
    if name in info.voice_ids():
        return name
    lowered = name.lower()
    for voice in info.voices:
        if voice.id.lower() == lowered or voice.name.lower() == lowered:
            return voice.id
    return info.voice_aliases().get(lowered, name)
