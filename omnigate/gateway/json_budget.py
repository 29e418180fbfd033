"""The work one client JSON message may cost the event loop, bounded before the message is decoded.

msgspec decodes in C while holding the GIL, so decoding on another thread would not spare the loop: what bounds the
cost is the number of values the decoder must build or skip. A 4 MiB message of empty objects costs ~100 ms to decode
untyped and ~50 ms typed on this project's CPU machine, against ~1 ms for a 4 MiB audio chunk (one string). Counting
commas and opening brackets is a memchr-speed scan (about 1 ms for 4 MiB) and bounds the value count from above: a
comma or bracket inside a string counts too, which can only err towards refusing, and only messages far larger than
any client sends.
"""

from __future__ import annotations

# 65,536 values decode in ~5 ms at worst; a session.update with 128 tools of rich JSON schemas holds ~15,000.
MAX_JSON_VALUES = 65_536

CODE = "message_too_complex"


def json_values_bound(raw: str | bytes) -> int:
    """An upper bound on the number of JSON values in ``raw`` (one more than its separators and containers)."""
    if isinstance(raw, str):
        return raw.count(",") + raw.count("{") + raw.count("[") + 1
    return raw.count(b",") + raw.count(b"{") + raw.count(b"[") + 1


def json_budget_problem(raw: str | bytes, limit: int = MAX_JSON_VALUES) -> str | None:
    """Why ``raw`` is refused before decoding (it may hold more than ``limit`` JSON values), or None."""
    if len(raw) <= limit:  # fewer characters than the limit: fewer values too
        return None
    bound = json_values_bound(raw)
    if bound <= limit:
        return None
    return f"the message may hold up to {bound} JSON values; a message may hold at most {limit}"
