"""The conversation of a realtime session (sans-I/O): items, responses, ids and what was actually sent.

Items keep only what the protocol needs after the fact (role, status, text, transcript) and, for spoken items,
the audio sent to the client, against which ``conversation.item.truncate`` is checked: a client may cut an item
only within the audio it received (a small overshoot from rounding is clamped), and the transcript keeps the text
whose audio started before the cut. The item count is bounded; the oldest finished items are forgotten first.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

ItemType = Literal["message", "function_call", "function_call_output"]
ItemRole = Literal["user", "assistant", "system"]
ItemStatus = Literal["completed", "incomplete", "in_progress"]
ResponseStatus = Literal["completed", "cancelled", "failed", "incomplete", "in_progress"]
ROOT = "root"


class ConversationError(Exception):
    """A client request about items the conversation cannot satisfy; ``code`` goes to the client."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class IdSource:
    """Ids unique within the process: a random prefix per session and a counter."""

    def __init__(self, token: str | None = None) -> None:
        self._token = token if token is not None else secrets.token_hex(5)
        self._counter = itertools.count(1)

    def __call__(self, prefix: str) -> str:
        return f"{prefix}_{self._token}{next(self._counter):05d}"


@dataclass(eq=False)
class Part:
    """One content part: ``type`` is input_text, input_audio, output_text or output_audio."""

    type: str
    text: str | None = None
    transcript: str | None = None


@dataclass(eq=False)
class Item:
    """A conversation item: a ``message`` (``role``, ``content``), a ``function_call`` a response made (``call_id``,
    ``name``, ``arguments``) or the client's ``function_call_output`` (``call_id``, ``output``)."""

    id: str
    role: ItemRole
    status: ItemStatus
    content: list[Part]
    response_id: str | None = None
    type: ItemType = "message"
    call_id: str = ""
    name: str = ""
    arguments: str = ""
    output: str = ""
    spoken: bool = False  # an assistant text item a response has spoken
    audio_ms: float = 0.0  # audio of this item generated so far (its timeline)
    sent_ms: float = 0.0  # of which the client was handed this much
    truncated_ms: int | None = None
    # (audio position where a transcript piece began, its first character in the transcript)
    marks: list[tuple[float, int]] = field(default_factory=list)

    def text(self) -> str:
        return "".join(p.text or "" for p in self.content)

    def transcript(self) -> str:
        return "".join(p.transcript or "" for p in self.content)


@dataclass(eq=False)
class Response:
    id: str
    in_conversation: bool
    metadata: dict[str, str] | None
    output_modalities: tuple[str, ...]
    voice: str
    output_format: str
    max_output_tokens: int | None
    status: ResponseStatus = "in_progress"
    reason: str | None = None
    error: tuple[str, str] | None = None
    item: Item | None = None  # the message item it speaks or writes
    outputs: list[Item] = field(default_factory=list)  # its output items in order: that message, then function calls
    input_text_tokens: int = 0
    input_audio_ms: float = 0.0
    output_text_tokens: int = 0
    output_audio_ms: float = 0.0

    @property
    def done(self) -> bool:
        return self.status != "in_progress"


class Conversation:
    """Items in order, bounded to ``max_items``."""

    def __init__(self, ids: IdSource, *, max_items: int, truncate_tolerance_ms: float) -> None:
        self.ids = ids
        self.max_items = max_items
        self.truncate_tolerance_ms = truncate_tolerance_ms
        self._items: dict[str, Item] = {}

    def __iter__(self) -> Iterator[Item]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    @property
    def last_item_id(self) -> str | None:
        return next(reversed(self._items), None)

    def get(self, item_id: str, param: str = "item_id") -> Item:
        try:
            return self._items[item_id]
        except KeyError:
            raise ConversationError("item_not_found", f"no item {item_id!r} in the conversation", param) from None

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert ``item`` after ``previous_item_id`` (``root``: first; None: last); returns its predecessor's id."""
        if item.id in self._items:
            raise ConversationError("item_exists", f"an item with id {item.id!r} already exists", "item.id")
        if previous_item_id is None or previous_item_id == self.last_item_id:
            predecessor = self.last_item_id
            self._items[item.id] = item
        else:
            if previous_item_id != ROOT and previous_item_id not in self._items:
                raise ConversationError(
                    "item_not_found", f"no item {previous_item_id!r} to insert after", "previous_item_id"
                )
            entries = list(self._items.items())
            at = 0 if previous_item_id == ROOT else [key for key, _ in entries].index(previous_item_id) + 1
            entries.insert(at, (item.id, item))
            self._items = dict(entries)
            predecessor = None if previous_item_id == ROOT else previous_item_id
        self._forget_oldest()
        return predecessor

    def delete(self, item_id: str) -> None:
        item = self.get(item_id)
        if item.status == "in_progress":
            raise ConversationError("item_in_progress", f"item {item_id!r} is still being generated", "item_id")
        del self._items[item_id]

    def unspoken_assistant_text(self) -> list[Item]:
        """Assistant items carrying text that no response has spoken yet, in order."""
        return [
            i
            for i in self._items.values()
            if i.type == "message" and i.role == "assistant" and not i.spoken and i.text().strip()
        ]

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> int:
        """Cut ``item_id``'s audio at ``audio_end_ms``; returns the cut actually applied (clamped to what was sent)."""
        item = self.get(item_id)
        if item.type != "message" or item.role != "assistant" or item.response_id is None:
            raise ConversationError("invalid_item", f"item {item_id!r} holds no audio the server sent", "item_id")
        if content_index >= len(item.content) or item.content[content_index].type != "output_audio":
            raise ConversationError(
                "invalid_content_index", f"item {item_id!r} has no audio at that index", "content_index"
            )
        limit = item.sent_ms if item.truncated_ms is None else min(item.sent_ms, float(item.truncated_ms))
        if audio_end_ms > limit + self.truncate_tolerance_ms:
            raise ConversationError(
                "audio_end_ms_beyond_sent",
                f"audio_end_ms {audio_end_ms} is beyond the {limit:.0f} ms of audio sent for item {item_id!r}",
                "audio_end_ms",
            )
        cut = min(audio_end_ms, int(limit))
        item.truncated_ms = cut
        part = item.content[content_index]
        if part.transcript is not None:
            # Text whose audio began before the cut stays; the rest was never heard.
            kept = len(part.transcript)
            for position, start in item.marks:
                if position >= cut:
                    kept = start
                    break
            part.transcript = part.transcript[:kept]
        return cut

    def _forget_oldest(self) -> None:
        while len(self._items) > self.max_items:
            victim = next((key for key, item in self._items.items() if item.status != "in_progress"), None)
            if victim is None:
                return
            del self._items[victim]
