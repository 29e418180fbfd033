"""The fuzzing harness: drives generated messages through a real server's wire protocols and checks the properties.

Properties, per WebSocket message:
- a message the protocol must refuse gets exactly one typed error (and a valid one at most one);
- a message the transport must refuse (invalid UTF-8 in a text frame, an oversized frame) closes the connection
  with the close code the RFC prescribes, and nothing else;
- every event the server sends is well formed; the server never stops answering (every read has a deadline);
- afterwards the session, or a new one when the connection was closed, still works.
Per HTTP request: a typed status (never 5xx) with a well-formed error body, and a working server afterwards.
Across a run: the server logged no unhandled exception, and no session or engine stream is left behind.

Attribution without timing: after each message the harness sends a *sync* message the protocol answers with exactly
one error that names it, so the events between two sync answers belong to the message between them. Messages are
pipelined (sent without waiting) and a concurrent reader collects the answers.

A protocol plugs in as a :class:`WsTarget` or :class:`HttpTarget` in a small module of ``tests/fuzz/targets``.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, TypeVar

import httpx
import msgspec
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from omnigate.gateway.settings import Settings

READ_LIMIT_S = 30.0

Outcome = Literal["error", "valid", "close"]


class FuzzMessage(msgspec.Struct, frozen=True):
    """One WebSocket message as sent: a text frame (``data`` possibly invalid UTF-8) or a binary frame."""

    data: bytes
    binary: bool = False
    label: str = ""

    @classmethod
    def text(cls, text: str, label: str = "") -> FuzzMessage:
        return cls(text.encode("utf-8"), label=label)

    @classmethod
    def json(cls, value: Any, label: str = "") -> FuzzMessage:
        return cls(msgspec.json.encode(value), label=label)


class Expectation(msgspec.Struct, frozen=True):
    outcome: Outcome
    close_codes: frozenset[int] = frozenset()


ERROR = Expectation("error")
VALID = Expectation("valid")

HttpRequest = tuple[dict[str, str], bytes]
Input = TypeVar("Input", FuzzMessage, HttpRequest)


@dataclass(frozen=True)
class KnownIssue(Generic[Input]):
    """A bug the fuzzer found in a route and nobody fixed yet. Inputs that ``matches`` are kept out of generation,
    so the rest of the protocol stays covered; ``example`` (when the bug reproduces deterministically) runs as a
    strict expected failure, which turns into a failing test the moment the bug is fixed, as a reminder to delete
    the issue."""

    description: str
    example: list[Input] | None
    matches: Callable[[Input], bool]


def nesting_depth_at_least(data: bytes, depth: int) -> bool:
    """Whether JSON text may nest ``depth`` deep (counts openers; never under-estimates)."""
    return data.count(b"[") + data.count(b"{") >= depth


def invalid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def transport_expectation(message: FuzzMessage, settings: Settings) -> Expectation | None:
    """What the WebSocket transport itself does with a frame, before any route sees it (None: it passes)."""
    if len(message.data) > settings.ws_max_message_bytes:
        return Expectation("close", frozenset({1009}))
    if not message.binary:
        try:
            message.data.decode("utf-8")
        except UnicodeDecodeError:
            return Expectation("close", frozenset({1007}))
    return None


class WsTarget(abc.ABC):
    """A WebSocket protocol under test."""

    name: ClassVar[str]
    path: ClassVar[str]

    def available(self, routes: frozenset[str]) -> bool:
        return self.path in routes

    @abc.abstractmethod
    def messages(self) -> st.SearchStrategy[FuzzMessage]:
        """One generated message: valid, mutated or garbage."""

    @abc.abstractmethod
    def expect(self, message: FuzzMessage, settings: Settings) -> Expectation:
        """What the protocol must answer to ``message`` (called after the transport check passes)."""

    @abc.abstractmethod
    def sync(self, n: int) -> FuzzMessage:
        """A message the server answers with exactly one error that names ``n``."""

    @abc.abstractmethod
    def sync_reply(self, event: dict[str, Any]) -> int | None:
        """The ``n`` of a sync answer, else None."""

    @abc.abstractmethod
    def error_code(self, event: dict[str, Any]) -> str | None:
        """The code of an error event (asserting its shape), or None for any other event (asserting its shape)."""

    def regressions(self) -> list[list[FuzzMessage]]:
        """Sequences that once broke the server, run before the generated ones on every run."""
        return []

    def known_issues(self) -> list[KnownIssue[FuzzMessage]]:
        return []

    def placeholder(self) -> FuzzMessage:
        """Sent instead of a generated message that matches a known issue: an event of no known type."""
        return FuzzMessage.json({"type": "fuzz.known_issue"})

    def generated(self) -> st.SearchStrategy[FuzzMessage]:
        """:meth:`messages`, with inputs of known issues replaced by the placeholder (a replacement, not a filter,
        so long lists of messages stay cheap to generate)."""
        issues = self.known_issues()
        placeholder = self.placeholder()
        return self.messages().map(lambda m: placeholder if any(issue.matches(m) for issue in issues) else m)

    @abc.abstractmethod
    async def probe(self, ws: ClientConnection) -> None:
        """Show that the session works: reset whatever state the fuzz left, then a normal exchange."""


class HttpTarget(abc.ABC):
    """An HTTP route under test."""

    name: ClassVar[str]
    path: ClassVar[str]
    method: ClassVar[str] = "POST"

    def available(self, routes: frozenset[str]) -> bool:
        return self.path in routes

    @abc.abstractmethod
    def requests(self) -> st.SearchStrategy[tuple[dict[str, str], bytes]]:
        """Generated headers and body."""

    def regressions(self) -> list[list[HttpRequest]]:
        """Request sequences that once broke the server, run before the generated ones on every run."""
        return []

    def known_issues(self) -> list[KnownIssue[HttpRequest]]:
        return []

    def placeholder(self) -> HttpRequest:
        """Sent instead of a generated request that matches a known issue: an empty JSON object."""
        return {"content-type": "application/json"}, b"{}"

    def generated(self) -> st.SearchStrategy[HttpRequest]:
        """:meth:`requests`, with inputs of known issues replaced by the placeholder."""
        issues = self.known_issues()
        placeholder = self.placeholder()
        return self.requests().map(lambda r: placeholder if any(issue.matches(r) for issue in issues) else r)

    def allowed_statuses(self) -> frozenset[int]:
        return frozenset({200, 201, 400, 404, 413, 415, 422})

    def check(self, response: httpx.Response) -> None:
        """Assert the response is typed: an allowed status, and OpenAI's error shape for errors."""
        assert response.status_code in self.allowed_statuses(), (response.status_code, response.text[:300])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"]
            assert isinstance(error["code"], str | None) and isinstance(error["type"], str)

    async def probe(self, client: httpx.AsyncClient) -> None:  # noqa: B027 - optional
        """A normal request that must succeed (none by default)."""


@dataclass
class Tally:
    """What a run sent and got back."""

    messages: int = 0
    errors: int = 0
    closes: int = 0
    sessions: int = 0
    requests: int = 0
    by_status: dict[int, int] = field(default_factory=dict)

    def add(self, other: Tally) -> None:
        self.messages += other.messages
        self.errors += other.errors
        self.closes += other.closes
        self.sessions += other.sessions
        self.requests += other.requests
        for status, n in other.by_status.items():
            self.by_status[status] = self.by_status.get(status, 0) + n


async def _send(ws: ClientConnection, message: FuzzMessage) -> None:
    await ws.send(message.data, text=not message.binary)


class _Reader:
    """Collects every frame the server sends, and lets the sender wait until a sync has been answered."""

    def __init__(self, ws: ClientConnection, target: WsTarget) -> None:
        self.ws = ws
        self.target = target
        self.frames: list[str | bytes] = []
        self.answered = -1
        self._progress = asyncio.Condition()

    async def read(self, until_sync: int | None) -> int | None:
        """Read until the answer to sync ``until_sync`` (then return None), or until the server closes (then
        return the close code it sent)."""
        try:
            async with asyncio.timeout(READ_LIMIT_S):
                async for frame in self.ws:
                    self.frames.append(frame)
                    reply = self.target.sync_reply(json.loads(frame)) if isinstance(frame, str) else None
                    if reply is not None:
                        async with self._progress:
                            self.answered = reply
                            self._progress.notify_all()
                        if reply == until_sync:
                            return None
        except ConnectionClosed:
            pass
        finally:
            async with self._progress:
                self._progress.notify_all()
        received = self.ws.protocol.close_rcvd
        last = [f if isinstance(f, str) else f"<{len(f)} bytes>" for f in self.frames[-3:]]
        assert until_sync is None, f"the server closed the connection ({received}) with valid messages pending; {last}"
        return received.code if received is not None else None

    async def answered_up_to(self, n: int, reading: asyncio.Task[int | None]) -> None:
        """Until sync ``n`` has been answered (or reading stopped)."""
        async with self._progress:
            await self._progress.wait_for(lambda: self.answered >= n or reading.done())


async def run_ws_case(base_url: str, target: WsTarget, messages: Sequence[FuzzMessage], settings: Settings) -> Tally:
    """One session: the messages, each followed by a sync, pipelined; then the checks, then a probe.

    A message that makes the transport fail the connection is sent only once every earlier message has been
    answered: the WebSocket protocol drops whatever is still queued when it fails a connection.
    """
    tally = Tally(sessions=1)
    expectations: list[Expectation] = []
    for message in messages:
        expectation = transport_expectation(message, settings) or target.expect(message, settings)
        expectations.append(expectation)
        if expectation.outcome == "close":
            break
    closing = bool(expectations) and expectations[-1].outcome == "close"
    syncs = sum(1 for e in expectations if e.outcome != "close")
    async with connect(base_url + target.path, max_size=None, max_queue=None) as ws:
        reader = _Reader(ws, target)
        reading = asyncio.create_task(reader.read(None if closing else syncs - 1)) if closing or syncs else None
        sent_syncs = 0
        try:
            for message, expectation in zip(messages, expectations, strict=False):
                if expectation.outcome == "close" and reading is not None:
                    await reader.answered_up_to(sent_syncs - 1, reading)
                await _send(ws, message)
                tally.messages += 1
                if expectation.outcome != "close":
                    await _send(ws, target.sync(sent_syncs))
                    sent_syncs += 1
        except ConnectionClosed:
            assert reading is not None
        close_code = await reading if reading is not None else None
        if not closing:
            await target.probe(ws)
    events = [json.loads(frame) for frame in reader.frames if isinstance(frame, str)]
    tally.errors += _check_attribution(events, target, expectations)
    if closing:
        tally.closes += 1
        last = [f[:120] if isinstance(f, str) else f"<{len(f)} bytes>" for f in reader.frames[-4:]]
        assert close_code in expectations[-1].close_codes, (close_code, expectations[-1], messages[-1].label, last)
        async with connect(base_url + target.path, max_size=None) as fresh:
            await target.probe(fresh)
    return tally


def _check_attribution(events: list[dict[str, Any]], target: WsTarget, expectations: list[Expectation]) -> int:
    """Split the events at the sync answers and check each message's errors; returns the errors counted."""
    per_message: list[int] = [0]
    next_sync = 0
    for event in events:
        reply = target.sync_reply(event)
        if reply is not None:
            assert reply == next_sync, f"sync {reply} answered out of order (expected {next_sync})"
            next_sync += 1
            per_message.append(0)
            continue
        if target.error_code(event) is not None:
            per_message[-1] += 1
    open_expectations = [e for e in expectations if e.outcome != "close"]
    assert next_sync == len(open_expectations), f"{next_sync} of {len(open_expectations)} syncs answered"
    if expectations and expectations[-1].outcome == "close":
        assert per_message[-1] == 0, "a message the transport refuses got an error event besides its close"
    total = 0
    for expectation, count in zip(open_expectations, per_message, strict=False):
        if expectation.outcome == "error":
            assert count == 1, f"a refused message got {count} errors"
        else:
            assert count <= 1, f"a valid message got {count} errors"
        total += count
    return total


async def run_http_case(
    client: httpx.AsyncClient, target: HttpTarget, requests: Sequence[tuple[dict[str, str], bytes]]
) -> Tally:
    tally = Tally()
    for headers, body in requests:
        response = await client.request(target.method, target.path, headers=headers, content=body)
        tally.requests += 1
        tally.by_status[response.status_code] = tally.by_status.get(response.status_code, 0) + 1
        target.check(response)
    await target.probe(client)
    return tally


class ServerErrors(logging.Handler):
    """Collects unhandled-exception records of the server (uvicorn's and the gateway's own errors)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Invalid UTF-8 sequence"):
            return  # a client fault uvicorn logs as an error; the test checks its 1007 close instead
        self.records.append(record)

    def describe(self) -> str:
        return "\n".join(f"{r.name}: {r.getMessage()}" for r in self.records[:5])
