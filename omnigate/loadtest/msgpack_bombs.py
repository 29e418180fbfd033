"""msgpack messages built to cost a decoder far more than their size, and what a robot policy server answers each.

Each bomb is a few bytes to a few megabytes: huge object counts (empty maps, small integers), deep nesting, lengths
that claim more than the message holds, ext types, and arrays whose shape claims more than their data. The robot
route (``WS /v1/realtime/robot/openpi``) must refuse every one with the typed error named here, cheaply, and go on
serving the session. The fuzz harness and the robot storm both send this corpus.
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec


class Bomb(msgspec.Struct, frozen=True):
    """One hostile message and the error ``code`` the robot route answers it with."""

    name: str
    payload: bytes
    code: str


def _array16(items: bytes, count: int) -> bytes:
    return b"\xdc" + count.to_bytes(2, "big") + items


def empty_maps(size: int) -> bytes:
    """A map of string keys to arrays (of arrays) of 64 empty maps, about ``size`` bytes: one map a byte, each
    container within msgpack's per-container limits (1.9 MB is 1.8 M maps)."""
    leaf = _array16(b"\x80" * 64, 64)
    mid = _array16(leaf * 64, 64)
    top = _array16(mid * 64, 64)
    unit = top if size > len(top) + 2 else mid
    keys = max(1, min(15, size // (len(unit) + 2)))
    return bytes([0x80 | keys]) + b"".join(bytes([0xA1, 0x61 + i]) + unit for i in range(keys))


def small_ints(size: int) -> bytes:
    """Maps of 256 small integers: two objects for every two bytes, few containers."""
    entry = b"\xde\x01\x00" + b"".join(bytes([0xA2]) + i.to_bytes(2, "big") + b"\x01" for i in range(256))
    count = max(1, min(64, size // len(entry)))
    return b"\x81\xa1k" + _array16(entry * count, count)


def _ndarray(shape: list[int], data: bytes, dtype: str = "<f4") -> bytes:
    value: dict[bytes, Any] = {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}
    packed: bytes = msgpack.packb({"observation/state": value, "prompt": "bomb"})
    return packed


def corpus(max_bytes: int = 2 * 1024 * 1024) -> list[Bomb]:
    """The bombs, none larger than ``max_bytes`` (the server's frame limit, or its observation limit)."""
    return [
        Bomb("empty_maps", empty_maps(max_bytes - 64), "too_many_objects"),
        Bomb("small_ints", small_ints(max_bytes - 64), "too_many_objects"),
        Bomb("nested_arrays", b"\x91" * 5000 + b"\xc0", "too_deeply_nested"),
        Bomb("nested_maps", b"\x81\xa1k" * 5000 + b"\xc0", "too_deeply_nested"),
        Bomb("msgpack_stack_depth", b"\x91" * 1100 + b"\xc0", "too_deeply_nested"),
        Bomb("bin32_claims_4gb", b"\x81\xa1k\xc6\xff\xff\xff\xff" + b"\0" * 16, "invalid_msgpack"),
        Bomb("str32_claims_4gb", b"\x81\xa1k\xdb\xff\xff\xff\xff" + b"a" * 16, "invalid_msgpack"),
        Bomb("array32_claims_4g_items", b"\x81\xa1k\xdd\xff\xff\xff\xff" + b"\xc0" * 16, "invalid_msgpack"),
        Bomb("map32_claims_4g_entries", b"\xdf\xff\xff\xff\xff" + b"\xc0" * 16, "invalid_msgpack"),
        Bomb("ext_timestamp", b"\x81\xa1k\xd6\xff" + b"\0" * 4, "invalid_msgpack"),
        Bomb("ext32_claims_4gb", b"\x81\xa1k\xc9\xff\xff\xff\xff\x01" + b"\0" * 16, "invalid_msgpack"),
        Bomb("ndarray_shape_claims_exabytes", _ndarray([2**31, 2**31], b"\0" * 8), "invalid_array"),
        Bomb("ndarray_shape_of_zeros_and_huge", _ndarray([2**40, 2**40, 0], b""), "invalid_shape"),
        Bomb("ndarray_object_dtype", _ndarray([1], b"\0" * 8, "|O"), "invalid_dtype"),
    ]
