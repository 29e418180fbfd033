"""``omnigate serve`` with no ``--llm-url`` answers on ``/v1/realtime`` with its embedded LLM, no other process.

The real CLI runs in a subprocess with the default voice and nothing else (no LLM stand-in anywhere); it is ready
before the model is loaded, and the first response waits for the model within ``--llm-first-token-timeout``. A
``websockets`` client asks in text and gets a spoken answer: audio deltas and their transcript.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from tests.audio_checks import speech_fraction

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

pytest.importorskip("gguf")
pytest.importorskip("piper")
START_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``omnigate serve`` with the embedded agent on (off in test servers by default), seeded; its base URL once ready.
    The first response may wait for the model's load (tens of seconds on a busy machine): the session's idle
    timeout and the first-token limit are set above that."""
    port = free_port()
    folder = tmp_path_factory.mktemp("embedded")
    # The model's prepared weights are cached in the test's own folder, not the user's cache.
    env = {**os.environ, "OMNIGATE_EMBEDDED_AGENT": "1", "OMNIGATE_CACHE_DIR": str(folder / "cache")}
    command = [sys.executable, "-m", "omnigate.gateway.cli", "serve", "--port", str(port)]
    log = folder / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, "--llm-first-token-timeout", "300", "--idle-timeout", "600", "--llm-seed", "0"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        with httpx.Client(timeout=5.0) as client:
            while True:
                assert process.poll() is None, log.read_text(errors="replace")[-4000:]
                assert time.monotonic() < deadline, f"not ready after {START_S} s"
                try:
                    if client.get(f"{base}/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)  # a poll of the server's own readiness, not a wait standing in for it
        yield base
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def events_until(ws: Any, kind: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while True:
        event = json.loads(await ws.recv())
        events.append(event)
        if event["type"] == kind:
            return events


async def test_a_text_question_gets_a_spoken_answer_from_the_embedded_llm(embedded_server: str) -> None:
    url = embedded_server.replace("http://", "ws://") + "/v1/realtime?model=gpt-realtime"
    async with websockets.connect(url, max_size=None) as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created"
        question = "What is the capital of France? Answer in one short sentence."
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send(json.dumps({"type": "response.create"}))
        events = await events_until(ws, "response.done")
    done = events[-1]["response"]
    assert done["status"] == "completed", done
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    # Seeded (--llm-seed), the answer is the same on every start; the model names Paris at each of the first 8 seeds.
    assert "Paris" in transcript, transcript
    assert done["output"][0]["content"][0]["transcript"] == transcript
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    assert len(audio) / 48000 > 0.2, "a spoken word or more"
    assert speech_fraction(audio, 24000) > 0.5
    assert float(done["metadata"]["omnigate_first_token_ms"]) > 0.0  # the turn's timings include the embedded LLM's
