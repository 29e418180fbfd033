"""The embedded recognizer's processes end with a real ``omnigate serve`` process, however it ends: drained by
SIGTERM (the server closes them) or killed by SIGKILL (the kernel kills them with their parent), so none is left
behind.

The server runs as a subprocess with ``--llm-url`` and no ``--asr-url`` (no turn is spoken, so no LLM is asked);
each recognizer process is watched through a pidfd opened while it runs, which becomes readable when it exits.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from tests.integration.test_drain import server_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WAIT_S = 30.0


def recognizer_processes(server_pid: int) -> list[int]:
    """The server's children running the recognizer worker (they are started from its event loop's thread)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    found = []
    for child in children:
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"omnigate.engines.recognizer_worker" in command:
            found.append(int(child))
    return found


async def exited(pidfd: int) -> None:
    """Until the process behind ``pidfd`` has exited."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(pidfd, readable.set_result, None)
    try:
        async with asyncio.timeout(WAIT_S):
            await readable
    finally:
        loop.remove_reader(pidfd)


@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGKILL], ids=["drained", "killed"])
async def test_the_recognizer_processes_end_with_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: signal.Signals
) -> None:
    monkeypatch.setenv("OMNIGATE_EMBEDDED_AGENT", "1")  # (off in test servers; --llm-url keeps the LLM out)
    expected = min(8, os.cpu_count() or 1)  # one per core, at most the 8 decoders of the default
    async with server_process(tmp_path, 5.0, ["--llm-url", "http://127.0.0.1:9/v1"]) as server:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while len(pids := recognizer_processes(server.process.pid)) < expected:
            assert loop.time() < deadline, f"{len(pids)} recognizer processes: {server.log.read_text()}"
            await asyncio.sleep(0.05)  # polling the process table, as the server's readiness is polled
        pidfds = [os.pidfd_open(pid) for pid in pids]
        try:
            server.process.send_signal(ending)
            await server.exit_code()
            for pidfd in pidfds:
                await exited(pidfd)
        finally:
            for pidfd in pidfds:
                os.close(pidfd)
