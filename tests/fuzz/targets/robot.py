"""``WS /v1/realtime/robot/openpi``: binary msgpack observations (needs the server's robot policy: the fuzz server
loads ``preset:tiny``). Generated: valid observations, byte flips and cuts of them, random bytes, text, and the
msgpack bomb corpus (:mod:`omnigate.loadtest.msgpack_bombs`). The session runs latest-wins, so an observation is
never refused only for arriving while another is in flight: each message gets the answer its bytes deserve."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import msgpack
import numpy as np
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection

from omnigate.gateway.settings import Settings
from omnigate.loadtest.msgpack_bombs import corpus
from tests.fuzz.harness import ERROR, VALID, Expectation, FuzzMessage, WsTarget

ROUTE = "/v1/realtime/robot/openpi"
# preset:tiny's observation_spec (the probe fails loudly if it changes)
IMAGE_KEYS = ("observation/image", "observation/wrist_image")
IMAGE_SHAPE = (32, 32, 3)
STATE_KEY, STATE_DIM = "observation/state", 8
_SYNC = re.compile(r"'fuzz\.sync\.(\d+)'")
_FRAME_LIMIT = 256 * 1024  # the fuzz server's frame limit


def _array(value: np.ndarray[Any, Any]) -> dict[bytes, Any]:
    return {b"__ndarray__": True, b"data": value.tobytes(), b"dtype": value.dtype.str, b"shape": list(value.shape)}


def observation(seed: int, prompt: str = "fuzz") -> bytes:
    rng = np.random.default_rng(seed)
    body: dict[str, Any] = {key: _array(rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8)) for key in IMAGE_KEYS}
    body[STATE_KEY] = _array(rng.standard_normal(STATE_DIM).astype(np.float32))
    body["prompt"] = prompt
    packed: bytes = msgpack.packb(body)
    return packed


valid = st.builds(observation, st.integers(0, 2**16), st.text(max_size=40))


@st.composite
def flipped(draw: st.DrawFn) -> FuzzMessage:
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(1, 8))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return FuzzMessage(bytes(data), binary=True, label="flipped")


@st.composite
def cut(draw: st.DrawFn) -> FuzzMessage:
    data = draw(valid)
    return FuzzMessage(data[: draw(st.integers(0, len(data) - 1))], binary=True, label="cut")


BOMBS = [FuzzMessage(bomb.payload, binary=True, label=f"bomb:{bomb.name}") for bomb in corpus(_FRAME_LIMIT)]


class RobotTarget(WsTarget):
    name = "robot"
    path = ROUTE + "?on_busy=latest"

    def available(self, routes: frozenset[str]) -> bool:
        return ROUTE in routes

    def messages(self) -> st.SearchStrategy[FuzzMessage]:
        return st.one_of(
            valid.map(lambda data: FuzzMessage(data, binary=True, label="valid")),
            flipped(),
            cut(),
            st.binary(max_size=256).map(lambda data: FuzzMessage(data, binary=True, label="random")),
            st.text(max_size=64).map(lambda text: FuzzMessage.text(text, label="text")),
            st.sampled_from(BOMBS),
        )

    def expect(self, message: FuzzMessage, settings: Settings) -> Expectation:
        # A flip may land in image bytes and leave a valid observation; random bytes are never one (no image keys).
        return VALID if message.label in ("valid", "flipped") else ERROR

    def regressions(self) -> list[list[FuzzMessage]]:
        return [BOMBS, [BOMBS[0], FuzzMessage(observation(1), binary=True, label="valid")] * 3]

    def sync(self, n: int) -> FuzzMessage:
        # a dtype longer than any numpy type string is refused with the name in the message: one error naming n
        array = {b"__ndarray__": True, b"data": b"", b"dtype": f"fuzz.sync.{n}", b"shape": [0]}
        return FuzzMessage(msgpack.packb({"sync": array}), binary=True, label="sync")

    def sync_reply(self, event: dict[str, Any]) -> int | None:
        if event.get("type") != "error" or event.get("code") != "invalid_dtype":
            return None
        found = _SYNC.search(str(event.get("message", "")))
        return int(found.group(1)) if found else None

    def error_code(self, event: dict[str, Any]) -> str | None:
        assert event.get("type") == "error", event
        assert isinstance(event.get("code"), str) and event["code"], event
        assert isinstance(event.get("message"), str) and event["message"], event
        return str(event["code"])

    async def probe(self, ws: ClientConnection) -> None:
        """A valid observation is answered with actions (an earlier one's actions may come first: either shows the
        session serves; an error does not)."""
        await ws.send(observation(0, "probe"))
        async with asyncio.timeout(30.0):
            while True:
                message = await ws.recv()
                assert isinstance(message, bytes), f"the probe got {json.loads(message)}"
                if "actions" in msgpack.unpackb(message, strict_map_key=False):
                    return


TARGET = RobotTarget()
