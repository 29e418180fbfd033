"""What a policy takes and gives: its observation spec, the metadata sent on connect, and observation checks.

Checks are sans-I/O: a decoded observation (see :mod:`omnigate.engines.policy.wire`) either becomes an
:class:`Observation` the engine can batch, or raises :class:`~omnigate.engines.policy.wire.WireError` naming the
offending key, which the route sends back as a text message while the session goes on.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from omnigate.engines.policy.wire import WireError

MAX_IMAGE_SIDE = 2048
MAX_PROMPT_CHARS = 2048


class FeatureSpec(msgspec.Struct, frozen=True):
    """One observation key: its numpy dtype string (``"str"`` for text) and shape (``[]`` for a scalar)."""

    dtype: str
    shape: tuple[int, ...] = ()


class PolicyInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Static facts about a loaded policy; :meth:`metadata` is what a client receives on connect."""

    family: str = "policy"
    model: str
    random_weights: bool
    image_keys: tuple[str, ...]
    state_key: str
    prompt_key: str
    image_size: int
    state_dim: int
    max_state_dim: int
    action_horizon: int
    action_dim: int
    flow_steps: int
    control_rate_hz: float
    max_sessions: int
    max_batch: int
    device: str = "cpu"

    def observation_spec(self) -> dict[str, FeatureSpec]:
        spec = {key: FeatureSpec("uint8", (self.image_size, self.image_size, 3)) for key in self.image_keys}
        spec[self.state_key] = FeatureSpec("float32", (self.state_dim,))
        spec[self.prompt_key] = FeatureSpec("str")
        return spec

    def metadata(self) -> dict[str, Any]:
        """The policy described so a client can build observations without reading code."""
        return {
            "model": self.model,
            "random_weights": self.random_weights,
            "observation_spec": {
                key: {"dtype": feature.dtype, "shape": list(feature.shape)}
                for key, feature in self.observation_spec().items()
            },
            "observation_notes": (
                f"images: uint8, HxWx3 or 3xHxW, any size up to {MAX_IMAGE_SIDE} px a side (resized with padding "
                f"to {self.image_size}); state: float, 1 to {self.max_state_dim} values (zero-padded)"
            ),
            "action_horizon": self.action_horizon,
            "action_dim": self.action_dim,
            "action_dtype": "float32",
            "flow_steps": self.flow_steps,
            "control_rate_hz": self.control_rate_hz,
        }


class Observation(msgspec.Struct):
    """One checked observation: images HxWx3 uint8 in ``image_keys`` order, the state as float32, the prompt."""

    images: list[np.ndarray[Any, Any]]
    state: np.ndarray[Any, Any]
    prompt: str


class PolicyResult(msgspec.Struct):
    """One observation's answer: ``actions`` (action_horizon x action_dim, float32) and the step's duration."""

    actions: np.ndarray[Any, Any]
    infer_ms: float
    batch_size: int


class PolicyStream:
    """One robot session as the engine sees it: the observation the next step serves (set by the scheduler)."""

    def __init__(self) -> None:
        self.observation: Observation | None = None


def _image(key: str, value: object) -> np.ndarray[Any, Any]:
    if not isinstance(value, np.ndarray):
        raise WireError("invalid_observation", f"{key} must be a numpy array (uint8 HxWx3)", key)
    if value.dtype != np.uint8:
        raise WireError("invalid_dtype", f"{key} must be uint8, got {value.dtype}", key)
    if value.ndim != 3 or 3 not in (value.shape[0], value.shape[2]):
        raise WireError("invalid_shape", f"{key} must be HxWx3 or 3xHxW, got shape {list(value.shape)}", key)
    if value.shape[2] != 3:  # channels first (LeRobot's layout)
        value = value.transpose(1, 2, 0)
    height, width = value.shape[0], value.shape[1]
    if not (0 < height <= MAX_IMAGE_SIDE and 0 < width <= MAX_IMAGE_SIDE):
        raise WireError("invalid_shape", f"{key} must be 1 to {MAX_IMAGE_SIDE} px a side, got {height}x{width}", key)
    return value


def _state(info: PolicyInfo, value: Any) -> np.ndarray[Any, Any]:
    key = info.state_key
    if not isinstance(value, np.ndarray):
        raise WireError("invalid_observation", f"{key} must be a numpy float array", key)
    if value.dtype.kind != "f":
        raise WireError("invalid_dtype", f"{key} must be a float array, got {value.dtype}", key)
    if value.ndim != 1 or not 0 < value.shape[0] <= info.max_state_dim:
        raise WireError(
            "invalid_shape", f"{key} must be 1-D with 1 to {info.max_state_dim} values, got {list(value.shape)}", key
        )
    state = value.astype(np.float32)
    if not np.isfinite(state).all():
        raise WireError("invalid_value", f"{key} holds NaN or infinite values", key)
    return state


def check_observation(info: PolicyInfo, raw: dict[str, Any]) -> Observation:
    """The observation the policy serves, or a :class:`WireError` naming what is wrong. Extra keys are ignored."""
    missing = [key for key in (*info.image_keys, info.state_key, info.prompt_key) if key not in raw]
    if missing:
        raise WireError("missing_key", f"the observation lacks {', '.join(missing)} (see observation_spec)", missing[0])
    prompt = raw[info.prompt_key]
    if not isinstance(prompt, str):
        raise WireError("invalid_observation", f"{info.prompt_key} must be a string", info.prompt_key)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise WireError(
            "invalid_value", f"{info.prompt_key} is longer than {MAX_PROMPT_CHARS} characters", info.prompt_key
        )
    images = [_image(key, raw[key]) for key in info.image_keys]
    return Observation(images=images, state=_state(info, raw[info.state_key]), prompt=prompt)
