"""Conversation items a client creates (``conversation.item.create``), checked and made into :class:`Item`\\ s.

Messages carry the content their role takes (user: text and audio transcripts, system: text, assistant: text);
with an LLM behind the session, a client also adds its tools' answers (``function_call_output``) and calls
(``function_call``) to the history. Refusals are :class:`ConfigRefused` with the parameter at fault.
"""

from __future__ import annotations

from collections.abc import Callable

from omnigate.sessions.realtime.client_events import ItemSpec
from omnigate.sessions.realtime.config import ConfigRefused
from omnigate.sessions.realtime.conversation import Item, ItemRole, Part

_ROLES: dict[str, ItemRole] = {"user": "user", "assistant": "assistant", "system": "system"}
_CONTENT: dict[str, tuple[str, ...]] = {
    "user": ("input_text", "input_audio"),
    "system": ("input_text",),
    "assistant": ("output_text", "text"),
}


def client_item(spec: ItemSpec, new_id: Callable[[str], str], *, max_text_chars: int, calls: bool) -> Item:
    """The item ``spec`` describes; ``calls``: function calls and their outputs are served (an LLM answers)."""
    if spec.id is not None and not 1 <= len(spec.id) <= 64:
        raise ConfigRefused("invalid_value", "item.id must be 1..64 characters", "item.id")
    item_id = spec.id or new_id("item")
    if spec.type in ("function_call", "function_call_output") and calls:
        return _call_item(spec, item_id)
    if spec.type != "message":
        raise ConfigRefused("unsupported", f"item type {spec.type!r} is not served (no tools)", "item.type")
    if spec.role is None or spec.role not in _CONTENT:
        raise ConfigRefused("invalid_value", "item.role must be user, assistant or system", "item.role")
    allowed = _CONTENT[spec.role]
    parts: list[Part] = []
    for part in spec.content:
        if part.type not in allowed:
            raise ConfigRefused("unsupported", f"a {spec.role} item takes {list(allowed)} content", "item.content")
        if part.type == "input_audio":
            parts.append(Part(type="input_audio", transcript=part.transcript))
        else:
            kind = "output_text" if spec.role == "assistant" else "input_text"
            parts.append(Part(type=kind, text=part.text or ""))
    if sum(len(p.text or "") for p in parts) > max_text_chars:
        raise ConfigRefused("input_too_large", f"an item holds at most {max_text_chars} characters")
    return Item(id=item_id, role=_ROLES[spec.role], status="completed", content=parts)


def _call_item(spec: ItemSpec, item_id: str) -> Item:
    if not spec.call_id:
        raise ConfigRefused("invalid_value", f"a {spec.type} item names its call_id", "item.call_id")
    if spec.type == "function_call":
        if not spec.name:
            raise ConfigRefused("invalid_value", "a function_call item names its function", "item.name")
        return Item(
            id=item_id,
            role="assistant",
            status="completed",
            content=[],
            type="function_call",
            call_id=spec.call_id,
            name=spec.name,
            arguments=spec.arguments or "{}",
        )
    return Item(
        id=item_id,
        role="user",
        status="completed",
        content=[],
        type="function_call_output",
        call_id=spec.call_id,
        output=spec.output or "",
    )
