"""A streamed chat completion: ``POST {base}/chat/completions`` with ``stream: true``, read as typed deltas.

Usage::

    async with chat.stream(request) as deltas:
        async for delta in deltas:  # TextDelta | ToolCallDelta, then one ChatFinish
            ...

Leaving the ``async with`` (a barge-in cancelling the task, an error, a break) closes the HTTP response at once,
so the server sees the disconnect and stops generating.

The deltas of one network read are coalesced (:func:`coalesce`): a server that writes thousands of tiny chunks at
once costs the reader a few deltas, not thousands; nothing waits for more to arrive, so no delta comes later.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from types import TracebackType

import httpx
import msgspec

from omnigate.engines.openai_compat.errors import ServiceError
from omnigate.engines.openai_compat.http_calls import (
    Deadline,
    ServiceTimeouts,
    bearer,
    endpoint,
    next_chunk,
    raise_for_status,
    send,
)
from omnigate.engines.openai_compat.messages import (
    ChatDelta,
    ChatFinish,
    ChatRequest,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from omnigate.engines.openai_compat.sse import SseError, SseParser

DONE = "[DONE]"


class _FunctionPiece(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolCallPiece(msgspec.Struct):
    index: int = 0
    id: str | None = None
    function: _FunctionPiece | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolCallPiece] | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: Usage | None = None
    error: dict[str, object] | str | None = None  # vLLM reports a failure mid-stream this way


_CHUNK = msgspec.json.Decoder(_Chunk)
_ENCODER = msgspec.json.Encoder()


class ChatStream:
    """One streamed completion; an async context manager whose value iterates the deltas."""

    def __init__(self, deltas: AsyncGenerator[ChatDelta, None]) -> None:
        self._deltas = deltas

    async def __aenter__(self) -> AsyncIterator[ChatDelta]:
        return self._deltas

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self._deltas.aclose()


class ChatClient:
    """Streamed chat completions from one OpenAI-compatible server (``base_url`` ends in ``/v1`` usually)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        base_url: str,
        *,
        api_key: str | None = None,
        timeouts: ServiceTimeouts | None = None,
        max_response_bytes: int = 8 * 1024 * 1024,
        include_usage: bool = True,
    ) -> None:
        self._http = http
        self.url = endpoint(base_url, "/chat/completions")
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **bearer(api_key)}
        self.timeouts = timeouts or ServiceTimeouts()
        self.max_response_bytes = max_response_bytes
        self.include_usage = include_usage

    def stream(self, request: ChatRequest) -> ChatStream:
        """Start nothing yet: the request goes out when the deltas are first read."""
        body = msgspec.to_builtins(request)
        body["stream"] = True
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        return ChatStream(self._deltas(_ENCODER.encode(body)))

    async def _deltas(self, body: bytes) -> AsyncGenerator[ChatDelta, None]:
        t = self.timeouts
        deadline = Deadline("llm", t.total_s)
        request = self._http.build_request("POST", self.url, content=body, headers=self._headers)
        response = await send(self._http, request, deadline, t.first_byte_s, "the first token")
        try:
            await raise_for_status(response, deadline, t.idle_s)
            parser = SseParser()
            chunks = response.aiter_bytes()
            received = 0
            first = True  # until the first token or tool call, the first-token limit applies
            finish_reason: str | None = None
            usage: Usage | None = None
            events = 0
            while True:
                if first:  # the first-token limit runs from the request: what is left of it
                    wait_s, limit_s, what = t.first_byte_s - deadline.elapsed(), t.first_byte_s, "the first token"
                else:
                    wait_s, limit_s, what = t.idle_s, t.idle_s, "the next chunk"
                chunk = await next_chunk(chunks, deadline, max(wait_s, 0.0), what, limit_s)
                if chunk is not None:
                    received += len(chunk)
                    if received > self.max_response_bytes:
                        raise ServiceError(
                            "llm", "bad_response", f"a reply longer than {self.max_response_bytes} bytes"
                        )
                payloads = _events(parser, chunk)
                events += len(payloads)
                read: list[TextDelta | ToolCallDelta] = []
                done = False
                for payload in payloads:
                    if payload == DONE:
                        done = True
                        break
                    decoded = _decode(payload)
                    usage = decoded.usage or usage
                    for delta, reason in _deltas_of(decoded):
                        if delta is not None:
                            first = False
                            read.append(delta)
                        finish_reason = reason or finish_reason
                for delta in coalesce(read):
                    yield delta
                if done:
                    yield ChatFinish(finish_reason, usage)
                    return
                if chunk is None:
                    if events == 0:
                        kind = response.headers.get("content-type", "none")
                        raise ServiceError(
                            "llm", "bad_response", f"the reply holds no server-sent events (Content-Type: {kind})"
                        )
                    if finish_reason is None:
                        raise ServiceError("llm", "bad_response", "the stream ended before the reply finished")
                    # Some servers omit [DONE]; a finished choice is end enough.
                    yield ChatFinish(finish_reason, usage)
                    return
        finally:
            await response.aclose()


def coalesce(deltas: list[TextDelta | ToolCallDelta]) -> list[TextDelta | ToolCallDelta]:
    """``deltas`` with each run of adjacent pieces merged: text into one text delta, and the argument pieces that
    continue one tool call (no id, no name) into the piece before them. The stream's content is unchanged; only
    its split into deltas is, which the protocol leaves to the server."""
    out: list[TextDelta | ToolCallDelta] = []
    run: list[str] = []  # the text or arguments of out[-1] still to be joined

    def close_run() -> None:
        if len(run) > 1:
            last = out[-1]
            joined = "".join(run)
            out[-1] = (
                TextDelta(joined) if isinstance(last, TextDelta) else msgspec.structs.replace(last, arguments=joined)
            )
        run.clear()

    for delta in deltas:
        last = out[-1] if out else None
        if isinstance(delta, TextDelta) and isinstance(last, TextDelta):
            run.append(delta.text)
        elif (
            isinstance(delta, ToolCallDelta)
            and isinstance(last, ToolCallDelta)
            and delta.index == last.index
            and delta.id is None
            and not delta.name
        ):
            run.append(delta.arguments)
        else:
            close_run()
            out.append(delta)
            run.append(delta.text if isinstance(delta, TextDelta) else delta.arguments)
    close_run()
    return out


def _events(parser: SseParser, chunk: bytes | None) -> list[str]:
    """The event payloads ``chunk`` completes (None: the end of the body)."""
    try:
        return parser.close() if chunk is None else parser.feed(chunk)
    except SseError as exc:
        raise ServiceError("llm", "bad_response", f"the reply is not server-sent events: {exc}") from exc


def _decode(payload: str) -> _Chunk:
    try:
        chunk = _CHUNK.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ServiceError("llm", "bad_response", f"a stream chunk that is not a chat completion chunk: {exc}") from exc
    if chunk.error is not None:
        message = chunk.error.get("message") if isinstance(chunk.error, dict) else chunk.error
        raise ServiceError("llm", "error", f"the server failed mid-reply: {message}")
    return chunk


def _deltas_of(chunk: _Chunk) -> list[tuple[TextDelta | ToolCallDelta | None, str | None]]:
    """The deltas of the first choice (one completion is asked for) with its finish reason."""
    out: list[tuple[TextDelta | ToolCallDelta | None, str | None]] = []
    for choice in chunk.choices:
        if choice.index != 0:
            continue
        delta = choice.delta
        if delta is not None and delta.content:
            out.append((TextDelta(delta.content), None))
        if delta is not None and delta.tool_calls:
            for piece in delta.tool_calls:
                function = piece.function or _FunctionPiece()
                out.append((ToolCallDelta(piece.index, piece.id, function.name, function.arguments or ""), None))
        if choice.finish_reason is not None:
            out.append((None, choice.finish_reason))
    return out
