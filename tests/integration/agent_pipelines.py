"""What the voice-agent plugin tests and the benchmark share: a real ``omnigate serve``, replies streamed token by
token like an LLM (50 tokens/s), and a Pipecat pipeline whose LLM stand-in is that stream."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

TOKENS_PER_S = 50.0
REPLIES = (
    "Sure, I can help with that. The weather in Paris is mild today, with light rain in the afternoon. "
    "You may want to bring an umbrella.",
    "Your order shipped this morning. It should arrive on Thursday, and you will get a tracking link by email. "
    "Is there anything else I can do for you?",
    "That is a great question. The short answer is yes, the museum opens at nine. "
    "Tickets are cheaper if you book them online.",
    "I found three flights for you. The earliest leaves at seven, and it is also the cheapest one. "
    "Shall I hold a seat?",
    "Thanks for waiting. I have reset your password, so you can sign in again now. "
    "Please choose a new one when you do.",
    "Good morning. Your first meeting starts in twenty minutes, in the small room on the second floor. "
    "Nothing else is planned before lunch.",
)


def tokens(text: str) -> list[str]:
    """Word-and-space tokens, the way a chat completion streams text."""
    return re.findall(r"\s*\S+", text)


def first_sentence_tokens(text: str) -> int:
    """How many tokens make up the first sentence (up to its final punctuation)."""
    count = 0
    for token in tokens(text):
        count += 1
        if token.rstrip()[-1:] in ".!?":
            return count
    return count


async def paced(text: str, tokens_per_s: float = TOKENS_PER_S) -> AsyncIterator[tuple[int, str]]:
    """The reply's tokens at a steady rate (the LLM stand-in's pace is the test's input, not a synchronisation)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i, token in enumerate(tokens(text)):
        delay = start + i / tokens_per_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        yield i, token


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def omnigate_serve(log_dir: Path, *args: str, engine: str = "piper") -> Iterator[ServerProcess]:
    """``omnigate serve`` (by default the offline piper voice) in a subprocess, ready; stopped on the way out."""
    port = free_port()
    log = log_dir / f"omnigate-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "omnigate.gateway.cli", "serve", "--engine", engine, "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    server = ServerProcess(process, port, log)
    try:
        deadline = time.monotonic() + 120.0
        while True:
            try:
                if httpx.get(f"{server.base_url}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)  # polling a starting process: there is no event to wait on
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Timeline:
    """When each token went out and each audio frame came in, on one clock (``time.perf_counter``)."""

    token_times: list[float] = field(default_factory=list)
    frame_times: list[float] = field(default_factory=list)
    frames: list[bytes] = field(default_factory=list)
    sample_rate: int = 0
    interrupted_at: float | None = None

    def first_audio_after_first_sentence_ms(self, text: str) -> float:
        last_token = self.token_times[first_sentence_tokens(text) - 1]
        return (self.frame_times[0] - last_token) * 1000.0

    @property
    def pcm(self) -> bytes:
        return b"".join(self.frames)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[index]


def now() -> float:
    return time.perf_counter()
