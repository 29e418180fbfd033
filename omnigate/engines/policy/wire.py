"""openpi's msgpack-numpy wire format, decoded without pickle and within limits. Sans-I/O.

openpi-client packs numpy arrays as msgpack maps ``{b"__ndarray__": True, b"data": bytes, b"dtype": str, b"shape":
list}`` and numpy scalars as ``{b"__npgeneric__": True, b"data": item, b"dtype": str}``. Decoding runs msgpack's
``object_hook`` on each map; this one builds arrays only of plain numeric dtypes (bool, int, uint, float) whose
byte count matches their shape, so a payload cannot name an object dtype, a structured dtype or a shape the bytes
do not fill. Everything else raises :class:`WireError` with a code the route sends back as a text message.
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
    return np.frombuffer(data, dtype=dtype).reshape(shape)


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


def unpack(payload: bytes, max_bytes: int) -> dict[str, Any]:
    """Decode one observation message: a map with string keys. Raises :class:`WireError`."""
    if len(payload) > max_bytes:
        raise WireError("payload_too_large", f"the message has {len(payload)} bytes; the limit is {max_bytes}")
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
        # msgpack's ExtraData and FormatError are ValueErrors; a limit broken is a ValueError too
        raise WireError("invalid_msgpack", f"not a msgpack message: {exc}") from None
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
