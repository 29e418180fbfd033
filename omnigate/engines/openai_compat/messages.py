"""What goes to and comes from an OpenAI-compatible chat server: request messages, tools and streamed deltas.

The request side is the chat-completions JSON shape (``msgspec.UNSET`` fields are left out). The streamed side is
what :class:`omnigate.engines.openai_compat.chat.ChatClient` yields: :class:`TextDelta`, :class:`ToolCallDelta`
and, last, one :class:`ChatFinish`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

ChatRole = Literal["system", "user", "assistant", "tool"]


class FunctionCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(msgspec.Struct, frozen=True):
    """A complete tool call of an assistant message."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    """One chat message: ``content`` is None only on an assistant message that only calls tools."""

    role: ChatRole
    content: str | None
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET
    tool_call_id: str | msgspec.UnsetType = msgspec.UNSET  # on a ``tool`` message: the call it answers


class FunctionSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    description: str | msgspec.UnsetType = msgspec.UNSET
    parameters: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class ChatTool(msgspec.Struct, frozen=True):
    function: FunctionSpec
    type: Literal["function"] = "function"


class ChatRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """The body of a streamed chat completion (``stream`` and ``stream_options`` are added by the client)."""

    messages: list[ChatMessage]
    model: str | msgspec.UnsetType = msgspec.UNSET  # unset: the server's default model (vLLM, llama.cpp)
    tools: list[ChatTool] | msgspec.UnsetType = msgspec.UNSET
    # "auto", "none", "required" or {"type": "function", "function": {"name": ...}}
    tool_choice: str | dict[str, Any] | msgspec.UnsetType = msgspec.UNSET
    max_tokens: int | msgspec.UnsetType = msgspec.UNSET
    temperature: float | msgspec.UnsetType = msgspec.UNSET
    top_p: float | msgspec.UnsetType = msgspec.UNSET


class TextDelta(msgspec.Struct, frozen=True):
    """A piece of the assistant's reply text."""

    text: str


class ToolCallDelta(msgspec.Struct, frozen=True):
    """A piece of a tool call: the first piece of call ``index`` carries its ``id`` and ``name``, the rest more of
    its ``arguments`` (servers differ in how they split it, so every field may come in any piece)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatFinish(msgspec.Struct, frozen=True):
    """The end of the stream: why the model stopped (``stop``, ``length``, ``tool_calls`` ...; None if the server
    did not say) and the token usage when the server reports it."""

    finish_reason: str | None
    usage: Usage | None = None


ChatDelta = TextDelta | ToolCallDelta | ChatFinish
