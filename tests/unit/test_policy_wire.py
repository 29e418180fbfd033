"""openpi's msgpack-numpy wire: what decodes, and the typed refusal of everything else (no pickle, limits)."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import numpy as np
import pytest

from omnigate.engines.policy.wire import MAX_DEPTH, MAX_NESTING, MAX_OBJECTS, WireError, check_budget, pack, unpack

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
    for _ in range(MAX_DEPTH + 1):
        deep = {"k": deep}
    assert code_of(msgpack.packb(deep)) == "invalid_observation"  # within the budget, deeper than observations go


# ---- the budget, checked before anything is built ----------------------------------------------------------------


def empty_map_bomb(keys: int) -> bytes:
    """A map of ``keys`` keys, each holding 262,144 empty maps (one byte each) in arrays of 64: 0.95 maps a byte,
    each container within msgpack's per-container limits."""
    leaf = b"\xdc\x00\x40" + b"\x80" * 64
    mid = b"\xdc\x00\x40" + leaf * 64
    top = b"\xdc\x00\x40" + mid * 64
    return bytes([0x80 | keys]) + b"".join(bytes([0xA1, 0x61 + i]) + top for i in range(keys))


def message_of(payload: bytes) -> str:
    with pytest.raises(WireError) as caught:
        unpack(payload, 4 * LIMIT)
    return f"{caught.value.code}: {caught.value.message}"


def test_a_message_of_a_million_empty_maps_is_refused_by_its_object_count() -> None:
    bomb = empty_map_bomb(7)
    assert len(bomb) == 1_922_404  # 1.8 M empty maps
    assert message_of(bomb).startswith(f"too_many_objects: the message holds more than {MAX_OBJECTS}")
    with pytest.raises(WireError):
        check_budget(bomb)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"\x91" * 2000 + b"\xc0", f"too_deeply_nested: the message nests containers deeper than {MAX_NESTING}"),
        (b"\x81\xa1k" * 2000 + b"\xc0", f"too_deeply_nested: the message nests containers deeper than {MAX_NESTING}"),
        (b"\x81\xa1k\xc6\xff\xff\xff\xff", "invalid_msgpack: not a msgpack message: a declared length runs past"),
        (b"\x81\xa1k\xdd\xff\xff\xff\xff\xc0", "invalid_msgpack: not a msgpack message: a declared length"),
        (b"\xdf\xff\xff\xff\xff", "invalid_msgpack: not a msgpack message: a declared length runs past its end"),
        (b"\x81\xa1k\xd6\xff" + b"\0" * 4, "invalid_msgpack: not a msgpack message for a policy: it holds an ext"),
        (b"\x81\xa1k\xc7\x03\x01abc", "invalid_msgpack: not a msgpack message for a policy: it holds an ext"),
        (b"\x81\xa1k\xc1", "invalid_msgpack: not a msgpack message: byte 0xc1 starts no value"),
        (b"\x81\xa1k", "invalid_msgpack: not a msgpack message: it ends in the middle of a value"),
        (b"\x80\x80", "invalid_msgpack: not a msgpack message: extra bytes follow the first value"),
    ],
)
def test_bombs_and_lies_are_refused_with_a_reason(payload: bytes, expected: str) -> None:
    assert message_of(payload).startswith(expected)


def test_the_budget_passes_everything_an_observation_holds() -> None:
    image = np.zeros((224, 224, 3), np.uint8)
    observation = {
        "images": {"cam_high": image, "cam_left_wrist": image, "cam_right_wrist": image},
        "state": np.zeros(14, np.float32),
        "step": np.int64(3),
        "flags": [True, None, 1.5, -7, 2**40, "s"],
        "prompt": "fold the towel" * 100,
    }
    payload = openpi_pack(observation)
    check_budget(payload)
    assert set(unpack(payload, LIMIT)) == {
        "images/cam_high",
        "images/cam_left_wrist",
        "images/cam_right_wrist",
        "state",
        "step",
        "flags",
        "prompt",
    }
