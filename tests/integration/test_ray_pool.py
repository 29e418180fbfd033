"""The gateway with ``--engine-pool ray``: engine replicas on a real Ray Serve cluster (a head node on loopback
running two synthetic replicas), the gateway in this process talking to them through Serve handles.

Assertions are on audio, typed errors and the replicas' own counters, never on elapsed time. Where a test waits for
a state (a stream parked for lack of credit), it polls that state with a deadline that only bounds a failing run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect

from omnigate.engines.remote import admin
from omnigate.engines.remote.pool import RemoteEnginePool
from omnigate.engines.remote.protocol import ReplicaStats
from omnigate.gateway.settings import Settings
from tests.audio_checks import synthetic_ms
from tests.integration.ws_client import collect_utterance, next_json, send
from tests.multinode.ray_cluster import LocalRayCluster, engine_args, ray_cluster
from tests.serving import RunningServer, serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STREAM = "/v1/audio/speech/stream"
SPEC = "chunk_ms=40,max_sessions=8"
# 60 ms of synthetic audio per character: 90 s, far more than sockets and the outbox hold, within the 120 s cap.
LONG_TEXT = "Credit crosses the boundary. " * 60


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    # One worker node per replica, as in production (one per GPU).
    with ray_cluster(workers=2, spec=SPEC) as running:
        yield running


@pytest.fixture(scope="module")
def server(cluster: LocalRayCluster) -> Iterator[RunningServer]:
    settings = Settings(engine_pool="ray", ray_address=cluster.address, stall_timeout_s=3600.0)
    with serve(settings) as running:
        yield running


def remote_pool(server: RunningServer) -> RemoteEnginePool:
    pool = server.gateway.pool
    assert isinstance(pool, RemoteEnginePool)
    return pool


async def stats(name: str) -> ReplicaStats:
    return await asyncio.to_thread(admin.replica_stats, name)


async def all_stats(cluster: LocalRayCluster) -> dict[str, ReplicaStats]:
    return {name: await stats(name) for name in await asyncio.to_thread(admin.engine_apps)}


async def wait_until(predicate: Callable[[], Any], limit_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError("never reached the expected state")
        await asyncio.sleep(0.05)


def small_socket(server: RunningServer) -> socket.socket:
    """A client socket with a tiny receive buffer, so a client that stops reading is felt at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((server.host, server.port))
    return sock


async def start_long_utterance(ws: ClientConnection) -> None:
    await send(ws, "session.config", response_format="pcm", stream_audio=True)
    await send(ws, "input.text", text=LONG_TEXT)
    await send(ws, "input.done")
    assert (await next_json(ws))["type"] == "audio.start"


def replica_of_only_stream(server: RunningServer, exclude: frozenset[str] = frozenset()) -> str | None:
    pool = remote_pool(server)
    names = [rs.replica for rs in pool._streams.values() if rs.acked and rs.replica not in exclude]
    return names[0] if len(names) == 1 else None


async def test_sessions_speak_through_remote_replicas_and_stay_on_theirs(
    cluster: LocalRayCluster, server: RunningServer
) -> None:
    before = await all_stats(cluster)
    texts = ["Hello from a replica.", "And again, on the same one."]
    async with connect(server.ws_url + STREAM) as ws:
        await send(ws, "session.config", response_format="pcm", stream_audio=True)
        for text in texts:
            await send(ws, "input.text", text=text)
            await send(ws, "input.done")
            utt = await collect_utterance(ws)
            assert utt.end is not None and utt.end["status"] == "completed"
            assert len(utt.pcm) == round(synthetic_ms(text) / 1000 * 24000) * 2
    after = await all_stats(cluster)
    produced = {name: after[name].generated_ms_total - before[name].generated_ms_total for name in cluster.replicas}
    # Both utterances of the session ran on one replica.
    assert sorted(produced.values()) == pytest.approx([0.0, sum(synthetic_ms(t) for t in texts)])
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        ready = (await client.get("/ready")).json()
        metrics = (await client.get("/metrics")).text
    assert ready["status"] == "ready" and ready["engine"] == "synthetic"
    assert "omnigate_engine_healthy 1.0" in metrics


async def test_a_stalled_client_costs_the_remote_engine_no_work(
    cluster: LocalRayCluster, server: RunningServer
) -> None:
    baseline = {name: s.generated_ms_total for name, s in (await all_stats(cluster)).items()}
    pool = remote_pool(server)
    async with connect(server.ws_url + STREAM, sock=small_socket(server), max_queue=1) as ws:
        await start_long_utterance(ws)
        # The client reads nothing more. The replica must park the stream: it used up the credit the gateway
        # granted and has nothing runnable.
        where: dict[str, Any] = {}

        def credit_limit() -> tuple[str | None, float]:
            [stream] = pool._streams.values()
            return stream.replica, stream.credit_limit_ms

        async def parked() -> bool:
            name, _ = server.call(credit_limit)  # type: ignore[misc]
            if name is None:
                return False
            # Credit limits only grow: read between two snapshots of the replica, the limit bounds what the first
            # snapshot saw produced; identical snapshots mean the replica did nothing in between.
            first = await stats(name)
            _, limit = server.call(credit_limit)  # type: ignore[misc]
            second = await stats(name)
            where.update(name=name, limit=limit, first=first, second=second)
            produced = first.generated_ms_total - baseline[name]
            return (
                first.report.active == 1
                and (first.steps, first.generated_ms_total) == (second.steps, second.generated_ms_total)
                and limit - produced < first.info.min_credit_ms
            )

        await wait_until(parked)
        produced = where["first"].generated_ms_total - baseline[where["name"]]
        total_ms = synthetic_ms(LONG_TEXT)
        assert produced <= where["limit"], "the replica produced beyond the credit the gateway granted"
        assert produced < 0.5 * total_ms, "the replica kept generating for a client that reads nothing"
        # Parked for credit: the stream is open, has work, and nothing on the replica is runnable.
        assert where["second"].queue_depth == 0

        # Reading again grants credit; every byte arrives.
        utt = await collect_utterance(ws)
    assert utt.end is not None and utt.end["status"] == "completed"
    assert len(utt.pcm) == round(total_ms / 1000 * 24000) * 2


async def test_draining_the_emptiest_replica_keeps_busy_sessions_and_removes_it(
    cluster: LocalRayCluster, server: RunningServer
) -> None:
    async with connect(server.ws_url + STREAM, sock=small_socket(server), max_queue=1) as busy:
        await start_long_utterance(busy)

        async def placed() -> bool:
            return server.call(lambda: replica_of_only_stream(server)) is not None

        await wait_until(placed)
        busy_replica = server.call(lambda: replica_of_only_stream(server))
        result = await asyncio.to_thread(admin.drain_emptiest, 30.0)
        assert result.replica != (await stats(str(busy_replica))).report.replica
        assert (result.finished, result.cut) == (0, 0)
        assert await asyncio.to_thread(admin.engine_apps) == [busy_replica]
        # The busy session never noticed: it reads on to the end.
        utt = await collect_utterance(busy)
        assert utt.end is not None and utt.end["status"] == "completed"
    # Scale back out for the next test: a new replica takes the free index.
    cluster.replicas = await asyncio.to_thread(admin.scale, engine_args(SPEC), 2, 30.0)
    assert len(cluster.replicas) == 2
    # The gateway looks at the replicas now instead of at its next poll.
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(remote_pool(server).refresh(), server.loop))


async def read_to_session_done(ws: ClientConnection) -> list[dict[str, Any]]:
    """The JSON events up to the next session.done (audio is read and dropped)."""
    events: list[dict[str, Any]] = []
    while not events or events[-1]["type"] != "session.done":
        message = await ws.recv()
        if isinstance(message, str):
            events.append(json.loads(message))
    return events


async def test_a_killed_replica_fails_only_its_sessions_typed_and_new_sessions_go_elsewhere(
    cluster: LocalRayCluster, server: RunningServer
) -> None:
    pool = remote_pool(server)
    async with (
        connect(server.ws_url + STREAM, sock=small_socket(server), max_queue=1) as first,
        connect(server.ws_url + STREAM, sock=small_socket(server), max_queue=1) as second,
    ):
        await start_long_utterance(first)
        await start_long_utterance(second)

        async def spread() -> bool:
            names = server.call(lambda: sorted(str(rs.replica) for rs in pool._streams.values() if rs.acked))
            return names == sorted(cluster.replicas)

        await wait_until(spread)
        victim = cluster.replicas[0]
        os.kill((await stats(victim)).pid, signal.SIGKILL)

        # Exactly one session, the one on the killed replica, gets a typed error and a failed utterance.
        outcomes = await asyncio.gather(read_to_session_done(first), read_to_session_done(second))
        failed = [events for events in outcomes if events[-1]["status"] == "error"]
        completed = [events for events in outcomes if events[-1]["status"] == "completed"]
        assert len(failed) == 1 and len(completed) == 1
        errors = [e for e in failed[0] if e["type"] == "error"]
        assert len(errors) == 1 and errors[0]["code"] == "engine_unavailable"
        assert errors[0]["message"].startswith("engine_unavailable:")
        assert not [e for e in completed[0] if e["type"] == "error"]
        # Both sessions live on; their next utterances run on the surviving replica.
        for ws in (first, second):
            await send(ws, "input.text", text="Still here.")
            await send(ws, "input.done")
            again = await collect_utterance(ws)
            assert again.end is not None and again.end["status"] == "completed"
    async with connect(server.ws_url + STREAM) as fresh:
        await send(fresh, "session.config", response_format="pcm", stream_audio=True)
        await send(fresh, "input.text", text="A new session.")
        await send(fresh, "input.done")
        utt = await collect_utterance(fresh)
        assert utt.end is not None and utt.end["status"] == "completed"
