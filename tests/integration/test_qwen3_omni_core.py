"""``omnigate serve --engine qwen3-omni --engine-process core --workers 2``: the model in the engine-core process,
its realtime answers asked for by the gateway workers over the core's socket, a long turn encoded in the core as the
worker hears it (the core's encoder counters on each worker's ``/metrics``). Real serve processes, real realtime
clients; every wait is on a protocol event or on a state the server reports."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from omnigate.loadtest.metrics import parse_metrics
from tests.integration.test_duplex_core import Urls
from tests.integration.test_engine_core import core_server
from tests.integration.test_realtime_qwen3_omni import FRAME_BYTES, answered, speech, transcript
from tests.integration.test_realtime_ws import pcm_of, realtime, recv, until

pytestmark = pytest.mark.slow

OMNI = [
    *["--engine", "qwen3-omni", "--model", "preset:tiny", "-E", "max_sessions=1", "-E", "max_context=512"],
    *["--workers", "2"],
    # Each worker admits both sessions (its default, the engine's one slot, would refuse the second session at
    # connect when the kernel hands both connections to one worker): the core's one slot is what is shared.
    *["--max-sessions", "2"],
]


async def ask(connection: Any, text: str, tokens: int) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    await connection.conversation.item.create(item=item)
    await connection.response.create(response={"max_output_tokens": tokens})


async def test_spoken_turns_are_answered_by_the_core_and_its_one_slot_is_shared_exactly(tmp_path: Path) -> None:
    async with core_server(tmp_path, OMNI) as server:
        await server.wait_workers_started(2)
        # Video chat hands the engine frames in the gateway's process: with the engine in the core it is refused, typed.
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/video/chat/stream") as ws:
            error = json.loads(await ws.recv())
            assert error["code"] == "video_chat_unavailable" and "--engine-process inline" in error["message"]
            await ws.wait_closed()
            assert ws.close_code == 4404
        urls = Urls(server.port)
        async with realtime(urls) as first, realtime(urls) as second:
            await recv(first)
            await recv(second)
            # A spoken turn, its speech encoded in the core: answered in the model's voice.
            await first.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            await first.input_audio_buffer.append(audio=base64.b64encode(speech(0.5)).decode())
            await first.input_audio_buffer.commit()
            await first.response.create(response={"max_output_tokens": 6})
            events, done = await answered(first)
            assert done["status"] in ("completed", "incomplete"), done
            audio = pcm_of(events, done["id"])
            assert audio and len(audio) % FRAME_BYTES == 0 and transcript(events)
            # The core's one slot answers one session, whichever worker holds it; the other is refused, typed.
            await ask(first, "talk a while", 400)
            await until(first, "response.output_audio.delta")
            await ask(second, "hello", 4)
            _, refused = await answered(second)
            assert refused["status"] == "failed" and refused["status_details"]["error"]["code"] == "engine_busy"
            await first.response.cancel()
            _, cancelled = await answered(first)
            assert cancelled["status"] == "cancelled"
            await second.response.create(response={"max_output_tokens": 4})
            events, done = await answered(second)
            assert done["status"] in ("completed", "incomplete") and pcm_of(events, done["id"])


async def core_encoder(port: int, name: str) -> float:
    """A counter of the core's input encoder, as a gateway worker's ``/metrics`` last had it from the core."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        return parse_metrics((await client.get("/metrics")).text)[f"omnigate_qwen3_omni_encoder_{name}_total"][1]


async def until_counted(port: int, name: str, at_least: float) -> None:
    deadline = asyncio.get_running_loop().time() + 120  # (bounds a failing run only)
    while await core_encoder(port, name) < at_least:
        assert asyncio.get_running_loop().time() < deadline, f"the core's {name} never reached {at_least}"
        await asyncio.sleep(0.1)


async def test_a_long_turn_is_encoded_in_the_core_as_the_worker_hears_it(tmp_path: Path) -> None:
    async with core_server(tmp_path, OMNI) as server:
        await server.wait_workers_started(2)
        async with realtime(Urls(server.port)) as connection:
            await recv(connection)
            await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            await recv(connection)
            turn = speech(17.5)
            for start in range(0, len(turn), 4800):  # 100 ms appends
                await connection.input_audio_buffer.append(audio=base64.b64encode(turn[start : start + 4800]).decode())
            # Both whole windows encoded in the core before the turn is committed: whichever worker answers
            # /metrics, its copy of the core's counters says so (pushed once a second).
            await until_counted(server.port, "windows_ahead", 2)
            await connection.input_audio_buffer.commit()
            await connection.response.create(response={"max_output_tokens": 4})
            events, done = await answered(connection)
            assert done["status"] in ("completed", "incomplete") and pcm_of(events, done["id"]), done
            await until_counted(server.port, "windows_kept", 2)


async def test_a_killed_core_fails_the_answer_typed_and_answers_return_with_it(tmp_path: Path) -> None:
    async with core_server(tmp_path, OMNI) as server:
        (core_pid,) = server.pids("engine core")
        async with realtime(Urls(server.port)) as connection:
            await recv(connection)
            await ask(connection, "talk a while", 400)
            await until(connection, "response.output_audio.delta")
            # The supervisor must not restart the core before the failure below is seen.
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                os.kill(core_pid, signal.SIGKILL)
                _, failed = await answered(connection)
                assert failed["status"] == "failed"
                assert failed["status_details"]["error"]["code"] == "engine_unavailable"
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
        await server.wait_ready(200)
        # The worker's answer connection reattaches on its own poll: until then an answer fails typed.
        async with asyncio.timeout(60):
            while True:
                async with realtime(Urls(server.port)) as connection:
                    await recv(connection)
                    await ask(connection, "hello", 4)
                    events, done = await answered(connection)
                if done["status"] != "failed":
                    break
                assert done["status_details"]["error"]["code"] == "engine_unavailable"
                await asyncio.sleep(0.1)
        assert pcm_of(events, done["id"])
