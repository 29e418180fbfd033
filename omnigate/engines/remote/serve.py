"""The engine tier on Ray Serve: one Serve application per engine replica, and the gateway's client for them.

Each replica is its own application (``omnigate-engine-0``, ``omnigate-engine-1``, ...), holding one deployment
with one replica that owns one accelerator (or one CPU slice for piper and synthetic). A gateway addresses a
replica by its application name, which is what makes per-session pinning exact and lets scale-in remove the
emptiest replica rather than the one Serve would pick. Ray Serve's HTTP proxy is not used; gateways call the
replicas through deployment handles.

``engine_app`` is the application builder a Serve config file names
(``import_path: omnigate.engines.remote.serve:engine_app``, ``args``: :class:`EngineAppArgs` fields).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import msgspec
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.schema import ApplicationStatus

from omnigate.engines.admission import AdmissionPolicy, AdmissionSettings
from omnigate.engines.registry import load_engine
from omnigate.engines.remote.replica import ReplicaCore
from omnigate.engines.remote.transport import ReplicaUnavailable

log = logging.getLogger(__name__)

DEFAULT_APP_PREFIX = "omnigate-engine"
# Application states in which a replica exists or is coming back; its stats call tells which.
_LISTED_STATES = frozenset({ApplicationStatus.RUNNING, ApplicationStatus.UNHEALTHY, ApplicationStatus.DEPLOYING})
_UNAVAILABLE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)


class EngineAppArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine replica: what it loads and what it asks of the cluster."""

    engine: str = "synthetic"
    model: str | None = None
    engine_options: dict[str, str] = {}
    ttfa_target_s: float = 0.25
    retry_after_s: float = 1.0
    # How the replica's pool admits streams (omnigate.engines.admission): headroom by its measured speed, or slots.
    admission: AdmissionPolicy = "headroom"
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    # Custom Ray resources the replica needs (for example one per node, to place one replica per node).
    resources: dict[str, float] = {}
    # Every stream holds one request for its life; control and stats calls need headroom beyond the slots.
    max_ongoing_requests: int = 1024
    # Serve cuts streams still running this long after it decided to stop the replica; drains come first.
    graceful_shutdown_timeout_s: float = 900.0
    health_check_period_s: float = 10.0
    # A gateway silent this long (it renews every second) has its streams ended, freeing their slots.
    gateway_lease_s: float = 30.0


class EngineReplica:
    """A Serve replica wrapping :class:`ReplicaCore`; its methods are the remote pool's three calls."""

    def __init__(self, args: dict[str, Any]) -> None:
        parsed = msgspec.convert(args, EngineAppArgs)
        engine = load_engine(parsed.engine, parsed.model, **parsed.engine_options)
        replica = serve.get_replica_context().replica_id.unique_id
        self.core = ReplicaCore(
            engine,
            replica,
            ttfa_target_s=parsed.ttfa_target_s,
            retry_after_s=parsed.retry_after_s,
            gateway_lease_s=parsed.gateway_lease_s,
            admission=AdmissionSettings(policy=parsed.admission),
        )
        log.info("engine replica %s serving %s (%d slots)", replica, engine.info.family, engine.info.max_sessions)

    async def stream(self, request: bytes) -> AsyncIterator[bytes]:
        async for message in self.core.stream(request):
            yield message

    async def control(self, batch: bytes) -> bytes:
        return await self.core.control(batch)

    async def stats(self, gateway: str = "") -> bytes:
        return await self.core.stats(gateway)

    async def drain(self, deadline_s: float) -> bytes:
        return await self.core.drain(deadline_s)

    async def check_health(self) -> None:
        problem = self.core.health_problem()
        if problem is not None:
            raise RuntimeError(problem)

    def __del__(self) -> None:
        core = getattr(self, "core", None)  # absent when the constructor failed
        if core is not None:
            core.shutdown()


ENGINE_DEPLOYMENT = serve.deployment(name="engine", num_replicas=1)(EngineReplica)


def engine_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder for one engine replica."""
    parsed = msgspec.convert(args, EngineAppArgs)
    actor_options: dict[str, Any] = {"num_cpus": parsed.num_cpus, "num_gpus": parsed.num_gpus}
    if parsed.resources:
        actor_options["resources"] = dict(parsed.resources)
    deployment = ENGINE_DEPLOYMENT.options(
        ray_actor_options=actor_options,
        max_ongoing_requests=parsed.max_ongoing_requests,
        graceful_shutdown_timeout_s=parsed.graceful_shutdown_timeout_s,
        health_check_period_s=parsed.health_check_period_s,
    )
    return deployment.bind(msgspec.to_builtins(parsed))


def is_engine_app(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + "-")


class ServeTransport:
    """The three calls to one engine application through its deployment handle."""

    def __init__(self, handle: DeploymentHandle[Any], *, call_timeout_s: float) -> None:
        self._stream = handle.options(method_name="stream", stream=True)
        self._control = handle.options(method_name="control")
        self._stats = handle.options(method_name="stats")
        self._timeout_s = call_timeout_s

    async def open_stream(self, request: bytes) -> AsyncGenerator[bytes, None]:
        response = cast(DeploymentResponseGenerator[bytes], self._stream.remote(request))
        try:
            async for message in response:
                yield message
        except _UNAVAILABLE as exc:
            raise ReplicaUnavailable(f"{type(exc).__name__}: {exc}") from exc
        finally:
            response.cancel()  # type: ignore[no-untyped-call]  # no-op once ended; else the replica aborts it

    async def control(self, batch: bytes) -> bytes:
        return await self._unary(self._control, batch)

    async def stats(self, gateway: str) -> bytes:
        return await self._unary(self._stats, gateway)

    async def _unary(self, handle: DeploymentHandle[Any], *args: bytes | str) -> bytes:
        response = handle.remote(*args)
        try:
            async with asyncio.timeout(self._timeout_s):
                result: bytes = await response
        except TimeoutError:
            response.cancel()  # type: ignore[no-untyped-call]
            raise ReplicaUnavailable(f"no answer within {self._timeout_s:g} s") from None
        except _UNAVAILABLE as exc:
            raise ReplicaUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return result


class ServeDirectory:
    """Engine applications whose names start with ``prefix``, as the Serve controller lists them."""

    def __init__(self, prefix: str = DEFAULT_APP_PREFIX, *, call_timeout_s: float = 5.0) -> None:
        self.prefix = prefix
        self._timeout_s = call_timeout_s

    async def names(self) -> list[str]:
        status = await asyncio.to_thread(serve.status)
        return sorted(
            name
            for name, app in status.applications.items()
            if is_engine_app(name, self.prefix) and app.status in _LISTED_STATES
        )

    async def connect(self, name: str) -> ServeTransport:
        handle = await asyncio.to_thread(serve.get_app_handle, name)
        return ServeTransport(handle, call_timeout_s=self._timeout_s)
