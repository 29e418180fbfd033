"""Scale-out on one machine: a Ray cluster of a head and two worker nodes running two synthetic engine replicas
(one per worker), two gateway processes (``omnigate serve --engine-pool ray``) behind HAProxy, and the load-test
CLI driving sessions through HAProxy.

- A client that stops reading parks its stream on the remote replica: the engine stops producing for it.
- A gateway process that dies (SIGKILL) leaves no stream behind: the replicas end its streams when its lease
  runs out.
- One replica is killed (SIGKILL) while every session is mid-utterance: exactly the sessions on it fail, with the
  typed ``engine_unavailable`` error, the others complete, and sessions started afterwards go to the survivor.

The synthetic engine runs in real time (``rtf=1``), so a stream lives as long as its audio: the load is sized so
that every session is mid-utterance when the replica dies. ``OMNIGATE_MULTINODE_SESSIONS`` raises the load for a
longer run (docs/benchmarks/ray.md); CI runs the default.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from omnigate.engines.remote import admin
from omnigate.engines.remote.protocol import ReplicaStats
from tests.audio_checks import synthetic_ms
from tests.multinode.ray_cluster import LocalRayCluster, ray_cluster

pytestmark = [pytest.mark.multinode, pytest.mark.haproxy, pytest.mark.slow]

SESSIONS = int(os.environ.get("OMNIGATE_MULTINODE_SESSIONS", "8"))
SPEC = f"chunk_ms=40,rtf=1.0,max_sessions={2 * SESSIONS},max_batch={2 * SESSIONS}"
# One utterance per session, 240 characters: 14 s of audio, so 14 s of engine work at rtf=1.
LONG_ENTRY = "Scale-out keeps the sockets in the gateway and the engines on the cluster. " * 3
STALL_TEXT = "A client that stops reading costs no engine work. " * 20
LIMIT_S = 60.0
GATEWAY_LEASE_S = 3.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_http_ok(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{process.args} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered 200")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


HAPROXY_CONFIG = """\
global
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    # a WebSocket lives as long as its session
    timeout tunnel 1h
frontend omnigate
    bind 127.0.0.1:{port}
    default_backend gateways
backend gateways
    # Affinity for clients that name their session; others are spread round robin.
    balance hdr(x-session-id)
    hash-type consistent
    option httpchk GET /ready
    http-check expect status 200
{servers}
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    with ray_cluster(workers=2, spec=SPEC, gateway_lease_s=GATEWAY_LEASE_S) as running:
        yield running


@pytest.fixture(scope="module")
def front(cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Two gateway processes on the cluster behind HAProxy; yields HAProxy's base URL."""
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.fail("haproxy is not installed (scripts/test installs it)")
    ports = [free_port(), free_port()]
    gateways = [start_gateway(cluster, port) for port in ports]
    balancer: subprocess.Popen[bytes] | None = None
    try:
        for port, process in zip(ports, gateways, strict=True):
            wait_http_ok(f"http://127.0.0.1:{port}/ready", process)
        front_port = free_port()
        servers = "\n".join(f"    server gw{i} 127.0.0.1:{port} check inter 500ms" for i, port in enumerate(ports))
        config = tmp_path_factory.mktemp("haproxy") / "haproxy.cfg"
        config.write_text(HAPROXY_CONFIG.format(port=front_port, servers=servers))
        balancer = subprocess.Popen([haproxy, "-db", "-f", str(config)])
        wait_http_ok(f"http://127.0.0.1:{front_port}/ready", balancer)
        yield f"http://127.0.0.1:{front_port}"
    finally:
        if balancer is not None:
            stop(balancer)
        for process in gateways:
            stop(process)


def start_gateway(cluster: LocalRayCluster, port: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "omnigate.gateway.cli", "serve", "--engine-pool", "ray"]
    command += ["--ray-address", cluster.address, "--port", str(port), "--stall-timeout", "3600"]
    command += ["--log-level", "warning"]
    return subprocess.Popen(command, env={**os.environ, "RAY_AUTH_MODE": "disabled"})


def all_stats(cluster: LocalRayCluster) -> dict[str, ReplicaStats]:
    return {name: admin.replica_stats(name) for name in cluster.replicas}


def wait_for(predicate: Any, what: str) -> Any:
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"never reached: {what}")


async def stall_one_session(
    front: str, cluster: LocalRayCluster, then: Callable[[], None] | None = None
) -> tuple[float, float]:
    """Start an utterance, read nothing, and return (audio the replicas produced for it, audio it asked for) once
    the stream parked; ``then`` runs while the client is still connected."""
    baseline = {name: s.generated_ms_total for name, s in (await asyncio.to_thread(all_stats, cluster)).items()}
    host, port = front.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    async with connect(f"ws://{host}:{port}/v1/audio/speech/stream", sock=sock, max_queue=1) as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "stream_audio": True}))
        await ws.send(json.dumps({"type": "input.text", "text": STALL_TEXT}))
        await ws.send(json.dumps({"type": "input.done"}))

        def parked() -> float | None:
            # Two identical snapshots with the stream open and nothing runnable: parked for lack of credit.
            first, second = all_stats(cluster), all_stats(cluster)
            for name in cluster.replicas:
                a, b = first[name], second[name]
                open_and_idle = a.report.active == 1 and b.report.active == 1 and b.queue_depth == 0
                if open_and_idle and (a.steps, a.generated_ms_total) == (b.steps, b.generated_ms_total):
                    produced = a.generated_ms_total - baseline[name]
                    if produced > 0:
                        return produced
            return None

        produced = await asyncio.to_thread(wait_for, parked, "the stalled stream parked on its replica")
        if then is not None:
            then()
    return float(produced), synthetic_ms(STALL_TEXT)


def test_a_stalled_client_behind_the_balancer_costs_the_remote_engine_no_work(
    cluster: LocalRayCluster, front: str
) -> None:
    produced, asked = asyncio.run(stall_one_session(front, cluster))
    assert 0 < produced < 0.5 * asked, f"the replica produced {produced} ms of {asked} ms for a stalled client"
    # The client went away; its stream was aborted on the replica.
    wait_for(lambda: all(s.report.active == 0 for s in all_stats(cluster).values()), "the stream released")


def test_a_dead_gateways_streams_are_ended_by_the_replicas(cluster: LocalRayCluster, front: str) -> None:
    port = free_port()
    gateway = start_gateway(cluster, port)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/ready", gateway)
        # The stream parks on a replica; then its gateway dies without a word.
        asyncio.run(stall_one_session(f"http://127.0.0.1:{port}", cluster, then=gateway.kill))
        gateway.wait(10)
        wait_for(
            lambda: all(s.report.active == 0 for s in all_stats(cluster).values()),
            f"the replicas end the dead gateway's stream after its {GATEWAY_LEASE_S} s lease",
        )
    finally:
        stop(gateway)


def test_a_killed_replica_fails_only_its_sessions_typed_and_load_moves_to_the_survivor(
    cluster: LocalRayCluster, front: str, tmp_path: Path
) -> None:
    corpus = tmp_path / "long.txt"
    corpus.write_text(LONG_ENTRY + "\n")
    report_path = tmp_path / "report.json"
    loadtest = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omnigate.loadtest.cli",
            "run",
            front,
            "--sessions",
            str(SESSIONS),
            "--duration",
            "4",
            "--warmup",
            "0",
            "--drain",
            "40",
            "--words-per-second",
            "0",
            "--corpus",
            str(corpus),
            "--utterance-timeout",
            "40",
            "--no-metrics",
            "--quiet",
            "--out",
            str(report_path),
        ]
    )
    try:
        # Every session is mid-utterance on one of the replicas.
        live = wait_for(
            lambda: (s := all_stats(cluster)) and sum(r.report.active for r in s.values()) == SESSIONS and s,
            f"{SESSIONS} live streams",
        )
        victim = next(name for name in cluster.replicas if live[name].report.active > 0)
        on_victim = live[victim].report.active
        os.kill(live[victim].pid, signal.SIGKILL)
        assert loadtest.wait(LIMIT_S + 60) == 0 or report_path.exists()
    finally:
        if loadtest.poll() is None:
            loadtest.kill()
            loadtest.wait(10)
    report = json.loads(report_path.read_text())
    [level] = report["levels"]
    records = level["session_records"]
    failed = [r for r in records if r["status"] == "failed"]
    completed = [r for r in records if r["status"] == "completed"]
    # Exactly the sessions that were on the killed replica failed, each with the typed error.
    assert len(failed) == on_victim
    assert 0 < on_victim < SESSIONS
    for record in failed:
        assert set(record["errors"]) <= {"engine_unavailable", "audio_done_error", "utterance_error"}
        assert record["errors"].get("engine_unavailable") == 1
    assert level["error_examples"]["engine_unavailable"].startswith("engine_unavailable:")
    # Everything else completed, including the sessions the load test started after the kill.
    assert len(completed) == len(records) - len(failed)
    assert len(completed) >= SESSIONS - on_victim
