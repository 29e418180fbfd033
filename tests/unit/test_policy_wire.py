"""openpi's msgpack-numpy wire: what decodes, and the typed refusal of everything else (no pickle, limits)."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import numpy as np
import pytest

from omnigate.engines.policy.wire import WireError, pack, unpack

LIMIT = 1024 * 1024


def openpi_pack(obj: Any) -> bytes:
    """openpi_client.msgpack_numpy.packb, as its source writes it."""

    def default(o: Any) -> Any:
        if isinstance(o, np.ndarray):
            return {b"__ndarray__": True, b"data": o.tobytes(), b"dtype": o.dtype.str, b"shape": o.shape}
        if isinstance(o, np.generic):
            return {b"__npgeneric__": True, b"data": o.item(), b"dtype": o.dtype.str}
        return o

    packed: bytes = msgpack.packb(obj, default=default)
    return packed


def array_map(data: bytes, dtype: str, shape: list[int]) -> dict[bytes, Any]:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def code_of(payload: bytes, limit: int = LIMIT) -> str:
    with pytest.raises(WireError) as caught:
        unpack(payload, limit)
    return caught.value.code


def test_openpi_arrays_scalars_and_nested_maps_decode() -> None:
    image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    state = np.array([0.5, -1.0], dtype=np.float64)
    payload = openpi_pack(
        {"observation/image": image, "state": state, "step": np.int32(7), "prompt": "go", "images": {"top": image}}
    )
    decoded = unpack(payload, LIMIT)
    assert np.array_equal(decoded["observation/image"], image)
    assert decoded["state"].dtype == np.float64
    assert np.array_equal(decoded["state"], state)
    assert decoded["step"] == np.int32(7)
    assert decoded["prompt"] == "go"
    assert np.array_equal(decoded["images/top"], image)  # ALOHA-style nesting becomes a slash-joined key


def test_pack_is_what_openpi_unpacks() -> None:
    actions = np.ones((3, 2), dtype=np.float32)
    raw = msgpack.unpackb(pack({"actions": actions, "server_timing": {"infer_ms": 1.5}}))
    encoded = raw["actions"]
    assert encoded[b"__ndarray__"] is True
    assert np.array_equal(
        np.ndarray(buffer=encoded[b"data"], dtype=encoded[b"dtype"], shape=encoded[b"shape"]), actions
    )
    assert raw["server_timing"] == {"infer_ms": 1.5}


@pytest.mark.parametrize("dtype", ["|O", "|V8", "<c8", "<M8[s]", "<U4", "[('a', '<f4')]", 7])
def test_non_numeric_dtypes_are_refused(dtype: Any) -> None:
    payload = msgpack.packb({"x": array_map(b"\0" * 8, dtype, [1])})
    assert code_of(payload) == "invalid_dtype"


def test_object_array_pickle_is_never_loaded() -> None:
    # An object array's bytes would be pointers; a pickled payload is not msgpack at all.
    assert code_of(msgpack.packb({"x": array_map(pickle.dumps(object()), "|O", [1])})) == "invalid_dtype"
    assert code_of(pickle.dumps({"x": np.zeros(3)})) in {"invalid_msgpack", "invalid_observation"}


@pytest.mark.parametrize(
    ("data", "shape", "code"),
    [
        (b"\0" * 7, [2], "invalid_array"),  # bytes do not fill the shape
        (b"\0" * 8, [-2], "invalid_shape"),
        (b"\0" * 8, [1, 1, 1, 1, 1, 1, 1, 1, 2], "invalid_shape"),
        (b"\0" * 8, "2", "invalid_shape"),
        ("text", [1], "invalid_array"),
    ],
)
def test_arrays_whose_bytes_and_shape_disagree_are_refused(data: Any, shape: Any, code: str) -> None:
    assert code_of(msgpack.packb({"x": array_map(data, "<f4", shape)})) == code


def test_malformed_oversized_and_non_map_payloads_are_refused() -> None:
    assert code_of(b"\xc1garbage") == "invalid_msgpack"
    assert code_of(msgpack.packb([1, 2, 3])) == "invalid_observation"
    assert code_of(msgpack.packb({1: 2})) == "invalid_observation"
    assert code_of(msgpack.packb({"x": msgpack.ExtType(1, b"abc")})) == "invalid_msgpack"
    assert code_of(openpi_pack({"x": np.zeros(100, np.uint8)}), limit=64) == "payload_too_large"
    deep: dict[str, Any] = {"x": 1}
    for _ in range(8):
        deep = {"k": deep}
    assert code_of(msgpack.packb(deep)) == "invalid_observation"
