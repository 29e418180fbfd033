"""Run ``omnigate serve`` in a child process for a benchmark, so the server's footprint is its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    def __init__(self, process: asyncio.subprocess.Process, host: str, port: int, log: Path) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.log = log

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid


@contextlib.asynccontextmanager
async def server_process(
    serve_args: Sequence[str], log: Path, *, host: str = "127.0.0.1", ready_limit_s: float = 120.0
) -> AsyncIterator[ServerProcess]:
    """``omnigate serve --host HOST --port PORT *serve_args`` until the block ends (then SIGTERM, and SIGKILL if it
    does not exit within a minute). Raises RuntimeError when it does not become ready."""
    port = free_port(host)
    command = [sys.executable, "-m", "omnigate.gateway.cli", "serve", "--host", host, "--port", str(port), *serve_args]
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *command, stdout=out, stderr=asyncio.subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    server = ServerProcess(process, host, port, log)
    try:
        await _wait_ready(server, ready_limit_s)
        yield server
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(60.0):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


async def _wait_ready(server: ServerProcess, limit_s: float) -> None:
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        try:
            async with asyncio.timeout(limit_s):
                while True:
                    if server.process.returncode is not None:
                        raise RuntimeError(f"the server exited with {server.process.returncode}; see {server.log}")
                    with contextlib.suppress(httpx.TransportError):
                        if (await client.get(server.url + "/ready")).status_code == 200:
                            return
                    await asyncio.sleep(0.1)
        except TimeoutError:
            raise RuntimeError(f"the server was not ready within {limit_s:g} s; see {server.log}") from None
