"""The messages of duplex sessions on the engine-core socket (the bodies of the ``DUPLEX_*`` frames), msgpack.

Input accounting crosses as byte counts, not as events: every frame of a session says how many of its input bytes
the core has finished with so far (consumed by a tick, or dropped by a clear). The gateway, which knows how many it
sent, then holds the session's unconsumed input exactly as the engine would, never below what the core holds.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from omnigate.engines.base import EngineInfo
from omnigate.engines.duplex.session import DuplexFrame
from omnigate.engines.duplex.stats import ClockStats


class DuplexInfo(msgspec.Struct, frozen=True):
    """The answer to DUPLEX_HELLO: what a gateway needs to serve the engine's sessions."""

    info: EngineInfo
    sample_rate: int
    frame_s: float
    retry_after_s: float
    stats: ClockStats


class DuplexOpen(msgspec.Struct, frozen=True):
    max_input_bytes: Annotated[int, msgspec.Meta(ge=0)]
    initial_credit_frames: Annotated[int, msgspec.Meta(ge=0)]
    seed: Annotated[int, msgspec.Meta(ge=0)] | None = None


class DuplexGrant(msgspec.Struct, frozen=True):
    frames: Annotated[int, msgspec.Meta(ge=0)]


class SessionFrame(msgspec.Struct, frozen=True, array_like=True):
    """One frame of one session; ``input_done``: the session's input bytes the core has finished with so far."""

    session: int
    frame: DuplexFrame
    input_done: int


class DuplexTick(msgspec.Struct, frozen=True):
    frames: list[SessionFrame]


class DuplexEnded(msgspec.Struct, frozen=True):
    """The core ended a session itself; ``retry_after_s`` is set when it refused it for capacity."""

    code: str
    message: str
    retry_after_s: float | None = None


ENCODER = msgspec.msgpack.Encoder()
