"""Drives the gateway with the real ``openpi-client`` (run by the interpreter of its own venv: it pins numpy<2).

Usage: python openpi_client_run.py URL SCENARIO [API_KEY]; prints one JSON object. Imports nothing of omnigate.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from openpi_client import websocket_client_policy


def observation(metadata: dict, state_dtype: str = "float32") -> dict:
    spec = metadata["observation_spec"]
    obs: dict = {}
    for key, feature in spec.items():
        if feature["dtype"] == "str":
            obs[key] = "pick up the red block"
        elif feature["dtype"] == "uint8":
            obs[key] = np.full((120, 160, 3), 7, dtype=np.uint8)  # not the model's size: the server resizes
        else:
            obs[key] = np.linspace(-1, 1, feature["shape"][0]).astype(state_dtype)
    return obs


def main() -> None:
    url, scenario = sys.argv[1], sys.argv[2]
    api_key = sys.argv[3] if len(sys.argv) > 3 else None
    try:
        policy = websocket_client_policy.WebsocketClientPolicy(host=url, api_key=api_key)
    except Exception as exc:  # the handshake refused: report what the client raised
        print(json.dumps({"connect_error": type(exc).__name__, "detail": str(exc)}))
        return
    metadata = policy.get_server_metadata()
    out: dict = {"metadata": metadata, "replies": []}
    steps = [observation(metadata)] * 3
    if scenario == "bad-then-good":
        steps = [observation(metadata), observation(metadata, "int64"), observation(metadata)]
    for obs in steps:
        try:
            reply = policy.infer(obs)
        except RuntimeError as exc:
            out["replies"].append({"error": str(exc)})
            continue
        actions = reply["actions"]
        out["replies"].append(
            {
                "shape": list(actions.shape),
                "dtype": str(actions.dtype),
                "finite": bool(np.isfinite(actions).all()),
                "server_timing": reply["server_timing"],
            }
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
