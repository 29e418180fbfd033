"""``robot``: simulated robots on openpi's websocket policy protocol, ``WS /v1/realtime/robot/openpi``.

Each session is one robot, connected as openpi-client connects (binary msgpack, ``Authorization: Api-Key`` when a
key is set) with its control rate declared in the URL. It reads the policy's metadata, builds observations from
its ``observation_spec`` (random uint8 cameras of ``--robot-image-size`` pixels, or the spec's own size, the state,
and the session's texts as prompts), then runs its control loop: at each tick one observation, sent only after the
previous one was answered, as openpi's synchronous client does. Each tick is one utterance of the trace: its TTFA is
the inference latency (observation sent to actions received). A reply that comes after the next tick was due is a
missed control deadline, counted as the error ``missed_deadline``; a text reply is the server's typed refusal.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import msgpack
import numpy as np
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from omnigate.loadtest.targets.base import Target, ws_url
from omnigate.loadtest.targets.ws_connect import connect_traced
from omnigate.loadtest.traces import SessionTrace

ROBOT_PATH = "/v1/realtime/robot/openpi"


def _pack_default(obj: Any) -> Any:
    # openpi_client.msgpack_numpy's array encoding (the load test carries its own copy of the wire)
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    raise TypeError(f"cannot pack {type(obj).__name__}")


def pack(observation: dict[str, Any]) -> bytes:
    """An observation as openpi-client packs it."""
    packed: bytes = msgpack.packb(observation, default=_pack_default)
    return packed


def _unpack_hook(obj: dict[Any, Any]) -> Any:
    if b"__ndarray__" in obj:
        return np.frombuffer(obj[b"data"], dtype=np.dtype(obj[b"dtype"])).reshape(obj[b"shape"])
    return obj


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, object_hook=_unpack_hook, strict_map_key=False)


def build_observation(spec: dict[str, Any], image_px: int | None, rng: np.random.Generator) -> dict[str, Any]:
    """Arrays for every key of the metadata's ``observation_spec`` (the prompt is set per tick)."""
    observation: dict[str, Any] = {}
    for key, feature in spec.items():
        dtype, shape = feature["dtype"], list(feature["shape"])
        if dtype == "str":
            continue
        if dtype == "uint8" and len(shape) == 3 and image_px is not None:
            shape = [image_px, image_px, shape[2]]
        if dtype == "uint8":
            observation[key] = rng.integers(0, 256, shape, dtype=np.uint8)
        else:
            observation[key] = rng.standard_normal(shape).astype(dtype)
    return observation


class RobotTarget(Target):
    kind = "robot"

    def session_url(self) -> str:
        base = urlsplit(ws_url(self.spec.url, ROBOT_PATH))
        query = urlencode({"control_rate_hz": f"{self.settings.control_rate_hz:g}"})
        return urlunsplit((base.scheme, base.netloc, base.path, query, ""))

    def auth_headers(self) -> dict[str, str]:
        """openpi-client's header form, ``Authorization: Api-Key KEY``."""
        headers = super().auth_headers()
        if "Authorization" in headers:
            headers["Authorization"] = "Api-Key " + headers["Authorization"].removeprefix("Bearer ")
        return headers

    async def run_session(self, texts: Sequence[str], trace: SessionTrace) -> None:
        # openpi-client connects with compression=None, so robots offer no permessage-deflate whatever the default.
        connection = await connect_traced(
            self.session_url(), self.settings.connect_timeout_s, trace, self.auth_headers(), compression=False
        )
        if connection is None:
            return
        async with connection:
            try:
                await self._control_loop(connection, texts, trace)
            except ConnectionClosed as exc:
                trace.error("connection_closed", str(exc))
            except TimeoutError:
                trace.error("reply_timeout")

    async def _control_loop(self, connection: ClientConnection, texts: Sequence[str], trace: SessionTrace) -> None:
        first = await asyncio.wait_for(connection.recv(), self.settings.connect_timeout_s)
        metadata = unpack(first) if isinstance(first, bytes) else None
        if not isinstance(metadata, dict) or not isinstance(metadata.get("observation_spec"), dict):
            trace.error("invalid_metadata", str(first)[:200])
            return
        spec = metadata["observation_spec"]
        prompt_keys = [key for key, feature in spec.items() if feature.get("dtype") == "str"]
        horizon, dim = metadata.get("action_horizon"), metadata.get("action_dim")
        observation = build_observation(spec, self.settings.robot_image_px, np.random.default_rng(trace.session_id))
        period = 1.0 / self.settings.control_rate_hz
        tick = time.perf_counter()
        for text in texts:
            await asyncio.sleep(max(0.0, tick - time.perf_counter()))
            payload = pack({**observation, **dict.fromkeys(prompt_keys, text)})
            sent = time.perf_counter()
            utterance = trace.begin_utterance(sent, text)
            await connection.send(payload)
            utterance.text_sent(time.perf_counter(), len(text))
            reply = await asyncio.wait_for(connection.recv(), self.settings.utterance_timeout_s)
            now = time.perf_counter()
            if isinstance(reply, str):
                code = _error_code(reply)
                trace.error(code, reply)
                utterance.finish(now, "failed")
            else:
                utterance.audio(now, len(reply))
                actions = unpack(reply).get("actions")
                if not isinstance(actions, np.ndarray) or list(actions.shape) != [horizon, dim]:
                    trace.error("invalid_actions", f"expected actions of shape [{horizon}, {dim}]")
                    utterance.finish(now, "failed")
                else:
                    utterance.finish(now, "completed")
            tick += period
            if now > tick:
                # The next observation was due before these actions came: the robot missed a control deadline.
                trace.error("missed_deadline", f"a reply took {(now - sent) * 1000:.0f} ms at {1 / period:g} Hz")
                tick = now
        await connection.close()


def _error_code(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return "text_reply"
    code = body.get("code") if isinstance(body, dict) else None
    return str(code) if code else "text_reply"
