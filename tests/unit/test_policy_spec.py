"""Observation checks against the policy's spec: each problem is a typed refusal naming the key."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from omnigate.engines.policy.spec import PolicyInfo, check_observation
from omnigate.engines.policy.wire import WireError

INFO = PolicyInfo(
    model="test",
    random_weights=True,
    image_keys=("observation/image",),
    state_key="observation/state",
    prompt_key="prompt",
    image_size=32,
    state_dim=8,
    max_state_dim=32,
    action_horizon=10,
    action_dim=7,
    flow_steps=4,
    control_rate_hz=10.0,
    max_sessions=4,
    max_batch=4,
)


def observation(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "observation/image": np.zeros((48, 64, 3), np.uint8),
        "observation/state": np.zeros(8, np.float64),
        "prompt": "pick",
        "extra/ignored": 1,
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def refusal(raw: dict[str, Any]) -> tuple[str, str | None]:
    with pytest.raises(WireError) as caught:
        check_observation(INFO, raw)
    return caught.value.code, caught.value.param


def test_a_good_observation_is_accepted_and_normalized() -> None:
    checked = check_observation(INFO, observation(**{"observation/image": np.zeros((3, 20, 30), np.uint8)}))
    assert checked.images[0].shape == (20, 30, 3)  # channels-first is transposed
    assert checked.state.dtype == np.float32
    assert checked.prompt == "pick"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"prompt": None}, ("missing_key", "prompt")),
        ({"observation/image": None}, ("missing_key", "observation/image")),
        ({"observation/image": np.zeros((8, 8, 3), np.float32)}, ("invalid_dtype", "observation/image")),
        ({"observation/image": np.zeros((8, 8), np.uint8)}, ("invalid_shape", "observation/image")),
        ({"observation/image": np.zeros((8, 8, 4), np.uint8)}, ("invalid_shape", "observation/image")),
        ({"observation/image": np.zeros((4096, 8, 3), np.uint8)}, ("invalid_shape", "observation/image")),
        ({"observation/image": "not an image"}, ("invalid_observation", "observation/image")),
        ({"observation/state": np.zeros(8, np.int64)}, ("invalid_dtype", "observation/state")),
        ({"observation/state": np.zeros(33, np.float32)}, ("invalid_shape", "observation/state")),
        ({"observation/state": np.zeros((2, 4), np.float32)}, ("invalid_shape", "observation/state")),
        ({"observation/state": np.array([np.nan] * 8)}, ("invalid_value", "observation/state")),
        ({"prompt": 3}, ("invalid_observation", "prompt")),
        ({"prompt": "x" * 2049}, ("invalid_value", "prompt")),
    ],
)
def test_each_problem_is_refused_by_name(changes: dict[str, Any], expected: tuple[str, str]) -> None:
    assert refusal(observation(**changes)) == expected


def test_metadata_describes_every_key() -> None:
    metadata = INFO.metadata()
    assert metadata["observation_spec"] == {
        "observation/image": {"dtype": "uint8", "shape": [32, 32, 3]},
        "observation/state": {"dtype": "float32", "shape": [8]},
        "prompt": {"dtype": "str", "shape": []},
    }
    assert (metadata["action_horizon"], metadata["action_dim"], metadata["control_rate_hz"]) == (10, 7, 10.0)
