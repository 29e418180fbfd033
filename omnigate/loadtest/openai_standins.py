"""Small OpenAI-compatible stand-ins for an LLM and a speech recognizer, served over real HTTP.

``POST /v1/chat/completions`` streams server-sent events (``stream: true``) or answers one JSON completion, after a
configurable delay to the first token and at a configurable token rate. Replies come from a script, in order, then
from a default: a tool call when the request offers a tool whose name the user's last message mentions ("what is
the weather", tool ``get_weather``), a sentence about the tool's output after a ``tool`` message, and otherwise a
reply that repeats what the user said. ``POST /v1/audio/transcriptions`` takes a WAV upload, waits the configured
delay and answers scripted transcripts in order, then a default; it records the audio's duration.

Failure modes, per service and switchable while serving (``POST /_standin/mode {"llm": "hang"}``):
``error`` (HTTP 500 with an OpenAI error body), ``garbage`` (HTTP 200 with an HTML page), ``hang`` (no answer until
the client gives up), ``drop`` (the connection closes mid-body); for the LLM also ``burst`` (the whole reply, one
small chunk per token or per few argument characters, in a single write: a client reads thousands of events at
once) and ``flood`` (an endless reply, ``flood_bytes`` of it, in large writes, for as long as the client reads it).
``POST /_standin/config`` changes delays and
scripts, ``GET /_standin/stats`` reports what the stand-ins saw (requests, the clients' disconnects, audio seconds,
the last chat request), and ``POST /_standin/wait {"llm_disconnects": 1}`` answers once the counts reach the
given values. Run one with ``omnigate-loadtest standins --port 8090``, or in a test with :class:`StandinServer`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import re
import socket
import sys
import time
import wave
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

Mode = Literal["ok", "error", "garbage", "hang", "drop", "burst", "flood"]
MODES: tuple[Mode, ...] = ("ok", "error", "garbage", "hang", "drop", "burst", "flood")
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_BODY_BYTES = 32 * 1024 * 1024
_TOKEN = re.compile(r"\s*\S+")
_GARBAGE = b"<html><body><h1>502 Bad Gateway</h1></body></html>\n"
_FLOOD_SENTENCE = "This reply never ends, and every clause of it can be spoken. "
_FLOOD_WRITE_BYTES = 64 * 1024


class ScriptedToolCall(msgspec.Struct, frozen=True):
    name: str
    arguments: dict[str, Any] = {}


class ScriptedReply(msgspec.Struct, frozen=True):
    """One reply of the LLM stand-in: text, or a tool call (then ``text`` is ignored)."""

    text: str = ""
    tool_call: ScriptedToolCall | None = None


class StandinConfig(msgspec.Struct, kw_only=True):
    """How the stand-ins answer; every field can be changed while serving."""

    llm_first_token_ms: float = 0.0  # from the request to the first token
    llm_tokens_per_s: float = 0.0  # 0: every token at once
    asr_delay_ms: float = 0.0  # from the upload to the transcript
    replies: list[ScriptedReply] = []  # consumed in order, then the default reply
    transcripts: list[str] = []  # consumed in order, then default_transcript
    default_transcript: str = "Hello, can you hear me?"
    default_reply: str | None = None  # the reply once the script is spent (None: the generated default reply)
    llm_mode: Mode = "ok"
    asr_mode: Mode = "ok"
    drop_after_tokens: int = 3  # ``drop``: tokens sent before the connection closes
    argument_piece_chars: int = 8  # a tool call's arguments are streamed in pieces of this many characters
    flood_bytes: int = 64 * 1024 * 1024  # ``flood``: the size of the endless reply's body before it does end


class StandinStats(msgspec.Struct, kw_only=True):
    llm_requests: int = 0
    llm_completed: int = 0  # streams sent to their end
    llm_disconnects: int = 0  # requests whose client went away before the end
    asr_requests: int = 0
    asr_completed: int = 0
    asr_disconnects: int = 0
    asr_audio_s: list[float] = []  # the duration of every WAV received
    # the stand-ins' own time per request, ms: transcription (request read to response sent) and chat (request
    # read to the first token or tool call sent)
    asr_service_ms: list[float] = []
    llm_first_token_service_ms: list[float] = []
    last_chat_request: dict[str, Any] | None = None
    last_authorization: str | None = None  # the Authorization header of the last request


def default_reply(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> ScriptedReply:
    """The reply when the script is empty: see the module docstring."""
    last = messages[-1] if messages else {}
    if last.get("role") == "tool":
        return ScriptedReply(text=f"The tool answered: {str(last.get('content', ''))[:200]}. Anything else?")
    user = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")
    spoken = user.lower()
    for tool in tools:
        name = str(tool.get("function", {}).get("name", ""))
        words = [word for word in name.lower().split("_") if word not in ("get", "set", "do")]
        if name and words and all(word in spoken for word in words):
            return ScriptedReply(tool_call=ScriptedToolCall(name=name, arguments={"request": user}))
    said = user.strip().rstrip(".?!") or "nothing"
    return ScriptedReply(
        text=f"You said: {said}. That is a good question, and I am glad you asked it. Let me tell you what I think."
    )


class StandinState:
    """Config, the scripts' positions and the stats, shared by the routes."""

    def __init__(self, config: StandinConfig) -> None:
        self.config = config
        self.stats = StandinStats()
        self.changed = asyncio.Condition()
        self.stopping = asyncio.Event()  # hanging requests end when the server stops
        self._calls = 0

    async def count(self, **increments: int) -> None:
        for name, value in increments.items():
            setattr(self.stats, name, getattr(self.stats, name) + value)
        async with self.changed:
            self.changed.notify_all()

    async def wait_for(self, targets: dict[str, int], timeout_s: float) -> bool:
        """Until every ``stats`` count named in ``targets`` reaches its value; False on timeout."""

        def reached() -> bool:
            return all(getattr(self.stats, name) >= value for name, value in targets.items())

        try:
            async with asyncio.timeout(timeout_s), self.changed:
                await self.changed.wait_for(reached)
        except TimeoutError:
            return False
        return True

    def next_reply(self, body: dict[str, Any]) -> ScriptedReply:
        if self.config.replies:
            return self.config.replies.pop(0)
        if self.config.default_reply is not None:
            return ScriptedReply(text=self.config.default_reply)
        return default_reply(body.get("messages") or [], body.get("tools") or [])

    def next_transcript(self) -> str:
        if self.config.transcripts:
            return self.config.transcripts.pop(0)
        return self.config.default_transcript

    def call_id(self) -> str:
        self._calls += 1
        return f"call_standin{self._calls:05d}"


async def _read_body(receive: Receive) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client went away")
        body += message.get("body", b"")
        if len(body) > MAX_BODY_BYTES:
            raise ValueError("request body too large")
        if not message.get("more_body", False):
            return bytes(body)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _start(send: Send, status: int, content_type: bytes, length: int | None = None) -> None:
    headers = [(b"content-type", content_type)]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def _json(send: Send, status: int, value: object) -> None:
    body = msgspec.json.encode(value)
    await _start(send, status, b"application/json", len(body))
    await send({"type": "http.response.body", "body": body})


def _error_body(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": "standin_failure"}}


class _Service:
    """A raw ASGI endpoint (to control the wire: abrupt closes, streaming) that notices a client going away."""

    prefix: str

    def __init__(self, state: StandinState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await _read_body(receive)
        except (ConnectionError, ValueError):
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization")
        self.state.stats.last_authorization = auth.decode() if auth is not None else None
        await self.state.count(**{f"{self.prefix}_requests": 1})
        answer = asyncio.create_task(self.answer(scope, body, send))
        gone = asyncio.create_task(_until_disconnect(receive))
        stopping = asyncio.create_task(self.state.stopping.wait())
        done, _ = await asyncio.wait({answer, gone, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for task in (answer, gone, stopping):
            task.cancel()
        await asyncio.gather(answer, gone, stopping, return_exceptions=True)
        if answer in done and answer.exception() is None and answer.result():
            await self.state.count(**{f"{self.prefix}_completed": 1})
        elif gone in done:
            await self.state.count(**{f"{self.prefix}_disconnects": 1})

    async def answer(self, scope: Scope, body: bytes, send: Send) -> bool:
        """Answer the request; True when the response was sent whole."""
        raise NotImplementedError

    async def fail(self, mode: Mode, send: Send) -> bool:
        """Answer as ``mode`` says when it is a failure (True), or do nothing (False)."""
        if mode == "error":
            await _json(send, 500, _error_body(f"the {self.prefix} stand-in is failing on purpose"))
        elif mode == "garbage":
            await _start(send, 200, b"text/html", len(_GARBAGE))
            await send({"type": "http.response.body", "body": _GARBAGE})
        elif mode == "hang":
            await asyncio.Event().wait()  # until the client goes away or the server stops
        else:
            return False
        return True


class ChatCompletions(_Service):
    prefix = "llm"

    async def answer(self, scope: Scope, raw: bytes, send: Send) -> bool:
        started = time.monotonic()
        config = self.state.config
        try:
            body = json.loads(raw)
            assert isinstance(body, dict) and isinstance(body.get("messages"), list)
        except (ValueError, AssertionError):
            await _json(send, 400, _error_body("expected a JSON body with messages"))
            return True
        self.state.stats.last_chat_request = body
        if await self.fail(config.llm_mode, send):
            return True
        reply = self.state.next_reply(body)
        stream = bool(body.get("stream"))
        usage_asked = bool((body.get("stream_options") or {}).get("include_usage"))
        model = str(body.get("model") or "standin-llm")
        pieces = self._pieces(reply)
        if stream:
            await _start(send, 200, b"text/event-stream")  # the headers at once, as inference servers send them
        if config.llm_first_token_ms > 0:
            await asyncio.sleep(config.llm_first_token_ms / 1000.0)
        if not stream:
            await self._whole(send, model, reply, pieces, body)
            return True
        if config.llm_mode == "flood":
            await self._flood(send, model, started, config.flood_bytes)
            return True
        paced = pieces
        if config.llm_mode == "burst":
            burst = b"".join(_sse(self._chunk(model, started, delta, None)) for delta in pieces)
            await send({"type": "http.response.body", "body": burst, "more_body": True})
            paced = []
        interval = 1.0 / config.llm_tokens_per_s if config.llm_tokens_per_s > 0 else 0.0
        first_at = time.monotonic()
        for index, delta in enumerate(paced):
            if config.llm_mode == "drop" and index == config.drop_after_tokens:
                return False  # the response is left incomplete: the server closes the connection mid-body
            due = first_at + index * interval
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            await self._event(send, self._chunk(model, started, delta, None))
            if index == 0:
                self.state.stats.llm_first_token_service_ms.append(round((time.monotonic() - started) * 1000.0, 2))
        finish = "tool_calls" if reply.tool_call is not None else "stop"
        await self._event(send, self._chunk(model, started, {}, finish))
        if usage_asked:
            usage = _usage(body, len(pieces))
            await self._event(
                send, {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "choices": [], "usage": usage}
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        return True

    def _pieces(self, reply: ScriptedReply) -> list[dict[str, Any]]:
        """The deltas of a reply: its text token by token, or a tool call's head then its arguments in pieces."""
        if reply.tool_call is None:
            tokens = _TOKEN.findall(reply.text)
            return [
                {"role": "assistant", "content": token} if i == 0 else {"content": token}
                for i, token in enumerate(tokens)
            ]
        call = reply.tool_call
        arguments = json.dumps(call.arguments)
        head = {
            "index": 0,
            "id": self.state.call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        pieces: list[dict[str, Any]] = [{"role": "assistant", "content": None, "tool_calls": [head]}]
        step = max(1, self.state.config.argument_piece_chars)
        for start in range(0, len(arguments), step):
            pieces.append({"tool_calls": [{"index": 0, "function": {"arguments": arguments[start : start + step]}}]})
        return pieces

    async def _flood(self, send: Send, model: str, started: float, total_bytes: int) -> None:
        """An endless reply in large writes (each many small chunks); it ends after ``total_bytes``."""
        tokens = _TOKEN.findall(_FLOOD_SENTENCE)
        write = b"".join(_sse(self._chunk(model, started, {"content": token}, None)) for token in tokens)
        write *= max(1, _FLOOD_WRITE_BYTES // len(write))
        sent = 0
        while sent < total_bytes:
            await send({"type": "http.response.body", "body": write, "more_body": True})
            sent += len(write)
            # A send to a client that went away returns at once: let the disconnect be seen.
            await asyncio.sleep(0)
        await self._event(send, self._chunk(model, started, {}, "length"))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    @staticmethod
    def _chunk(model: str, started: float, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {
            "id": "chatcmpl-standin",
            "object": "chat.completion.chunk",
            "created": int(started),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    @staticmethod
    async def _event(send: Send, value: object) -> None:
        await send({"type": "http.response.body", "body": _sse(value), "more_body": True})

    async def _whole(
        self, send: Send, model: str, reply: ScriptedReply, pieces: list[dict[str, Any]], body: dict[str, Any]
    ) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
        if reply.tool_call is not None:
            call = pieces[0]["tool_calls"][0]
            call["function"]["arguments"] = json.dumps(reply.tool_call.arguments)
            message["tool_calls"] = [call]
        finish = "tool_calls" if reply.tool_call is not None else "stop"
        await _json(
            send,
            200,
            {
                "id": "chatcmpl-standin",
                "object": "chat.completion",
                "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": _usage(body, len(pieces)),
            },
        )


def _sse(value: object) -> bytes:
    return b"data: " + msgspec.json.encode(value) + b"\n\n"


def _usage(body: dict[str, Any], completion_tokens: int) -> dict[str, int]:
    prompt = sum(len(str(m.get("content") or "")) for m in body.get("messages", [])) // 4
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def _multipart(content_type: str, body: bytes) -> dict[str, bytes]:
    """The fields of a multipart/form-data body (enough of RFC 7578 for what HTTP clients send)."""
    match = re.search(r'boundary="?([^";]+)"?', content_type)
    if match is None:
        raise ValueError("no multipart boundary")
    fields: dict[str, bytes] = {}
    for part in body.split(b"--" + match.group(1).encode())[1:]:
        if part.startswith(b"--"):
            break
        head, _, value = part.partition(b"\r\n\r\n")
        name = re.search(rb'name="([^"]*)"', head)
        if name is not None:
            fields[name.group(1).decode()] = value[:-2] if value.endswith(b"\r\n") else value
    return fields


def wav_duration_s(data: bytes) -> float:
    with wave.open(io.BytesIO(data), "rb") as reader:
        return reader.getnframes() / float(reader.getframerate())


class Transcriptions(_Service):
    prefix = "asr"

    async def answer(self, scope: Scope, raw: bytes, send: Send) -> bool:
        started = time.monotonic()
        config = self.state.config
        headers = {key.decode().lower(): value.decode() for key, value in scope["headers"]}
        try:
            fields = _multipart(headers.get("content-type", ""), raw)
            duration = wav_duration_s(fields["file"])
        except (ValueError, KeyError, EOFError, wave.Error) as exc:
            await _json(send, 400, _error_body(f"expected a multipart upload with a WAV file: {exc}"))
            return True
        self.state.stats.asr_audio_s.append(round(duration, 3))
        if await self.fail(config.asr_mode, send):
            return True
        if config.asr_delay_ms > 0:
            await asyncio.sleep(config.asr_delay_ms / 1000.0)
        body = msgspec.json.encode(
            {"text": self.state.next_transcript(), "usage": {"type": "duration", "seconds": round(duration, 3)}}
        )
        if config.asr_mode == "drop":
            await _start(send, 200, b"application/json", len(body))
            await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
            return False
        await _start(send, 200, b"application/json", len(body))
        await send({"type": "http.response.body", "body": body})
        self.state.stats.asr_service_ms.append(round((time.monotonic() - started) * 1000.0, 2))
        return True


def standin_app(state: StandinState) -> Starlette:
    """The stand-ins' ASGI app over ``state``."""

    async def set_mode(request: Request) -> Response:
        modes = msgspec.json.decode(await request.body(), type=dict[Literal["llm", "asr"], Mode])
        for service, mode in modes.items():
            setattr(state.config, f"{service}_mode", mode)
        return JSONResponse({"llm": state.config.llm_mode, "asr": state.config.asr_mode})

    async def set_config(request: Request) -> Response:
        changes = msgspec.json.decode(await request.body(), type=dict[str, Any])
        state.config = msgspec.convert({**msgspec.to_builtins(state.config), **changes}, StandinConfig, strict=False)
        return Response(msgspec.json.encode(state.config), media_type="application/json")

    async def stats(request: Request) -> Response:
        return Response(msgspec.json.encode(state.stats), media_type="application/json")

    async def wait(request: Request) -> Response:
        targets = msgspec.json.decode(await request.body(), type=dict[str, float])
        timeout_s = targets.pop("timeout_s", 30.0)
        reached = await state.wait_for({name: int(value) for name, value in targets.items()}, timeout_s)
        return Response(
            msgspec.json.encode(state.stats), status_code=200 if reached else 408, media_type="application/json"
        )

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": "standin-llm", "object": "model", "owned_by": "standin"}]}
        )

    return Starlette(
        routes=[
            Route("/v1/chat/completions", ChatCompletions(state), methods=["POST"]),
            Route("/v1/audio/transcriptions", Transcriptions(state), methods=["POST"]),
            Route("/v1/models", models),
            Route("/_standin/mode", set_mode, methods=["POST"]),
            Route("/_standin/config", set_config, methods=["POST"]),
            Route("/_standin/stats", stats),
            Route("/_standin/wait", wait, methods=["POST"]),
        ]
    )


class StandinServer:
    """The stand-ins on a real socket in the running event loop: ``async with StandinServer(config) as s``; then
    ``s.base_url`` is what a client takes as ``base_url`` (``http://127.0.0.1:PORT/v1``)."""

    def __init__(self, config: StandinConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = StandinState(config or StandinConfig())
        self.host = host
        self._socket = socket.create_server((host, port), backlog=1024)
        self.port: int = self._socket.getsockname()[1]
        self._server = uvicorn.Server(
            uvicorn.Config(standin_app(self.state), log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        )
        self._task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def __aenter__(self) -> StandinServer:
        # The socket listens already: connections wait in its backlog until uvicorn accepts them.
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.state.stopping.set()
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._socket.close()

    async def serve_forever(self) -> None:
        """Serve until uvicorn's signal handling stops the server (Ctrl-C, SIGTERM)."""
        async with self:
            assert self._task is not None
            await self._task


@contextlib.asynccontextmanager
async def standins_process(options: Sequence[str], log: Path) -> AsyncIterator[str]:
    """``omnigate-loadtest standins --port 0 *options`` in a child process (its timing then owes nothing to the
    caller's loop) until the block ends; yields its base URL (``http://127.0.0.1:PORT/v1``)."""
    command = [sys.executable, "-m", "omnigate.loadtest.cli", "standins", "--port", "0", *options]
    with log.open("wb") as errors:
        process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE, stderr=errors)
    try:
        assert process.stdout is not None
        async with asyncio.timeout(60.0):
            line = (await process.stdout.readline()).decode()
        if not line.startswith("stand-ins on "):
            raise RuntimeError(f"the stand-ins did not start (exit {await process.wait()}); see {log}")
        yield line.split()[2]
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()


def _script(path: str) -> list[ScriptedReply]:
    with open(path, "rb") as file:
        return msgspec.json.decode(file.read(), type=list[ScriptedReply])


def standins_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnigate-loadtest standins",
        description="Serve OpenAI-compatible stand-ins for an LLM (/v1/chat/completions) and a speech recognizer "
        "(/v1/audio/transcriptions) with realistic delays, for omnigate serve --llm-url/--asr-url "
        'http://HOST:PORT/v1. Failure modes switch at runtime: POST /_standin/mode {"llm": "hang"}.',
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--llm-first-token-ms", type=float, default=200.0, help="delay to the first token")
    parser.add_argument("--llm-tokens-per-s", type=float, default=30.0, help="token rate after the first (0: at once)")
    parser.add_argument("--asr-delay-ms", type=float, default=150.0, help="delay of a transcription")
    parser.add_argument("--reply", action="append", default=[], help="a scripted reply, in order (repeatable)")
    parser.add_argument("--replies-file", help='a JSON list of replies: {"text": ...} or {"tool_call": {...}}')
    parser.add_argument("--transcript", action="append", default=[], help="a scripted transcript (repeatable)")
    parser.add_argument("--default-transcript", default=StandinConfig().default_transcript)
    parser.add_argument("--default-reply", help="the reply once the script is spent (default: generated)")
    parser.add_argument("--llm-mode", default="ok", choices=MODES)
    parser.add_argument("--asr-mode", default="ok", choices=[mode for mode in MODES if mode not in ("burst", "flood")])
    return parser


def config_from_args(args: argparse.Namespace) -> StandinConfig:
    replies = [ScriptedReply(text=text) for text in args.reply]
    if args.replies_file:
        replies += _script(args.replies_file)
    return StandinConfig(
        llm_first_token_ms=args.llm_first_token_ms,
        llm_tokens_per_s=args.llm_tokens_per_s,
        asr_delay_ms=args.asr_delay_ms,
        replies=replies,
        transcripts=list(args.transcript),
        default_transcript=args.default_transcript,
        default_reply=args.default_reply,
        llm_mode=args.llm_mode,
        asr_mode=args.asr_mode,
    )


async def serve_standins(args: argparse.Namespace) -> int:
    server = StandinServer(config_from_args(args), host=args.host, port=args.port)
    print(f"stand-ins on {server.base_url} (chat completions and transcriptions)", flush=True)
    await server.serve_forever()
    return 0
