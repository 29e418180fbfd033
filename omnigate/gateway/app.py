"""The ASGI application: routes, and a lifespan that loads the engine and starts and stops its pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.routing import Route, WebSocketRoute

from omnigate.engines.base import Engine
from omnigate.engines.pool import EnginePool
from omnigate.engines.registry import load_engine
from omnigate.gateway import info
from omnigate.gateway.metrics import Metrics
from omnigate.gateway.settings import Settings
from omnigate.gateway.speech_http import speech_endpoint
from omnigate.gateway.speech_stream import speech_stream_endpoint
from omnigate.gateway.state import Gateway
from omnigate.sessions.registry import SessionRegistry

log = logging.getLogger(__name__)


def create_app(settings: Settings, engine: Engine | None = None) -> Starlette:
    """Build the gateway. ``engine`` is loaded from ``settings`` at startup unless given."""
    gateway = Gateway(settings)
    metrics = Metrics(gateway)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loaded = engine
        if loaded is None:
            try:
                loaded = await asyncio.to_thread(
                    load_engine, settings.engine, settings.model, **settings.engine_options
                )
            except Exception as exc:
                gateway.load_error = f"{type(exc).__name__}: {exc}"
                log.error("engine %s failed to load: %s", settings.engine, gateway.load_error)
                raise
        pool = EnginePool(loaded, ttfa_target_s=settings.ttfa_target_s, retry_after_s=settings.retry_after_s)
        pool.start()
        gateway.registry = SessionRegistry(
            settings.max_sessions if settings.max_sessions is not None else loaded.info.max_sessions,
            settings.retry_after_s,
        )
        gateway.pool = pool
        log.info(
            "engine %s model %s ready: %d slots, %d Hz%s",
            loaded.info.family,
            loaded.info.model,
            loaded.info.max_sessions,
            loaded.info.sample_rate,
            " (synthetic test engine)" if loaded.info.synthetic else "",
        )
        try:
            yield
        finally:
            gateway.registry.draining = True
            gateway.pool = None
            await asyncio.to_thread(pool.stop)

    routes = [
        Route("/health", info.health),
        Route("/ready", info.ready),
        Route("/metrics", info.metrics),
        Route("/v1/models", info.models),
        Route("/v1/audio/voices", info.voices),
        Route("/v1/audio/speech", speech_endpoint, methods=["POST"]),
        WebSocketRoute("/v1/audio/speech/stream", speech_stream_endpoint),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gateway
    app.state.metrics = metrics
    return app
