"""Protocol-independent generators: JSON values of every type, mutations of a valid event, and malformed frames."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

from tests.fuzz.harness import FuzzMessage

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
# Text a client might really send, and text that stresses decoders: controls, format characters, combining marks,
# right-to-left text, emoji, and characters outside the basic plane.
odd_text = st.text(
    alphabet=st.characters(codec="utf-8", categories=["Cc", "Cf", "Mn", "So", "Zs", "Lo", "Nd", "Po"]), max_size=60
)
strings = st.text(max_size=60) | odd_text | st.just("") | st.sampled_from([" ", "\n", "\u0000", "\ufeff", "💥" * 20])


def huge_strings(limit: int) -> st.SearchStrategy[str]:
    """Strings around a size limit: just under, at, and just over it."""
    return st.sampled_from([limit - 64, limit, limit + 1, limit * 2]).map(lambda n: "a" * max(0, n))


@st.composite
def mutate(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]], huge_limit: int) -> Any:
    """A valid event with one thing wrong: a field dropped, added, retyped, emptied or made huge, or not an object."""
    event = dict(draw(valid))
    keys = sorted(event)
    operation = draw(st.sampled_from(["drop", "add", "retype", "empty", "huge", "unwrap"]))
    if operation == "drop" and keys:
        del event[draw(st.sampled_from(keys))]
    elif operation == "add":
        event[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
    elif operation == "retype" and keys:
        event[draw(st.sampled_from(keys))] = draw(json_values)
    elif operation == "empty" and keys:
        key = draw(st.sampled_from(keys))
        event[key] = draw(st.sampled_from(["", [], {}, None, 0]))
    elif operation == "huge" and keys:
        event[draw(st.sampled_from(keys))] = draw(huge_strings(huge_limit))
    elif operation == "unwrap":
        return draw(st.sampled_from([[event], list(event.values()), event.get("type"), 0, "event"]))
    return event


def _insert(data: bytes, at: int, piece: bytes) -> bytes:
    return data[:at] + piece + data[at:]


@st.composite
def malformed_frames(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]], frame_limit: int) -> FuzzMessage:
    """Frames no protocol should accept: broken JSON, invalid UTF-8 in a text frame, binary where text is expected,
    nesting bombs (as the whole message, or as a field's value), duplicate keys, and frames over the size limit."""
    encoded = msgspec.json.encode(draw(valid))
    kind = draw(
        st.sampled_from(
            [
                "truncated",
                "invalid_utf8",
                "binary",
                "random_text",
                "nesting",
                "nested_value",
                "duplicate_keys",
                "oversized",
                "empty",
            ]
        )
    )
    if kind == "truncated":
        cut = draw(st.integers(0, max(0, len(encoded) - 1)))
        return FuzzMessage(encoded[:cut], label=kind)
    if kind == "invalid_utf8":
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf0\x28\x8c\x28", b"\x80"]))
        return FuzzMessage(_insert(encoded, draw(st.integers(0, len(encoded))), bad), label=kind)
    if kind == "binary":
        return FuzzMessage(draw(st.binary(max_size=64) | st.just(encoded)), binary=True, label=kind)
    if kind == "random_text":
        return FuzzMessage(draw(st.text(max_size=80)).encode("utf-8"), label=kind)
    if kind == "nesting":
        depth = draw(st.sampled_from([64, 1000, 20_000]))
        return FuzzMessage(b"[" * depth + b"]" * depth, label=kind)
    if kind == "nested_value":
        depth = draw(st.sampled_from([64, 1000, 20_000]))
        return FuzzMessage(b'{"type":' + b"[" * depth + b"]" * depth + b"}", label=kind)
    if kind == "duplicate_keys":
        return FuzzMessage(b'{"type":"x",' + encoded.removeprefix(b"{"), label=kind)
    if kind == "oversized":
        return FuzzMessage(b" " * (frame_limit + 1), label=kind)
    return FuzzMessage(b"", label=kind)
