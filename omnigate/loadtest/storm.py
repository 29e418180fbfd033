"""Abort and disconnect storms: many speech sessions that end badly, to show that nothing they held is left behind.

Each session follows one pattern, drawn with a seeded generator:

- ``cancel``: speak, ``input.cancel`` after the first audio, wait for the ``session.done``, close (an engine far
  faster than real time may finish the utterance before the cancel lands: counted as a late cancel);
- ``cancel_vanish``: the same, but drop the TCP connection right after the cancel (no close handshake);
- ``vanish_mid_frame``: speak, and after the first audio send half of a WebSocket frame and drop the connection;
- ``no_config``: connect and close without ever sending ``session.config``;
- ``no_config_vanish``: connect and drop the connection without a word;
- ``http_abort``: ``POST /v1/audio/speech`` and hang up after the first chunk of audio.

Two more are for a server whose mp3 encoder has been made to fail (a fault-injection run, as the storm tests do: a
task serving the session dies) and are not in the default mix:

- ``encoder_dies``: speak asking for mp3; the session must end with ``error`` ``internal_error`` and close 1011;
- ``http_encoder_dies``: ``POST /v1/audio/speech`` for mp3 over SSE; an ``error`` event ``internal_error`` must come
  before the body is cut off.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections import Counter
from collections.abc import Sequence
from typing import Literal, get_args

import httpx
import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

Pattern = Literal[
    "cancel",
    "cancel_vanish",
    "vanish_mid_frame",
    "no_config",
    "no_config_vanish",
    "http_abort",
    "encoder_dies",
    "http_encoder_dies",
]
# Only against a server whose mp3 encoder fails (see the module's docstring).
DYING_ENCODER_PATTERNS: tuple[Pattern, ...] = ("encoder_dies", "http_encoder_dies")
# The default mix: every pattern that any server survives.
PATTERNS: tuple[Pattern, ...] = tuple(p for p in get_args(Pattern) if p not in DYING_ENCODER_PATTERNS)
DYING_FORMAT = "mp3"
STREAM_PATH = "/v1/audio/speech/stream"
SPEECH_PATH = "/v1/audio/speech"
DEFAULT_TEXT = (
    "A storm of sessions starts speaking and then walks away. Each one is cancelled or cut off while the engine "
    "is still producing its audio, and the server must forget all of it."
)
READ_LIMIT_S = 60.0


class StormResult(msgspec.Struct):
    """Sessions run per pattern, and those that did not go as the pattern says (by what happened)."""

    sessions: int = 0
    by_pattern: dict[str, int] = msgspec.field(default_factory=dict)
    unexpected: dict[str, int] = msgspec.field(default_factory=dict)
    late_cancels: int = 0


class _Unexpected(Exception):
    """The server answered something the pattern does not expect (a refusal, an error, a close)."""


class _LateCancel(Exception):
    """The utterance had completed before the cancel arrived."""


async def _first_audio(ws: ClientConnection) -> None:
    async with asyncio.timeout(READ_LIMIT_S):
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                return
            event = json.loads(message)
            if event["type"] == "error":
                raise _Unexpected(f"error:{event['code']}")


async def _speak(ws: ClientConnection, text: str) -> None:
    await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "stream_audio": True}))
    await ws.send(json.dumps({"type": "input.text", "text": text}))
    await ws.send(json.dumps({"type": "input.done"}))
    await _first_audio(ws)


def _vanish(ws: ClientConnection) -> None:
    """Drop the TCP connection: no close frame, no FIN handshake."""
    ws.transport.abort()


def _half_frame() -> bytes:
    """The first bytes of a masked 4096-byte text frame: header, length, mask and 100 bytes of payload."""
    return b"\x81\xfe\x10\x00" + os.urandom(4) + b"\x00" * 100


async def _cancel(url: str, text: str, vanish: bool) -> None:
    ws = await connect(url, max_size=None)
    try:
        await _speak(ws, text)
        await ws.send(json.dumps({"type": "input.cancel"}))
        if vanish:
            return
        async with asyncio.timeout(READ_LIMIT_S):
            while True:
                message = await ws.recv()
                if isinstance(message, str) and (event := json.loads(message))["type"] == "session.done":
                    if event["status"] == "completed":
                        raise _LateCancel()
                    if event["status"] != "cancelled":
                        raise _Unexpected(f"status:{event['status']}")
                    break
        await ws.close()
    finally:
        _vanish(ws)


async def _vanish_mid_frame(url: str, text: str) -> None:
    ws = await connect(url, max_size=None)
    try:
        await _speak(ws, text)
        ws.transport.write(_half_frame())
    finally:
        _vanish(ws)


async def _no_config(url: str, vanish: bool) -> None:
    ws = await connect(url)
    if vanish:
        _vanish(ws)
    else:
        await ws.close()


async def _http_abort(client: httpx.AsyncClient, text: str) -> None:
    body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "pcm"}
    async with client.stream("POST", SPEECH_PATH, json=body) as response:
        if response.status_code != 200:
            raise _Unexpected(f"http:{response.status_code}")
        async for _ in response.aiter_raw():
            break


async def _encoder_dies(url: str, text: str) -> None:
    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": DYING_FORMAT}))
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        codes: list[str] = []
        try:
            async with asyncio.timeout(READ_LIMIT_S):
                while True:
                    message = await ws.recv()
                    if isinstance(message, str) and (event := json.loads(message))["type"] == "error":
                        codes.append(event["code"])
        except ConnectionClosed:
            pass
    if codes != ["internal_error"] or ws.close_code != 1011:
        raise _Unexpected(f"dying_encoder:{','.join(codes) or 'no_error'}:{ws.close_code}")


async def _http_encoder_dies(client: httpx.AsyncClient, text: str) -> None:
    body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": DYING_FORMAT, "stream_format": "sse"}
    codes: list[str] = []
    try:
        async with client.stream("POST", SPEECH_PATH, json=body) as response:
            if response.status_code != 200:
                raise _Unexpected(f"http:{response.status_code}")
            async for line in response.aiter_lines():
                if line.startswith("data: ") and (event := json.loads(line[6:]))["type"] == "error":
                    codes.append(event["error"]["code"])
    except httpx.RemoteProtocolError:  # the cut-off body: expected after the error event
        pass
    else:
        raise _Unexpected("dying_encoder:http_body_completed")
    if codes != ["internal_error"]:
        raise _Unexpected(f"dying_encoder:http:{','.join(codes) or 'no_error'}")


async def _one(pattern: Pattern, ws_url: str, client: httpx.AsyncClient, text: str) -> None:
    if pattern == "encoder_dies":
        await _encoder_dies(ws_url, text)
    elif pattern == "http_encoder_dies":
        await _http_encoder_dies(client, text)
    elif pattern in ("cancel", "cancel_vanish"):
        await _cancel(ws_url, text, vanish=pattern == "cancel_vanish")
    elif pattern == "vanish_mid_frame":
        await _vanish_mid_frame(ws_url, text)
    elif pattern in ("no_config", "no_config_vanish"):
        await _no_config(ws_url, vanish=pattern == "no_config_vanish")
    else:
        await _http_abort(client, text)


async def run_storm(
    base_url: str,
    sessions: int,
    *,
    concurrency: int = 32,
    patterns: Sequence[Pattern] = PATTERNS,
    seed: int = 0,
    text: str = DEFAULT_TEXT,
    headers: dict[str, str] | None = None,
) -> StormResult:
    """Run ``sessions`` sessions, at most ``concurrency`` at once, each following a pattern drawn from ``patterns``."""
    rng = random.Random(seed)
    plan = [rng.choice(patterns) for _ in range(sessions)]
    ws_url = base_url.replace("http://", "ws://").replace("https://", "wss://") + STREAM_PATH
    result = StormResult()
    by_pattern: Counter[str] = Counter()
    unexpected: Counter[str] = Counter()
    late_cancels = 0
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=READ_LIMIT_S, limits=limits, headers=headers) as client:

        async def session(pattern: Pattern) -> None:
            nonlocal late_cancels
            async with gate:
                by_pattern[pattern] += 1
                try:
                    await _one(pattern, ws_url, client, text)
                except _LateCancel:
                    late_cancels += 1
                except _Unexpected as exc:
                    unexpected[str(exc)] += 1
                except InvalidStatus as exc:
                    unexpected[f"refused:{exc.response.status_code}"] += 1
                except (WebSocketException, httpx.HTTPError, OSError, TimeoutError) as exc:
                    unexpected[type(exc).__name__] += 1

        await asyncio.gather(*(session(pattern) for pattern in plan))
    result.sessions = sessions
    result.by_pattern = dict(sorted(by_pattern.items()))
    result.unexpected = dict(sorted(unexpected.items()))
    result.late_cancels = late_cancels
    return result
