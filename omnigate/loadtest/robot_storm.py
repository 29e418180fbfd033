"""A storm of robots that burst: each writes several messages in one TCP write, bombs and observations mixed, while
it keeps reading, and ``/health`` is polled throughout.

Each burst is the msgpack bomb corpus' bombs (:mod:`omnigate.loadtest.msgpack_bombs`, a seeded sample), then one
observation, then more observations sent before the first is answered. The robot route must answer every message
exactly once: each bomb with its typed refusal, the first observation with actions, each later one with actions or
``observation_in_flight`` (the documented refusal of a robot that does not wait). After its bursts each robot's
session must still serve an observation. The storm counts what came back, anything else as ``unexpected``, and
how long ``/health`` took (reported, not judged: a shared machine makes timings noisy).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import httpx
import msgspec
import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from omnigate.loadtest.msgpack_bombs import Bomb, corpus
from omnigate.loadtest.targets.robot import ROBOT_PATH, build_observation, pack, unpack

READ_LIMIT_S = 60.0
HEALTH_EVERY_S = 0.05
IN_FLIGHT = "observation_in_flight"


class RobotStormResult(msgspec.Struct):
    """What the robots sent and got back, and how ``/health`` fared meanwhile."""

    robots: int = 0
    messages: int = 0
    actions: int = 0
    refusals: dict[str, int] = msgspec.field(default_factory=dict)
    unexpected: dict[str, int] = msgspec.field(default_factory=dict)
    health_checks: int = 0
    health_failures: int = 0
    health_max_ms: float = 0.0


class _Unexpected(Exception):
    """An answer the burst does not allow (a wrong code, a close, actions for a bomb)."""


def _burst(bombs: list[Bomb], observation: bytes, extra_observations: int) -> list[tuple[bytes, str | None]]:
    """The messages, each with the refusal code it must get (None: an observation)."""
    messages: list[tuple[bytes, str | None]] = [(bomb.payload, bomb.code) for bomb in bombs]
    return messages + [(observation, None)] * (1 + extra_observations)


def _write_at_once(ws: ClientConnection, payloads: list[bytes]) -> None:
    """Every message in one TCP write: the server has them all before it answers the first."""
    for payload in payloads:
        ws.protocol.send_binary(payload)
    ws.transport.write(b"".join(ws.protocol.data_to_send()))


async def _answers(ws: ClientConnection, expected: list[str | None], refusals: Counter[str]) -> int:
    """Read one answer per message and check it; returns the actions received."""
    actions = 0
    observations_open = sum(1 for code in expected if code is None)
    bombs_open = Counter(code for code in expected if code is not None)
    async with asyncio.timeout(READ_LIMIT_S):
        for _ in expected:
            message = await ws.recv()
            if isinstance(message, bytes):
                if observations_open == 0 or "actions" not in unpack(message):
                    raise _Unexpected("actions_not_asked_for")
                actions += 1
                observations_open -= 1
                continue
            code = str(json.loads(message).get("code"))
            refusals[code] += 1
            if code == IN_FLIGHT and observations_open > 1:
                observations_open -= 1
            elif bombs_open[code] > 0:
                bombs_open[code] -= 1
            else:
                raise _Unexpected(f"error:{code}")
    if actions == 0:
        raise _Unexpected("no_actions")
    return actions


async def _robot(
    url: str,
    rng: random.Random,
    shape: tuple[int, int, int],
    refusals: Counter[str],
    headers: dict[str, str] | None,
) -> tuple[int, int]:
    """One robot's bursts and its closing probe; returns (messages sent, actions received)."""
    bursts, bombs_per_burst, extra = shape
    sent = actions = 0
    # Connected as openpi-client connects (compression=None, max_size=None): what real robots offer.
    async with connect(url, max_size=None, compression=None, additional_headers=headers) as ws:
        first = await asyncio.wait_for(ws.recv(), READ_LIMIT_S)
        if not isinstance(first, bytes):
            raise _Unexpected("no_metadata")
        metadata = unpack(first)
        spec = metadata["observation_spec"]
        body: dict[str, Any] = build_observation(spec, None, np.random.default_rng(rng.randrange(2**32)))
        body.update({key: "burst" for key, feature in spec.items() if feature["dtype"] == "str"})
        observation = pack(body)
        hostile = corpus()
        for _ in range(bursts):
            messages = _burst(rng.sample(hostile, min(bombs_per_burst, len(hostile))), observation, extra)
            _write_at_once(ws, [payload for payload, _ in messages])
            sent += len(messages)
            actions += await _answers(ws, [code for _, code in messages], refusals)
        await ws.send(observation)  # the session goes on
        sent += 1
        actions += await _answers(ws, [None], refusals)
    return sent, actions


async def run_robot_storm(
    base_url: str,
    robots: int,
    *,
    bursts: int = 3,
    bombs_per_burst: int = 4,
    extra_observations: int = 5,
    seed: int = 0,
    headers: dict[str, str] | None = None,
) -> RobotStormResult:
    """``robots`` robots at once, each sending ``bursts`` bursts, while ``/health`` is polled."""
    rng = random.Random(seed)
    url = base_url.replace("http://", "ws://").replace("https://", "wss://") + ROBOT_PATH
    result = RobotStormResult(robots=robots)
    refusals: Counter[str] = Counter()
    unexpected: Counter[str] = Counter()
    done = asyncio.Event()

    async def robot(robot_rng: random.Random) -> None:
        try:
            shape = (bursts, bombs_per_burst, extra_observations)
            sent, actions = await _robot(url, robot_rng, shape, refusals, headers)
            result.messages += sent
            result.actions += actions
        except _Unexpected as exc:
            unexpected[str(exc)] += 1
        except (WebSocketException, OSError, TimeoutError) as exc:
            unexpected[type(exc).__name__] += 1

    async def health(client: httpx.AsyncClient) -> None:
        while not done.is_set():
            started = time.perf_counter()
            try:
                ok = (await client.get("/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            result.health_checks += 1
            result.health_failures += not ok
            result.health_max_ms = max(result.health_max_ms, (time.perf_counter() - started) * 1000.0)
            await asyncio.sleep(HEALTH_EVERY_S)

    async with httpx.AsyncClient(base_url=base_url, timeout=READ_LIMIT_S, headers=headers) as client:
        poller = asyncio.create_task(health(client), name="robot-storm-health")
        try:
            await asyncio.gather(*(robot(random.Random(rng.randrange(2**32))) for _ in range(robots)))
        finally:
            done.set()
            await poller
    result.refusals = dict(sorted(refusals.items()))
    result.unexpected = dict(sorted(unexpected.items()))
    return result
