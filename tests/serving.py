"""Start the real gateway, configured as ``omnigate serve`` configures it, on a free loopback port in-process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette

from omnigate.engines.base import Engine
from omnigate.gateway.app import create_app
from omnigate.gateway.server_config import uvicorn_config
from omnigate.gateway.settings import Settings
from omnigate.gateway.sockets import bind_listener
from omnigate.gateway.state import Gateway


@dataclass
class RunningServer:
    app: Starlette
    host: str
    port: int
    loop: asyncio.AbstractEventLoop

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}"

    @property
    def gateway(self) -> Gateway:
        gateway: Gateway = self.app.state.gateway
        return gateway

    def call(self, fn: object) -> object:
        """Run a zero-argument callable on the server's loop and return its result (to read state safely)."""

        async def run() -> object:
            return fn()  # type: ignore[operator]

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)


@contextmanager
def serve(settings: Settings, engine: Engine | None = None) -> Iterator[RunningServer]:
    app = create_app(settings, engine)
    sock = bind_listener("127.0.0.1", 0, settings.socket_send_buffer_bytes)
    port = sock.getsockname()[1]
    config = uvicorn_config(app, settings, log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    loop_box: list[asyncio.AbstractEventLoop] = []
    started = threading.Event()

    def run() -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        loop_box.append(loop)

        async def main() -> None:
            # uvicorn's serve() in steps, so the test learns the moment startup (the lifespan) finished.
            config.load()
            server.lifespan = config.lifespan_class(config)
            await server.startup(sockets=[sock])
            started.set()
            if not server.should_exit:
                await server.main_loop()
            if server.started:
                await server.shutdown(sockets=[sock])

        try:
            loop.run_until_complete(main())
        finally:
            started.set()
            loop.close()

    thread = threading.Thread(target=run, name="omnigate-test-server", daemon=True)
    thread.start()
    started.wait(60)
    if not server.started:
        thread.join(5)
        raise RuntimeError("the test server did not start")
    try:
        yield RunningServer(app, "127.0.0.1", port, loop_box[0])
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
