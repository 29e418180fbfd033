"""``WS /v1/realtime/robot/openpi`` under attack and under faults, on the real server with real websocket clients:
msgpack bombs are refused by their budget off the event loop, a burst is answered instead of disconnected, and a
task of the session that fails ends it typed with everything released."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.websockets import WebSocket
from websockets.asyncio.client import ClientConnection

from omnigate.engines.policy.spec import MAX_PROMPT_CHARS, Observation, PolicyInfo
from omnigate.engines.policy.wire import MAX_NESTING, MAX_OBJECTS
from omnigate.gateway.robot import decode, stream
from tests.integration.test_robot_policy import (
    error_code,
    good_observation,
    open_robot,
    openpi_pack,
    openpi_unpack,
    robot_settings,
    wait_for_server,
)
from tests.serving import RunningServer, serve

READ_LIMIT_S = 30.0  # a read that waits this long waits on something that died


@pytest.fixture(scope="module")
def robot_server() -> Iterator[RunningServer]:
    with serve(robot_settings()) as server:
        yield server


def empty_map_bomb() -> bytes:
    """1.9 MB holding 1.8 M empty maps, in arrays of 64 (each container within msgpack's per-container limits)."""
    leaf = b"\xdc\x00\x40" + b"\x80" * 64
    mid = b"\xdc\x00\x40" + leaf * 64
    top = b"\xdc\x00\x40" + mid * 64
    return b"\x87" + b"".join(bytes([0xA1, 0x61 + i]) + top for i in range(7))


async def recv(ws: ClientConnection) -> str | bytes:
    async with asyncio.timeout(READ_LIMIT_S):
        return await ws.recv()


async def closed_with(ws: ClientConnection) -> tuple[int, str]:
    async with asyncio.timeout(READ_LIMIT_S):
        await ws.wait_closed()
    assert ws.close_code is not None
    return ws.close_code, ws.close_reason or ""


def body(message: str | bytes) -> dict[str, Any]:
    assert isinstance(message, str), f"expected a text refusal, got {len(message)} bytes"
    parsed: dict[str, Any] = json.loads(message)
    return parsed


def assert_actions(message: str | bytes) -> None:
    assert isinstance(message, bytes), f"expected actions, got {message!r}"
    assert "actions" in openpi_unpack(message)


def everything_released(server: RunningServer) -> None:
    wait_for_server(server, lambda pool: pool.active == 0 and server.gateway.registry.total_active == 0)


async def a_new_session_is_served(server: RunningServer) -> None:
    ws, metadata = await open_robot(server)
    await ws.send(good_observation(metadata))
    assert_actions(await recv(ws))
    await ws.close()


class HeldStep:
    """Holds the policy's step until released, so an observation stays in flight for as long as a test needs."""

    def __init__(self, server: RunningServer) -> None:
        pool = server.gateway.robot_pool
        assert pool is not None
        self.pool = pool
        self.gate = threading.Event()
        self.step = pool.engine.step

    def __enter__(self) -> HeldStep:
        def held(streams: Any) -> Any:
            self.gate.wait(READ_LIMIT_S)
            return self.step(streams)

        self.pool.engine.step = held  # type: ignore[method-assign]
        return self

    def __exit__(self, *_: object) -> None:
        self.pool.engine.step = self.step  # type: ignore[method-assign]
        self.gate.set()


# ---- (a) untrusted bytes: off the loop, on the robot's own pool, under a budget -----------------------------------


async def test_a_million_empty_maps_are_refused_by_the_object_budget(robot_server: RunningServer) -> None:
    ws, metadata = await open_robot(robot_server)
    bomb = empty_map_bomb()
    assert len(bomb) > 1_900_000
    await ws.send(bomb)
    refusal = body(await recv(ws))
    assert refusal["code"] == "too_many_objects" and str(MAX_OBJECTS) in refusal["message"]
    await ws.send(good_observation(metadata))
    assert_actions(await recv(ws))
    await ws.close()


async def test_observations_are_decoded_on_the_robot_pool_while_the_loop_serves_others(
    robot_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode held on its thread holds neither /health nor another robot's observation."""
    threads: list[str] = []
    entered = threading.Event()
    release = threading.Event()
    real = decode.decode_observation

    def held(info: PolicyInfo, payload: bytes, max_bytes: int) -> Observation:
        threads.append(threading.current_thread().name)
        if len(threads) == 1:
            entered.set()
            release.wait(READ_LIMIT_S)
        return real(info, payload, max_bytes)

    monkeypatch.setattr(decode, "decode_observation", held)
    slow, metadata = await open_robot(robot_server)
    observation = good_observation(metadata)
    await slow.send(observation)
    await asyncio.to_thread(entered.wait, READ_LIMIT_S)
    try:
        async with httpx.AsyncClient(timeout=READ_LIMIT_S) as client:
            assert (await client.get(robot_server.http_url + "/health")).status_code == 200
        await a_new_session_is_served(robot_server)
    finally:
        release.set()
    assert_actions(await recv(slow))
    await slow.close()
    assert threads and all(name.startswith("omnigate-robot-decode") for name in threads), threads


async def test_a_flood_past_the_decoders_is_refused_typed_not_queued(
    robot_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoder = robot_server.gateway.robot_decoder
    assert decoder is not None
    started = threading.Semaphore(0)
    release = threading.Event()
    real = decode.decode_observation

    def held(info: PolicyInfo, payload: bytes, max_bytes: int) -> Observation:
        started.release()
        release.wait(READ_LIMIT_S)
        return real(info, payload, max_bytes)

    monkeypatch.setattr(decode, "decode_observation", held)
    robots = [await open_robot(robot_server) for _ in range(decoder.max_pending + 1)]
    try:
        for ws, metadata in robots[:-1]:
            await ws.send(good_observation(metadata))
        for _ in range(decoder.threads):  # every decoding thread holds one; the rest wait in their slots
            assert await asyncio.to_thread(started.acquire, True, READ_LIMIT_S)
        last, metadata = robots[-1]
        await last.send(good_observation(metadata))
        assert error_code(await recv(last)) == "server_busy"
    finally:
        release.set()
    for ws, _ in robots[:-1]:
        assert_actions(await recv(ws))
    await last.send(good_observation(metadata))  # the slots are free again
    assert_actions(await recv(last))
    for ws, _ in robots:
        await ws.close()


async def test_prompt_and_nesting_refusals_say_what_is_wrong(robot_server: RunningServer) -> None:
    ws, metadata = await open_robot(robot_server)
    observation = openpi_unpack(good_observation(metadata))
    observation["prompt"] = "x" * (MAX_PROMPT_CHARS + 1)
    await ws.send(openpi_pack(observation))
    too_long = body(await recv(ws))
    assert (too_long["code"], too_long["param"]) == ("invalid_value", "prompt")
    for bomb in (b"\x91" * 5000 + b"\xc0", b"\x81\xa1k" * 5000 + b"\xc0"):
        await ws.send(bomb)
        refusal = body(await recv(ws))
        assert refusal["code"] == "too_deeply_nested" and str(MAX_NESTING) in refusal["message"]
    await ws.send(good_observation(metadata))
    assert_actions(await recv(ws))
    await ws.close()


# ---- (c) a burst is answered, not disconnected ---------------------------------------------------------------------


async def test_a_burst_in_one_write_is_refused_typed_and_the_first_observation_answered(
    robot_server: RunningServer,
) -> None:
    ws, metadata = await open_robot(robot_server)
    observation = good_observation(metadata)
    with HeldStep(robot_server) as held:
        # Six observations in one TCP write: the server has them all queued before its reader looks at the first.
        for _ in range(6):
            ws.protocol.send_binary(observation)
        ws.transport.write(b"".join(ws.protocol.data_to_send()))
        for _ in range(5):
            assert error_code(await recv(ws)) == "observation_in_flight"
        held.gate.set()
        assert_actions(await recv(ws))
    await ws.send(observation)  # the session goes on
    assert_actions(await recv(ws))
    await ws.close()


# ---- (b) a task of the session that fails ends it typed, and releases everything ---------------------------------


async def ended_typed(ws: ClientConnection, code: str = "internal_error", close: int = 1011) -> None:
    assert body(await recv(ws))["code"] == code
    assert (await closed_with(ws))[0] == close


async def test_a_failing_reader_ends_the_session_typed(
    robot_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = robot_server.gateway.robot_pool
    assert pool is not None

    def crash(*_: object) -> bool:
        raise RuntimeError("injected")

    ws, metadata = await open_robot(robot_server)
    monkeypatch.setattr(pool, "submit", crash)
    await ws.send(good_observation(metadata))
    await ended_typed(ws)
    monkeypatch.undo()
    everything_released(robot_server)
    await a_new_session_is_served(robot_server)


async def test_a_failing_reply_ends_the_session_typed(
    robot_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(_: object) -> bytes:
        raise RuntimeError("injected")

    ws, metadata = await open_robot(robot_server)
    monkeypatch.setattr(stream, "pack", crash)
    await ws.send(good_observation(metadata))
    await ended_typed(ws)
    monkeypatch.undo()
    everything_released(robot_server)
    await a_new_session_is_served(robot_server)


async def test_a_failing_sender_ends_the_session_typed(
    robot_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def crash(self: WebSocket, data: bytes) -> None:
        raise ValueError("injected")

    ws, metadata = await open_robot(robot_server)
    monkeypatch.setattr(WebSocket, "send_bytes", crash)
    await ws.send(good_observation(metadata))
    await ended_typed(ws)
    monkeypatch.undo()
    everything_released(robot_server)
    await a_new_session_is_served(robot_server)


async def test_a_crashed_policy_step_answers_its_observations_typed(
    robot_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = robot_server.gateway.robot_pool
    assert pool is not None

    def crash(_seconds: float, _batch: int) -> None:
        raise RuntimeError("injected")

    ws, metadata = await open_robot(robot_server)
    monkeypatch.setattr(pool, "_step_observer", crash)
    await ws.send(good_observation(metadata))
    assert error_code(await recv(ws)) == "engine_error"
    monkeypatch.undo()
    await ws.send(good_observation(metadata))  # the session goes on
    assert_actions(await recv(ws))
    await ws.close()
    everything_released(robot_server)


async def test_a_client_that_stops_reading_is_closed_stalled_and_released() -> None:
    """The reader waits for its refusals to go out, so a client that never reads must still be closed (by the
    sender's stall timeout), not left waiting with the reader."""
    with serve(robot_settings(stall_timeout_s=0.5)) as server:
        ws, _ = await open_robot(server)
        ws.transport.pause_reading()  # the client stops reading; the server's refusals pile up in the buffers
        for _ in range(20_000):
            ws.protocol.send_text(b"not an observation")
        ws.transport.write(b"".join(ws.protocol.data_to_send()))
        everything_released(server)
        ws.transport.abort()
