"""openpi's msgpack-numpy wire format, decoded without pickle and within limits. Sans-I/O.

openpi-client packs numpy arrays as msgpack maps ``{b"__ndarray__": True, b"data": bytes, b"dtype": str, b"shape":
list}`` and numpy scalars as ``{b"__npgeneric__": True, b"data": item, b"dtype": str}``. Decoding runs msgpack's
``object_hook`` on each map; this one builds arrays only of plain numeric dtypes (bool, int, uint, float) whose
byte count matches their shape, so a payload cannot name an object dtype, a structured dtype or a shape the bytes
do not fill. Everything else raises :class:`WireError` with a code the route sends back as a text message.

Before anything is built, :func:`check_budget` walks the message's headers (no object is made): at most
:data:`MAX_OBJECTS` objects, containers nested at most :data:`MAX_NESTING` deep, no declared length past the end of
the message, no ext type. msgpack's own limits bound each container but not their number: 1.9 MB can hold 1.8 M
empty maps, which would cost a third of a second to build, all of it holding the GIL.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

NUMERIC_KINDS = frozenset("biuf")
MAX_NDIM = 8
MAX_MAP_ENTRIES = 256
MAX_STRING_BYTES = 64 * 1024
MAX_ARRAY_ITEMS = 64  # msgpack arrays: shapes and short lists, never pixel data (that travels as bin)
MAX_DEPTH = 4
# An observation is a map of (nested maps of) values; an array is a map whose shape is a list: deeper is no observation.
MAX_NESTING = MAX_DEPTH + 3
# A 3-camera observation is ~70 objects (each array a 4-entry map and a shape list); far below this, far above that.
MAX_OBJECTS = 2048


class WireError(Exception):
    """A payload that is not openpi's msgpack-numpy, or breaks a limit. ``code`` is the refusal's type."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def _dtype(name: Any) -> np.dtype[Any]:
    if not isinstance(name, str) or len(name) > 8:
        raise WireError("invalid_dtype", f"dtype must be a short numpy type string, got {name!r}")
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise WireError("invalid_dtype", f"unknown dtype {name!r}") from None
    if dtype.kind not in NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise WireError("invalid_dtype", f"dtype {name!r} is not a plain bool, integer or float type")
    return dtype


def _array(obj: Mapping[bytes, Any]) -> np.ndarray[Any, Any]:
    dtype = _dtype(obj.get(b"dtype"))
    shape = obj.get(b"shape")
    data = obj.get(b"data")
    if not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM:
        raise WireError("invalid_shape", f"shape must be a list of at most {MAX_NDIM} sizes")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise WireError("invalid_shape", "shape sizes must be non-negative integers")
    if not isinstance(data, bytes):
        raise WireError("invalid_array", "array data must be a msgpack bin")
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise WireError("invalid_array", f"array data holds {len(data)} bytes; dtype and shape need {expected}")
    try:
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    except ValueError as exc:  # an empty array whose other sizes are past what numpy can index
        raise WireError("invalid_shape", f"no array has shape {shape}: {exc}") from None


def _scalar(obj: Mapping[bytes, Any]) -> np.generic:
    dtype = _dtype(obj.get(b"dtype"))
    data = obj.get(b"data")
    if not isinstance(data, bool | int | float):
        raise WireError("invalid_array", "a numpy scalar's data must be a number")
    try:
        return dtype.type(data)  # type: ignore[no-any-return]
    except (OverflowError, ValueError):
        raise WireError("invalid_array", f"{data!r} does not fit dtype {dtype.str}") from None


def _object_hook(obj: dict[Any, Any]) -> Any:
    if b"__ndarray__" in obj:
        return _array(obj)
    if b"__npgeneric__" in obj:
        return _scalar(obj)
    return obj


# msgpack's type bytes, by what follows them: a scalar of a fixed size, a length of 1/2/4 bytes then that many bytes
# (str, bin), or a count of 2/4 bytes then that many items (array) or key-value pairs (map). Ext types are refused.
_FIXED_SIZE = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_FIXED_SIZE |= {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_COUNTED = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # (count bytes, items per count)
_EXT = frozenset({0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8})


def check_budget(payload: bytes, max_objects: int = MAX_OBJECTS, max_nesting: int = MAX_NESTING) -> None:
    """Walk one message's headers without building anything; raise :class:`WireError` past a budget.

    The walk costs a few hundred nanoseconds an object and stops at ``max_objects``, so it is bounded whatever
    the payload; what passes it decodes into at most ``max_objects`` objects.
    """
    end = len(payload)
    pos = 0
    objects = 0
    open_items: list[int] = []  # items still to come in each open container, innermost last
    while True:
        if pos >= end:
            raise WireError("invalid_msgpack", "not a msgpack message: it ends in the middle of a value")
        objects += 1
        if objects > max_objects:
            raise WireError(
                "too_many_objects", f"the message holds more than {max_objects} msgpack objects (arrays travel as bin)"
            )
        kind = payload[pos]
        pos += 1
        items = 0
        if kind <= 0x7F or kind >= 0xE0:
            pass  # fixint
        elif kind <= 0x8F:
            items = 2 * (kind & 0x0F)
        elif kind <= 0x9F:
            items = kind & 0x0F
        elif kind <= 0xBF:
            pos += kind & 0x1F
        elif kind in _FIXED_SIZE:
            pos += _FIXED_SIZE[kind]
        elif kind in _SIZED:
            width = _SIZED[kind]
            pos += width + int.from_bytes(payload[pos : pos + width], "big")
        elif kind in _COUNTED:
            width, per = _COUNTED[kind]
            items = per * int.from_bytes(payload[pos : pos + width], "big")
            pos += width
        elif kind in _EXT:
            raise WireError("invalid_msgpack", "not a msgpack message for a policy: it holds an ext type")
        else:
            raise WireError("invalid_msgpack", f"not a msgpack message: byte 0x{kind:02x} starts no value")
        if pos > end or items > end - pos:
            # each item takes at least one byte: a count or length past the end is a lie, refused before any work
            raise WireError("invalid_msgpack", "not a msgpack message: a declared length runs past its end")
        if open_items:
            open_items[-1] -= 1
        if items:
            open_items.append(items)
            if len(open_items) > max_nesting:
                raise WireError("too_deeply_nested", f"the message nests containers deeper than {max_nesting}")
        while open_items and not open_items[-1]:
            open_items.pop()
        if not open_items:
            if pos != end:
                raise WireError("invalid_msgpack", "not a msgpack message: extra bytes follow the first value")
            return


def unpack(payload: bytes, max_bytes: int) -> dict[str, Any]:
    """Decode one observation message: a map with string keys, within :func:`check_budget`. Raises
    :class:`WireError`. CPU-bound (arrays are copied out of the payload): the route runs it off the event loop."""
    if len(payload) > max_bytes:
        raise WireError("payload_too_large", f"the message has {len(payload)} bytes; the limit is {max_bytes}")
    check_budget(payload)
    try:
        decoded = msgpack.unpackb(
            payload,
            object_hook=_object_hook,
            raw=False,
            strict_map_key=False,  # the array maps' keys are bin (bytes)
            max_str_len=MAX_STRING_BYTES,
            max_bin_len=max_bytes,
            max_array_len=MAX_ARRAY_ITEMS,
            max_map_len=MAX_MAP_ENTRIES,
            max_ext_len=0,
        )
    except WireError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        # msgpack's ExtraData and FormatError are ValueErrors; a limit broken is a ValueError too. Some (StackError)
        # carry no text: their name is the reason then.
        raise WireError("invalid_msgpack", f"not a msgpack message: {str(exc) or type(exc).__name__}") from None
    if not isinstance(decoded, dict):
        raise WireError("invalid_observation", "an observation must be a msgpack map of named values")
    return _flatten(decoded, "", 0)


def _flatten(mapping: dict[Any, Any], prefix: str, depth: int) -> dict[str, Any]:
    """Nested maps (``{"images": {"cam_high": ...}}``, openpi's ALOHA form) become ``"images/cam_high"`` keys."""
    if depth > MAX_DEPTH:
        raise WireError("invalid_observation", f"observation maps nest deeper than {MAX_DEPTH}")
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise WireError("invalid_observation", f"observation keys must be strings, got {type(key).__name__}")
        name = prefix + key
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "/", depth + 1))
        else:
            flat[name] = value
    return flat


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot pack {type(obj).__name__}")


def pack(message: Mapping[str, Any]) -> bytes:
    """Encode a reply or the metadata the way openpi's server does (numpy values as msgpack-numpy maps)."""
    packed: bytes = msgpack.packb(message, default=_default, use_bin_type=True)
    return packed
