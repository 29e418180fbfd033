"""A response an LLM writes (sans-I/O): what the session tracks of it between its request and its end.

The session asks the LLM (through the adapter) once the transcripts of the user's turns are in; the reply's text
goes to the TTS as it streams, its tool calls become ``function_call`` items. The conversation goes to the LLM as
:class:`HistoryItem`\\ s: an assistant item as the user heard it (its transcript cut where the audio was cut).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from omnigate.sessions.realtime.config import ResponseSettings
from omnigate.sessions.realtime.conversation import Item, Response
from omnigate.sessions.realtime.responder import HistoryItem, ToolCallAssembler, TurnTiming

CLAUSE_ENDS = frozenset(".!?;:,")


class ResponderPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How a session answers the user with an LLM: the model named in requests (None: the server's own), the
    server's token cap per reply, the conversation's size in the request, and whether user turns are transcribed."""

    model: str | None = None
    max_tokens: int = 1024
    history_max_chars: int = 24_000
    transcription: bool = False
    max_pending_transcriptions: int = 4


@dataclass(eq=False)
class Answer:
    """The LLM side of one response."""

    response: Response
    settings: ResponseSettings
    timing: TurnTiming
    assembler: ToolCallAssembler
    instructions: str
    tools: tuple[object, ...]
    tool_choice: str | dict[str, object]
    temperature: float | None
    calls: dict[str, Item] = field(default_factory=dict)  # by call id
    waiting: bool = False  # the LLM request waits for the transcripts of the user's turns
    chatting: bool = False  # the LLM request is out and its stream not ended
    speaking: bool = False  # reply text went to the TTS
    text: str = ""
    completion_tokens: int | None = None
    cut_by_llm: bool = False  # the LLM stopped at its token limit

    def note_text(self, text: str, now: float) -> None:
        """Reply text arrived: the first clause of it is what the TTS starts speaking with."""
        self.text += text
        if any(char in CLAUSE_ENDS for char in text):
            self.timing.mark("first_segment", now)
            self.timing.mark("tts_sent", now)


def history(items: Iterable[Item]) -> list[HistoryItem]:
    """The conversation as the LLM reads it."""
    out: list[HistoryItem] = []
    for item in items:
        if item.type == "function_call":
            out.append(
                HistoryItem(
                    kind="function_call",
                    call_id=item.call_id,
                    name=item.name,
                    arguments=item.arguments,
                    response_id=item.response_id,
                )
            )
        elif item.type == "function_call_output":
            out.append(HistoryItem(kind="function_call_output", call_id=item.call_id, output=item.output))
        else:
            text = " ".join(
                piece.strip() for part in item.content if (piece := part.text or part.transcript or "").strip()
            )
            out.append(HistoryItem(kind="message", role=item.role, text=text))
    return out
