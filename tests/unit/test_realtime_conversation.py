"""Conversation bookkeeping: ids, ordering, truncation against the audio actually sent, bounds."""

from __future__ import annotations

import pytest

from omnigate.sessions.realtime.conversation import Conversation, ConversationError, IdSource, Item, Part


def conversation(max_items: int = 16) -> Conversation:
    return Conversation(IdSource("t"), max_items=max_items, truncate_tolerance_ms=50.0)


def assistant(item_id: str, *, sent_ms: float = 0.0) -> Item:
    item = Item(
        id=item_id,
        role="assistant",
        status="completed",
        content=[Part(type="output_audio", transcript="")],
        response_id="r",
    )
    item.sent_ms = sent_ms
    return item


def test_ids_are_unique_per_kind_and_session() -> None:
    a, b = IdSource(), IdSource()
    ids = {a("item") for _ in range(100)} | {b("item") for _ in range(100)} | {a("event") for _ in range(10)}
    assert len(ids) == 210
    assert all(i.startswith(("item_", "event_")) for i in ids)


def test_items_insert_after_their_predecessor() -> None:
    conv = conversation()
    assert conv.add(Item("a", "user", "completed", [])) is None
    assert conv.add(Item("b", "user", "completed", [])) == "a"
    assert conv.add(Item("c", "user", "completed", []), "a") == "a"
    assert conv.add(Item("d", "user", "completed", []), "root") is None
    assert [i.id for i in conv] == ["d", "a", "c", "b"]
    with pytest.raises(ConversationError) as exists:
        conv.add(Item("a", "user", "completed", []))
    assert exists.value.code == "item_exists"
    with pytest.raises(ConversationError) as missing:
        conv.add(Item("e", "user", "completed", []), "nope")
    assert missing.value.code == "item_not_found"


def test_truncate_is_checked_against_the_audio_sent() -> None:
    conv = conversation()
    item = assistant("a", sent_ms=1000.0)
    item.content[0].transcript = "Hello there. How are you?"
    item.marks = [(0.0, 0), (600.0, 13)]
    conv.add(item)
    with pytest.raises(ConversationError) as beyond:
        conv.truncate("a", 0, 1100)
    assert beyond.value.code == "audio_end_ms_beyond_sent" and "1000 ms" in beyond.value.message
    assert conv.truncate("a", 0, 1030) == 1000  # rounding overshoot within the tolerance: clamped
    assert item.content[0].transcript == "Hello there. How are you?"
    assert conv.truncate("a", 0, 400) == 400  # only the first sentence had started
    assert item.content[0].transcript == "Hello there. "
    with pytest.raises(ConversationError):
        conv.truncate("a", 0, 900)  # already cut at 400 ms: nothing beyond it remains
    assert conv.truncate("a", 0, 0) == 0 and item.content[0].transcript == ""


def test_truncate_refuses_items_without_sent_audio() -> None:
    conv = conversation()
    conv.add(Item("u", "user", "completed", [Part(type="input_text", text="hi")]))
    conv.add(assistant("a"))
    for item_id, index, code in (
        ("u", 0, "invalid_item"),
        ("a", 3, "invalid_content_index"),
        ("x", 0, "item_not_found"),
    ):
        with pytest.raises(ConversationError) as refused:
            conv.truncate(item_id, index, 0)
        assert refused.value.code == code


def test_the_item_count_is_bounded_and_in_progress_items_stay() -> None:
    conv = conversation(max_items=3)
    conv.add(Item("live", "assistant", "in_progress", []))
    for i in range(10):
        conv.add(Item(f"i{i}", "user", "completed", []))
    assert len(conv) == 3 and [i.id for i in conv] == ["live", "i8", "i9"]


def test_unspoken_assistant_text_and_delete() -> None:
    conv = conversation()
    conv.add(Item("a1", "assistant", "completed", [Part(type="output_text", text="One.")]))
    conv.add(Item("u1", "user", "completed", [Part(type="input_text", text="Hi")]))
    conv.add(Item("a2", "assistant", "completed", [Part(type="output_text", text="  ")]))
    assert [i.id for i in conv.unspoken_assistant_text()] == ["a1"]
    conv.delete("a1")
    assert conv.unspoken_assistant_text() == []
    with pytest.raises(ConversationError):
        conv.delete("a1")
