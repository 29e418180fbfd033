"""What a realtime session's responder asks the LLM and makes of its answer (sans-I/O: plain data in, plain data out).

- :func:`chat_request` is the whole LLM request of a response, from the parts below.
- :func:`chat_messages` turns the session's instructions and conversation (:class:`HistoryItem`, one per item, in
  order) into chat-completions messages, trimmed oldest-first to a character budget.
- :func:`chat_tools` and :func:`chat_tool_choice` turn the Realtime tool shape into the chat-completions one.
- :class:`ToolCallAssembler` gathers streamed tool-call pieces into complete calls.
- :class:`TurnTiming` records when a turn's steps happened and what omnigate itself added.

The session builds a :class:`HistoryItem` from each of its items:

- a ``message`` item: ``role`` and ``text``; a user item's text is its ``input_text`` parts and its audio's
  transcript; an assistant item's text is its ``output_text`` or its audio's transcript, as truncated by
  ``conversation.item.truncate`` or a barge-in (what the user heard is what the model is told it said);
- a ``function_call`` item: ``call_id``, ``name``, ``arguments`` (and the ``response_id`` of the response that
  made it, so that the calls of one response become one assistant message with several tool calls);
- a ``function_call_output`` item: ``call_id`` and ``output``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from omnigate.engines.openai_compat.messages import (
    ChatMessage,
    ChatRequest,
    ChatTool,
    FunctionCall,
    FunctionSpec,
    ToolCall,
    ToolCallDelta,
)

ItemKind = Literal["message", "function_call", "function_call_output"]
MessageRole = Literal["user", "assistant", "system"]


class ResponderInputError(ValueError):
    """A session value the LLM request cannot carry (a tool that is not a function, a bad tool_choice)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class HistoryItem(msgspec.Struct, frozen=True, kw_only=True):
    """One conversation item as the LLM sees it (see the module docstring for how items map)."""

    kind: ItemKind = "message"
    role: MessageRole = "user"
    text: str = ""
    response_id: str | None = None
    call_id: str = ""
    name: str = ""
    arguments: str = ""
    output: str = ""


def _units(history: Iterable[HistoryItem]) -> list[list[ChatMessage]]:
    """The conversation as chat messages grouped into units trimming drops whole: a message, or an assistant
    message calling tools together with the tool messages that follow and answer it. A call nobody answered and
    an output of no call before it are left out: chat servers refuse a tool call without its answer and the
    reverse."""
    units: list[list[ChatMessage]] = []
    calls: list[ToolCall] = []
    calls_response: str | None = None
    outputs: list[ChatMessage] = []

    def close_calls() -> None:
        nonlocal calls, outputs
        answered = {output.tool_call_id for output in outputs}
        kept = [call for call in calls if call.id in answered]
        if kept:
            units.append([ChatMessage("assistant", None, tool_calls=kept), *outputs])
        calls, outputs = [], []

    for item in history:
        if item.kind == "function_call":
            if calls and (outputs or item.response_id is None or item.response_id != calls_response):
                close_calls()
            calls.append(ToolCall(item.call_id, FunctionCall(item.name, item.arguments or "{}")))
            calls_response = item.response_id
        elif item.kind == "function_call_output":
            pending = {call.id for call in calls} - {output.tool_call_id for output in outputs}
            if item.call_id in pending:
                outputs.append(ChatMessage("tool", item.output, tool_call_id=item.call_id))
        else:
            close_calls()
            if item.text.strip():
                units.append([ChatMessage(item.role, item.text)])
    close_calls()
    return units


def _size(message: ChatMessage) -> int:
    size = len(message.content or "")
    if not isinstance(message.tool_calls, msgspec.UnsetType):
        size += sum(len(call.function.name) + len(call.function.arguments) for call in message.tool_calls)
    return size


def chat_messages(instructions: str, history: Iterable[HistoryItem], *, max_chars: int) -> list[ChatMessage]:
    """The request's messages: the instructions as the system message, then the conversation, its oldest units
    dropped until the whole fits ``max_chars``. The instructions and everything from the newest user message on
    are always kept, whatever their size."""
    units = _units(history)
    newest_user = max((i for i, unit in enumerate(units) if unit[0].role == "user"), default=len(units))
    kept_tail = units[newest_user:]
    older = units[:newest_user]
    budget = max_chars - len(instructions) - sum(_size(m) for unit in kept_tail for m in unit)
    sizes = [sum(_size(m) for m in unit) for unit in older]
    total = sum(sizes)
    start = 0
    while start < len(older) and total > budget:
        total -= sizes[start]
        start += 1
    system = [ChatMessage("system", instructions)] if instructions.strip() else []
    return system + [m for unit in older[start:] + kept_tail for m in unit]


def chat_tools(tools: Sequence[Any]) -> list[ChatTool]:
    """Realtime tools (``{"type": "function", "name", "description", "parameters"}``) in chat-completions shape."""
    out: list[ChatTool] = []
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ResponderInputError("only function tools can be passed to the LLM", param)
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ResponderInputError("a function tool needs a name", f"{param}.name")
        description = tool.get("description")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ResponderInputError("a tool's parameters are a JSON schema object", f"{param}.parameters")
        out.append(
            ChatTool(
                FunctionSpec(
                    name,
                    description if isinstance(description, str) else msgspec.UNSET,
                    dict(parameters) if parameters is not None else msgspec.UNSET,
                )
            )
        )
    return out


def chat_tool_choice(choice: str | Mapping[str, Any]) -> str | dict[str, Any]:
    """A Realtime ``tool_choice`` (``auto``, ``none``, ``required`` or ``{"type": "function", "name"}``)."""
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ResponderInputError(f"tool_choice {choice!r} is not auto, none or required", "tool_choice")
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise ResponderInputError("tool_choice names a function: {type: function, name}", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def chat_request(
    *,
    instructions: str,
    history: Iterable[HistoryItem],
    max_chars: int,
    max_tokens: int,
    model: str | None = None,
    tools: Sequence[Any] = (),
    tool_choice: str | Mapping[str, Any] = "auto",
    max_output_tokens: int | None = None,
    temperature: float | None = None,
) -> ChatRequest:
    """The LLM request of one response: the session's (or the response's) instructions, tools and token cap
    (``max_output_tokens``, None for ``inf``) under the server's ``max_tokens``. Raises ResponderInputError."""
    chat = chat_tools(tools)
    return ChatRequest(
        messages=chat_messages(instructions, history, max_chars=max_chars),
        model=model if model is not None else msgspec.UNSET,
        tools=chat if chat else msgspec.UNSET,
        tool_choice=chat_tool_choice(tool_choice) if chat else msgspec.UNSET,
        max_tokens=min(max_tokens, max_output_tokens) if max_output_tokens is not None else max_tokens,
        temperature=temperature if temperature is not None else msgspec.UNSET,
    )


class ToolCallError(ValueError):
    """The LLM's streamed tool calls do not add up to complete calls."""


@dataclass
class _PendingCall:
    id: str | None = None
    name: str = ""
    arguments: str = ""


class ToolCallAssembler:
    """Streamed tool-call pieces, by index, into complete calls. A call the server gave no id gets one from
    ``new_call_id`` (the Realtime protocol needs a ``call_id`` for the client's answer)."""

    def __init__(self, new_call_id: Callable[[], str], max_argument_chars: int = 64 * 1024) -> None:
        self._new_call_id = new_call_id
        self.max_argument_chars = max_argument_chars
        self._calls: dict[int, _PendingCall] = {}

    def __bool__(self) -> bool:
        return bool(self._calls)

    def add(self, delta: ToolCallDelta) -> str:
        """Take one piece; returns the call id it belongs to (for ``response.function_call_arguments.delta``)."""
        call = self._calls.setdefault(delta.index, _PendingCall())
        if delta.id and call.id is None:
            call.id = delta.id
        if call.id is None:
            call.id = self._new_call_id()
        if delta.name and delta.name != call.name:
            # Most servers send the name once; some repeat it on every piece, a few split it.
            call.name += delta.name
        call.arguments += delta.arguments
        if len(call.arguments) > self.max_argument_chars:
            raise ToolCallError(f"tool call arguments longer than {self.max_argument_chars} characters")
        return call.id

    def complete(self) -> list[ToolCall]:
        """The calls in index order. Raises ToolCallError for a call with no name or arguments that are not JSON."""
        out: list[ToolCall] = []
        for index in sorted(self._calls):
            call = self._calls[index]
            if not call.name or call.id is None:
                raise ToolCallError(f"tool call {index} has no function name")
            arguments = call.arguments or "{}"
            try:
                json.loads(arguments)
            except ValueError as exc:
                raise ToolCallError(f"tool call {call.name!r} has arguments that are not JSON: {exc}") from exc
            out.append(ToolCall(call.id, FunctionCall(call.name, arguments)))
        return out


class TurnTimings(msgspec.Struct, frozen=True, omit_defaults=True):
    """A turn's latencies in milliseconds, from the end of the user's speech (or, for a turn without audio, from
    the response's start). None where a step did not happen.

    - ``transcript_ms``: when the transcript was done; ``asr_ms`` of it the transcription service's own time;
    - ``first_token_ms``: the LLM's first token; ``llm_ms``: the LLM's own time from the request to the text of
      the first spoken segment (the first token when that token ends a clause);
    - ``first_audio_ms``: the first reply audio byte handed to the transport (voice to voice); ``tts_ms`` of it
      the TTS engine's own time from the segment to its first audio;
    - ``overhead_ms``: what omnigate added: ``first_audio_ms - asr_ms - llm_ms - tts_ms``.
    """

    transcript_ms: float | None = None
    asr_ms: float | None = None
    first_token_ms: float | None = None
    llm_ms: float | None = None
    first_audio_ms: float | None = None
    tts_ms: float | None = None
    overhead_ms: float | None = None

    def metadata(self) -> dict[str, str]:
        """As ``response.metadata`` values (strings), keys prefixed ``omnigate_``."""
        return {
            f"omnigate_{name}": f"{value:.1f}"
            for name, value in msgspec.structs.asdict(self).items()
            if value is not None
        }


class TurnTiming:
    """When a turn's steps happened, on one monotonic clock in seconds (the session's). Each mark keeps its first
    time: a second call changes nothing, so the session may mark at every delta without bookkeeping."""

    def __init__(self, start: float) -> None:
        self.start = start  # the end of the user's speech, or the response's start
        self.asr_sent: float | None = None
        self.transcript_done: float | None = None
        self.llm_sent: float | None = None
        self.first_token: float | None = None
        self.first_segment: float | None = None  # the text of the first spoken segment had arrived
        self.tts_sent: float | None = None  # that segment went to the TTS engine
        self.tts_first_audio: float | None = None  # the engine's first audio of the reply
        self.first_audio_out: float | None = None  # the first reply audio byte went to the transport

    def mark(self, step: str, at: float) -> None:
        """Set ``step`` (an attribute above: ``"first_token"``, ...) to ``at`` unless it is set already."""
        if step not in _STEPS:
            raise ValueError(f"no turn step {step!r}")
        if getattr(self, step) is None:
            setattr(self, step, at)

    def timings(self) -> TurnTimings:
        def since_start(at: float | None) -> float | None:
            return None if at is None else (at - self.start) * 1000.0

        def between(begin: float | None, end: float | None) -> float | None:
            return None if begin is None or end is None else (end - begin) * 1000.0

        asr = between(self.asr_sent, self.transcript_done)
        llm = between(self.llm_sent, self.first_segment if self.first_segment is not None else self.first_token)
        tts = between(self.tts_sent, self.tts_first_audio)
        voice_to_voice = since_start(self.first_audio_out)
        overhead = None
        if voice_to_voice is not None and llm is not None and tts is not None:
            overhead = voice_to_voice - (asr or 0.0) - llm - tts
        return TurnTimings(
            transcript_ms=since_start(self.transcript_done),
            asr_ms=asr,
            first_token_ms=since_start(self.first_token),
            llm_ms=llm,
            first_audio_ms=voice_to_voice,
            tts_ms=tts,
            overhead_ms=overhead,
        )


_STEPS = frozenset(
    {
        "asr_sent",
        "transcript_done",
        "llm_sent",
        "first_token",
        "first_segment",
        "tts_sent",
        "tts_first_audio",
        "first_audio_out",
    }
)
