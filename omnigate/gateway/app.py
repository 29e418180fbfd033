"""The ASGI application: routes, and a lifespan that loads the engine and starts and stops its pool."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route, WebSocketRoute

from omnigate.codecs.ffmpeg_threads import ffmpeg_on_calling_threads
from omnigate.engines.admission import AdmissionSettings
from omnigate.engines.base import Engine
from omnigate.engines.pool import EnginePool
from omnigate.engines.pool_api import EnginePoolAPI
from omnigate.engines.qwen3_omni.encoder_stats import EncoderStats
from omnigate.engines.registry import load_engine
from omnigate.gateway.errors import routing_error
from omnigate.gateway.ops import info
from omnigate.gateway.ops.loop_lag import watch_loop_lag
from omnigate.gateway.ops.metrics import Metrics
from omnigate.gateway.realtime.connection import ResponderReports
from omnigate.gateway.realtime.service import start_realtime
from omnigate.gateway.realtime.ws import duplex_endpoint, realtime_endpoint
from omnigate.gateway.robot.stream import robot_policy_endpoint, start_robot, stop_robot
from omnigate.gateway.security.auth import AuthMiddleware
from omnigate.gateway.security.client_secrets import client_secrets_endpoint
from omnigate.gateway.security.credentials import ApiKeys, ClientSecretStore
from omnigate.gateway.security.ratelimit import KeyedSessionRegistry
from omnigate.gateway.settings import Settings, responder_summary
from omnigate.gateway.speech.http import speech_endpoint
from omnigate.gateway.speech.stream import speech_stream_endpoint
from omnigate.gateway.state import Gateway
from omnigate.gateway.video.stream import start_video_engine, stop_video_engine, video_stream_endpoint
from omnigate.gateway.video_chat.call import video_chat_calls_endpoint
from omnigate.gateway.video_chat.service import frame_decode_pool, start_omni_engine, stop_omni_engine
from omnigate.gateway.video_chat.ws import video_chat_endpoint
from omnigate.gateway.webrtc.endpoint import realtime_calls_endpoint, video_calls_endpoint
from omnigate.gateway.webrtc.signalling import WebRtcCalls
from omnigate.gateway.webrtc.telemetry import WebRtcTelemetry
from omnigate.os_threads import named_executor
from omnigate.web import web_routes

log = logging.getLogger(__name__)


def create_app(settings: Settings, engine: Engine | None = None) -> Starlette:
    """Build the gateway. ``engine`` is loaded from ``settings`` at startup unless given."""
    gateway = Gateway(settings)
    metrics = Metrics(gateway)
    webrtc = WebRtcCalls(settings, WebRtcTelemetry(metrics))
    frame_decoding = frame_decode_pool(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Codecs and resamplers run on the server's own pools, not on a pool per encoder that FFmpeg would start.
        ffmpeg_on_calling_threads()
        # asyncio.to_thread work (encoders, loading) runs on the loop's default pool: named, as large as asyncio's.
        asyncio.get_running_loop().set_default_executor(
            named_executor(min(32, (os.cpu_count() or 1) + 4), "omnigate-io")
        )
        webrtc.configure()
        pool: EnginePoolAPI[Any]
        stop_pool: Callable[[], Awaitable[None]]
        if settings.engine_pool == "ray":
            # Ray is an optional extra ([ray]): imported only by a gateway that uses it.
            from omnigate.engines.remote.connect import connect_ray_pool

            try:
                remote = await connect_ray_pool(
                    settings.ray_address, settings.ray_app_prefix, retry_after_s=settings.retry_after_s
                )
            except Exception as exc:
                gateway.load_error = f"{type(exc).__name__}: {exc}"
                log.error("no engine replica on the Ray cluster answered: %s", gateway.load_error)
                raise
            pool, stop_pool = remote, remote.close
            slots = remote.info.max_sessions * max(1, remote.replicas_up)
        elif settings.core_socket is not None:
            from omnigate.engines.core.client import connect_core_pool

            try:
                core_pool, transport = await connect_core_pool(
                    settings.core_socket, retry_after_s=settings.retry_after_s
                )
            except Exception as exc:
                gateway.load_error = f"{type(exc).__name__}: {exc}"
                log.error("the engine core did not answer: %s", gateway.load_error)
                raise
            # The core is the authority on slots: every gateway process may try them all, the core refuses the rest.
            pool, slots = core_pool, core_pool.info.max_sessions

            async def stop_pool() -> None:
                await core_pool.close()
                await transport.close()

        else:
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
            local = EnginePool(
                loaded,
                ttfa_target_s=settings.ttfa_target_s,
                retry_after_s=settings.retry_after_s,
                step_timeout_s=settings.engine_step_timeout_s,
                failure_threshold=settings.engine_failure_threshold,
                step_observer=metrics.observe_step,
                admission=AdmissionSettings(policy=settings.admission, target_load=settings.admission_target_load),
            )
            local.start()
            pool, slots = local, loaded.info.max_sessions

            async def stop_pool() -> None:
                await asyncio.to_thread(local.stop)

        gateway.registry = KeyedSessionRegistry(
            settings.max_sessions if settings.max_sessions is not None else slots,
            settings.retry_after_s,
            max_per_key=settings.max_sessions_per_key,
        )
        gateway.pool = pool
        log.info(
            "engine %s model %s ready: %d slots, %d Hz%s",
            pool.info.family,
            pool.info.model,
            slots,
            pool.info.sample_rate,
            " (synthetic test engine)" if pool.info.synthetic else "",
        )
        # The models and libraries just loaded are millions of long-lived objects; a full collection walking them
        # pauses the loop and the engine threads for hundreds of milliseconds under load. Keep them out of its walks.
        gc.collect()
        gc.freeze()
        loop_lag = asyncio.create_task(watch_loop_lag(metrics.loop_lag.observe), name="loop-lag")
        try:
            app.state.video_engine = await start_video_engine(settings)
            app.state.omni_engine = await start_omni_engine(settings, pool)
            gateway.omni_stats = app.state.omni_engine.stats if app.state.omni_engine is not None else None
            reports = ResponderReports(
                metrics.observe_responder_turn, lambda code: metrics.responder_failures.labels(code).inc()
            )
            app.state.realtime = await start_realtime(settings, pool, reports)
            duplex = app.state.realtime.duplex
            gateway.duplex_stats = duplex.stats if duplex is not None else None
            encoder_stats = getattr(app.state.realtime.answerer, "encoder_stats", None)
            gateway.encoder_stats = encoder_stats if isinstance(encoder_stats, EncoderStats) else None
            await start_robot(gateway, metrics)
            yield
        finally:
            loop_lag.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop_lag
            gateway.registry.draining = True
            await webrtc.close_all()
            gateway.pool = None
            gateway.duplex_stats = None
            gateway.encoder_stats = None
            gateway.omni_stats = None
            await stop_pool()
            await stop_video_engine(app.state.video_engine)
            await stop_robot(gateway)
            app.state.video_engine = None
            await stop_omni_engine(app.state.omni_engine)
            app.state.omni_engine = None
            frame_decoding.close()
            if app.state.realtime is not None:
                await app.state.realtime.aclose_services()
                await asyncio.to_thread(app.state.realtime.close)
                app.state.realtime = None

    routes = [
        Route("/health", info.health),
        Route("/ready", info.ready),
        Route("/metrics", info.metrics),
        Route("/v1/models", info.models),
        Route("/v1/audio/voices", info.voices),
        Route("/v1/audio/speech", speech_endpoint, methods=["POST"]),
        WebSocketRoute("/v1/audio/speech/stream", speech_stream_endpoint),
        WebSocketRoute("/v1/realtime/video", video_stream_endpoint),
        WebSocketRoute("/v1/realtime/robot/openpi", robot_policy_endpoint),
        WebSocketRoute("/v1/video/chat/stream", video_chat_endpoint),
        WebSocketRoute("/v1/realtime", realtime_endpoint),
        WebSocketRoute("/v1/duplex", duplex_endpoint),
        Route("/v1/realtime/client_secrets", client_secrets_endpoint, methods=["POST"]),
        Route("/v1/realtime/calls", realtime_calls_endpoint, methods=["POST"]),
        Route("/v1/realtime/video/calls", video_calls_endpoint, methods=["POST"]),
        Route("/v1/video/chat/calls", video_chat_calls_endpoint, methods=["POST"]),
        *web_routes(settings.web_token_url, responder_summary(settings)),
    ]
    client_secrets = ClientSecretStore(settings.max_client_secrets, settings.max_client_secrets_per_key)
    # Outermost of the app's own middleware, so it covers every route, HTTP and WebSocket alike.
    auth = Middleware(
        AuthMiddleware,
        gateway=gateway,
        keys=ApiKeys(settings.api_key_hashes),
        client_secrets=client_secrets,
        metrics=metrics,
    )
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[auth],
        exception_handlers={404: routing_error, 405: routing_error},
    )
    app.state.gateway = gateway
    app.state.metrics = metrics
    app.state.video_engine = None  # a VideoEngine while serving, when --video-model names one
    app.state.omni_engine = None  # an OmniEngine while serving, when --omni-model names one
    app.state.frame_decoding = frame_decoding  # decodes video chat's camera frames
    app.state.realtime = None  # the RealtimeService (engines of /v1/realtime) while serving
    app.state.client_secrets = client_secrets
    app.state.webrtc = webrtc
    return app
