"""``WS /v1/realtime/robot/openpi`` on the real server: the real openpi-client (in its own venv, since it pins
numpy<2 and the project numpy 2), and a client written from openpi-client's source for what that client cannot
send (two observations at once, text, oversized and non-msgpack payloads)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import venv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import msgspec
import numpy as np
import pytest
from websockets.asyncio.client import ClientConnection, connect

from omnigate.gateway.security.credentials import api_key_hash
from omnigate.gateway.settings import Settings
from omnigate.loadtest.report import LoadTestReport, consistency_problems
from tests.integration.test_drain import close_code, next_event, server_process
from tests.serving import RunningServer, serve

ROUTE = "/v1/realtime/robot/openpi"
OPENPI_CLIENT = "openpi-client==0.1.2"
KEY = "robot-test-key"
CLIENT_SCRIPT = Path(__file__).with_name("openpi_client_run.py")


def robot_settings(**extra: Any) -> Settings:
    options = {"robot_model": "preset:tiny", "robot_options": {"threads": "1"}}
    return Settings(engine="synthetic", **{**options, **extra})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def robot_server() -> Iterator[RunningServer]:
    with serve(robot_settings(robot_max_observation_bytes=256 * 1024)) as server:
        yield server


@pytest.fixture(scope="session")
def openpi_python() -> Path:
    """A venv holding openpi-client and what it needs (numpy<2, and typing_extensions, which it imports undeclared),
    made once and kept in the user's cache."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "omnigate-tests"
    home = cache / f"{OPENPI_CLIENT.replace('==', '-')}-py{sys.version_info.major}{sys.version_info.minor}"
    python = home / "bin" / "python"
    stamp = home / ".installed"
    if not stamp.exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(home)
        install = [str(python), "-m", "pip", "install", "-q", OPENPI_CLIENT, "numpy<2", "typing_extensions"]
        subprocess.run(install, check=True, timeout=600)
        stamp.write_text(OPENPI_CLIENT)
    return python


def run_openpi_client(python: Path, url: str, scenario: str, api_key: str | None = None) -> dict[str, Any]:
    args = [str(python), str(CLIENT_SCRIPT), url, scenario, *([api_key] if api_key else [])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


# ---- openpi's wire, written from openpi_client/msgpack_numpy.py -----------------------------------------------


def openpi_pack(obj: Any) -> bytes:
    def default(o: Any) -> Any:
        if isinstance(o, np.ndarray):
            return {b"__ndarray__": True, b"data": o.tobytes(), b"dtype": o.dtype.str, b"shape": o.shape}
        return o

    packed: bytes = msgpack.packb(obj, default=default)
    return packed


def openpi_unpack(data: bytes) -> Any:
    def hook(obj: dict[Any, Any]) -> Any:
        if b"__ndarray__" in obj:
            return np.ndarray(buffer=obj[b"data"], dtype=np.dtype(obj[b"dtype"]), shape=obj[b"shape"])
        return obj

    return msgpack.unpackb(data, object_hook=hook)


def good_observation(metadata: dict[str, Any]) -> bytes:
    obs: dict[str, Any] = {}
    for key, feature in metadata["observation_spec"].items():
        if feature["dtype"] == "str":
            obs[key] = "open the drawer"
        elif feature["dtype"] == "uint8":
            obs[key] = np.zeros(feature["shape"], np.uint8)
        else:
            obs[key] = np.zeros(feature["shape"], np.float32)
    return openpi_pack(obs)


async def open_robot(server: RunningServer, query: str = "", **headers: str) -> tuple[ClientConnection, dict[str, Any]]:
    ws = await connect(server.ws_url + ROUTE + query, additional_headers=headers or None, max_size=None)
    metadata = openpi_unpack(await ws.recv())
    return ws, metadata


def error_code(message: str | bytes) -> str:
    assert isinstance(message, str), "expected a text refusal"
    body = json.loads(message)
    assert body["type"] == "error"
    return str(body["code"])


# ---- the real client ----------------------------------------------------------------------------------------


def test_openpi_client_gets_metadata_and_action_chunks(robot_server: RunningServer, openpi_python: Path) -> None:
    out = run_openpi_client(openpi_python, robot_server.ws_url + ROUTE, "good")
    metadata = out["metadata"]
    assert metadata["observation_spec"]["observation/state"] == {"dtype": "float32", "shape": [8]}
    assert metadata["observation_spec"]["prompt"] == {"dtype": "str", "shape": []}
    horizon, dim = metadata["action_horizon"], metadata["action_dim"]
    assert metadata["model"] == "preset:tiny" and metadata["control_rate_hz"] > 0
    replies = out["replies"]
    assert [r["shape"] for r in replies] == [[horizon, dim]] * 3
    assert all(r["dtype"] == "float32" and r["finite"] for r in replies)
    assert "prev_total_ms" not in replies[0]["server_timing"]
    assert all(r["server_timing"]["infer_ms"] > 0 and r["server_timing"]["prev_total_ms"] > 0 for r in replies[1:])


def test_a_bad_observation_is_a_text_error_and_the_session_goes_on(
    robot_server: RunningServer, openpi_python: Path
) -> None:
    replies = run_openpi_client(openpi_python, robot_server.ws_url + ROUTE, "bad-then-good")["replies"]
    assert "shape" in replies[0] and "shape" in replies[2]
    error = replies[1]["error"]
    assert error.startswith("Error in inference server:\n")
    body = json.loads(error.partition("\n")[2])
    assert (body["code"], body["param"]) == ("invalid_dtype", "observation/state")


def test_openpi_client_authenticates_with_its_api_key_header(openpi_python: Path) -> None:
    with serve(robot_settings(api_key_hashes=(api_key_hash(KEY),))) as server:
        url = server.ws_url + ROUTE
        assert len(run_openpi_client(openpi_python, url, "good", KEY)["replies"]) == 3
        refused = run_openpi_client(openpi_python, url, "good")
        assert refused["connect_error"] == "InvalidStatus" and "401" in refused["detail"]
        wrong = run_openpi_client(openpi_python, url, "good", "wrong-key")
        assert wrong.get("connect_error") == "InvalidStatus"


# ---- a client written from openpi-client's source -------------------------------------------------------------


async def test_bearer_auth_works_too() -> None:
    with serve(robot_settings(api_key_hashes=(api_key_hash(KEY),))) as server:
        ws, metadata = await open_robot(server, Authorization=f"Bearer {KEY}")
        await ws.send(good_observation(metadata))
        assert "actions" in openpi_unpack(await ws.recv())
        await ws.close()


async def test_a_second_observation_before_the_reply_is_refused_typed(robot_server: RunningServer) -> None:
    pool = robot_server.gateway.robot_pool
    assert pool is not None
    # The policy's step is held until the second observation was refused, so the first is surely still in flight.
    gate = threading.Event()
    step = pool.engine.step

    def held_step(streams: Any) -> Any:
        gate.wait(30)
        return step(streams)

    pool.engine.step = held_step  # type: ignore[method-assign]
    try:
        ws, metadata = await open_robot(robot_server)
        observation = good_observation(metadata)
        await ws.send(observation)
        await ws.send(observation)
        refusal = await ws.recv()
        assert isinstance(refusal, str) and error_code(refusal) == "observation_in_flight"
        gate.set()
        answer = await ws.recv()
        assert isinstance(answer, bytes) and "actions" in openpi_unpack(answer)
    finally:
        pool.engine.step = step  # type: ignore[method-assign]
        gate.set()
    await ws.send(observation)  # answered: the next one is served
    assert "actions" in openpi_unpack(await ws.recv())
    await ws.close()


def wait_for_server(server: RunningServer, condition: Any) -> None:
    """Read server state on its loop until ``condition(pool)`` holds (each read is a round trip, not a sleep)."""
    for _ in range(100_000):
        if server.call(lambda: condition(server.gateway.robot_pool)):
            return
    raise AssertionError("the server never reached the expected state")


async def test_latest_wins_never_refuses_and_answers_the_newest(robot_server: RunningServer) -> None:
    ws, metadata = await open_robot(robot_server, "?on_busy=latest&control_rate_hz=50")
    pool = robot_server.gateway.robot_pool
    assert pool is not None
    accepted, replaced = robot_server.call(lambda: (pool.observations_total, pool.replaced_total))  # type: ignore[misc]
    observation = good_observation(metadata)
    for _ in range(4):
        await ws.send(observation)
    # Every observation has been taken in (accepted or replacing a waiting one) once the counter says 4 more.
    wait_for_server(robot_server, lambda p: p.observations_total - accepted == 4)
    expected = 4 - (robot_server.call(lambda: pool.replaced_total) - replaced)  # type: ignore[operator]
    assert 1 <= expected <= 4
    for _ in range(expected):
        message = await ws.recv()
        assert isinstance(message, bytes), f"unexpected text reply {message!r}"
        assert "actions" in openpi_unpack(message)
    await ws.send(observation)  # nothing is left in flight: the next observation is the next reply
    assert isinstance(await ws.recv(), bytes)
    await ws.close()


async def test_wrong_payloads_are_refused_typed_and_nothing_breaks(robot_server: RunningServer) -> None:
    ws, metadata = await open_robot(robot_server)
    spec_keys = list(metadata["observation_spec"])
    cases: list[tuple[str | bytes, str]] = [
        ('{"prompt": "hi"}', "invalid_observation"),  # text, not msgpack
        (pickle.dumps({"x": np.zeros(3)}), "invalid_msgpack"),  # never unpickled
        (msgpack.packb({"prompt": "only a prompt"}), "missing_key"),
        (openpi_pack({k: np.zeros((300, 300), np.uint8) for k in spec_keys}), "payload_too_large"),  # 256 KiB limit
        (
            msgpack.packb({"x": {b"__ndarray__": True, b"data": b"12345678", b"dtype": "|O", b"shape": [1]}}),
            "invalid_dtype",
        ),
    ]
    for payload, code in cases:
        await ws.send(payload)
        assert error_code(await ws.recv()) == code
    await ws.send(good_observation(metadata))
    assert "actions" in openpi_unpack(await ws.recv())
    await ws.close()


async def test_metrics_count_robot_sessions_and_inferences(robot_server: RunningServer) -> None:
    ws, metadata = await open_robot(robot_server)
    await ws.send(good_observation(metadata))
    await ws.recv()
    async with httpx.AsyncClient() as client:
        text = (await client.get(robot_server.http_url + "/metrics")).text
    await ws.close()
    active = next(line for line in text.splitlines() if line.startswith('omnigate_sessions_active{transport="robot"}'))
    assert float(active.split()[-1]) >= 1
    count = next(line for line in text.splitlines() if line.startswith("omnigate_robot_inference_seconds_count"))
    assert float(count.split()[-1]) >= 1
    assert "omnigate_robot_batch_size_bucket" in text


async def test_an_idle_robot_is_closed_typed() -> None:
    with serve(robot_settings(idle_timeout_s=0.3)) as server:
        ws, _ = await open_robot(server)
        assert error_code(await ws.recv()) == "idle_timeout"
        await ws.wait_closed()
        assert ws.close_code == 4408


async def test_a_gateway_without_a_policy_refuses_the_route() -> None:
    with serve(Settings(engine="synthetic")) as server:
        async with connect(server.ws_url + ROUTE) as ws:
            assert error_code(await ws.recv()) == "robot_unavailable"
            await ws.wait_closed()
            assert ws.close_code == 4404


def test_the_load_test_robot_target_measures_inference_latency(robot_server: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "robot.json"
    command = [
        str(Path(sys.executable).with_name("omnigate-loadtest")),
        "run",
        robot_server.http_url,
        "--target",
        "robot",
        "--sessions",
        "2",
        "--duration",
        "2",
        "--warmup",
        "0",
        "--drain",
        "20",
        "--utterances-per-session",
        "8",
        "--control-rate",
        "20",
        "--robot-image-size",
        "64",
        "--quiet",
        "--out",
        str(out),
    ]
    subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    report = msgspec.json.decode(out.read_bytes(), type=LoadTestReport)
    (level,) = report.levels
    assert consistency_problems(level) == []
    assert level.utterances.completed >= 8 and level.ttfa_ms.count == level.utterances.completed
    # a slow shared machine may miss a 50 ms deadline; nothing else may go wrong
    assert set(level.errors) <= {"missed_deadline"}


async def test_sigterm_closes_idle_robots_typed_and_the_server_exits_cleanly(tmp_path: Path) -> None:
    args = ("--robot-model", "preset:tiny", "--robot-option", "threads=1")
    async with server_process(tmp_path, 30.0, args) as server:
        url = f"ws://127.0.0.1:{server.port}{ROUTE}"
        async with connect(url, max_size=None) as robot:
            metadata = openpi_unpack(await robot.recv())
            await robot.send(good_observation(metadata))
            assert "actions" in openpi_unpack(await robot.recv())  # answered: nothing in flight

            server.process.send_signal(signal.SIGTERM)

            error = await next_event(robot)
            assert (error["type"], error["code"]) == ("error", "shutting_down")
            assert await close_code(robot) == 1012
        async with connect(url) as refused:
            assert (await next_event(refused))["code"] == "shutting_down"
        assert await server.exit_code() == 0
    assert "1 sessions closed when idle, 0 at the deadline, 0 left" in server.log.read_text()
