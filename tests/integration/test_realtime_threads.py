"""Realtime sessions leave no thread behind: 200 sessions served, the process has the threads it had after 10.

Every session hears real speech (the piper voice) through the server VAD, so the detector, its resampler and the
engine session all run; each session ends once the VAD has heard the speech start. The server runs in this process,
so its threads are this process's threads, counted at the OS level (``/proc/self/task``), where their names show.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
from collections.abc import Iterator

import pytest
from websockets.asyncio.client import connect

from omnigate.gateway.settings import Settings
from omnigate.os_threads import os_thread_name
from tests.integration.test_realtime_ws import user_speech  # noqa: F401 - the fixture
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration

SESSIONS = 200
WARM_UP = 10
AT_ONCE = 10
# Threads a pool may add after the warm-up by reaching its configured size later (the default executor's lazily
# started workers); what sessions would leave behind grows with the 190 sessions served after the count.
SLACK = 4
READ_LIMIT_S = 30.0


@pytest.fixture(scope="module")
def tts_vad_server() -> Iterator[RunningServer]:
    """A text-to-speech engine; realtime sessions turn-detect with the server VAD (the default)."""
    with serve(Settings(engine="synthetic")) as server:
        yield server


@pytest.fixture(scope="module")
def duplex_server() -> Iterator[RunningServer]:
    with serve(Settings(engine="duplex", model="preset:tiny", engine_options={"max_sessions": str(AT_ONCE)})) as s:
        yield s


def os_threads() -> dict[int, str]:
    names: dict[int, str] = {}
    for entry in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended while listed
            names[int(entry)] = os_thread_name(int(entry))
    return names


async def one_session(server: RunningServer, speech_event: str) -> None:
    async with connect(server.ws_url + "/v1/realtime", compression=None, max_size=None) as ws:
        async with asyncio.timeout(READ_LIMIT_S):
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": speech_event}))
            while json.loads(await ws.recv())["type"] != "input_audio_buffer.speech_started":
                pass


async def serve_sessions(server: RunningServer, audio: str, count: int) -> None:
    for _ in range(count // AT_ONCE):
        await asyncio.gather(*(one_session(server, audio) for _ in range(AT_ONCE)))


async def settled(server: RunningServer) -> None:
    """Every session's scope has ended on the server."""
    while server.call(lambda: server.gateway.registry.total_active):  # noqa: ASYNC110 - polls the server's state
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("engine", ["tts_vad_server", "duplex_server"])
async def test_200_realtime_sessions_leave_no_thread_behind(
    engine: str,
    request: pytest.FixtureRequest,
    user_speech: bytes,  # noqa: F811
) -> None:
    server: RunningServer = request.getfixturevalue(engine)
    audio = base64.b64encode(user_speech).decode()
    await serve_sessions(server, audio, WARM_UP)
    await settled(server)
    after_warm_up = os_threads()
    await serve_sessions(server, audio, SESSIONS - WARM_UP)
    await settled(server)
    after_all = os_threads()
    assert len(after_all) <= len(after_warm_up) + SLACK, sorted(after_all.values())
    born = {tid: name for tid, name in after_all.items() if tid not in after_warm_up}
    assert all(name.startswith("omnigate-") for name in born.values()), born
