"""The engine-pool contract the session driver and the gateway program against.

Two implementations exist: :class:`omnigate.engines.pool.EnginePool` runs the engine in this process on scheduler
threads; :class:`omnigate.engines.remote.pool.RayEnginePool` reaches engine replicas on Ray Serve. Both are
message- and credit-based: the driver opens a stream per utterance, feeds it text, grants it credit in media
milliseconds as its transport drains, and receives outputs on the event loop through the sink it passed to
``open``. A pool never produces beyond the credit granted, wherever the engine runs.

A pool that spreads sessions over several engine replicas also implements :class:`SessionPinning`: the driver
then works through a per-session view that keeps every stream of the session on one replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from omnigate.engines.base import EngineInfo, EngineOutput, SynthesisParams

OutputSink = Callable[[list[EngineOutput]], None]


class StreamHandle(Protocol):
    """What the driver reads of an open stream: whether the pool has finished with it."""

    closed: bool


S = TypeVar("S", bound=StreamHandle)


class EnginePoolAPI(Protocol[S]):
    """Stream operations (called on the event loop, never blocking) and the gauges metrics read."""

    @property
    def info(self) -> EngineInfo: ...

    def open(self, params: SynthesisParams, sink: OutputSink, *, initial_credit_ms: float) -> S:
        """Admit one utterance stream. Raises ``PoolFull``, ``PoolClosed`` or ``EngineError``."""
        ...

    def push_text(self, ps: S, text: str) -> None: ...

    def end_input(self, ps: S) -> None: ...

    def grant(self, ps: S, ms: float) -> None:
        """Allow ``ms`` more media time for the stream."""
        ...

    def abort(self, ps: S) -> None:
        """Stop all work for the stream and free its slot. Idempotent; no output follows."""
        ...

    @property
    def active(self) -> int: ...

    @property
    def free_slots(self) -> int: ...

    def has_free_slot(self) -> bool:
        """Whether one more stream would be admitted now: ``free_slots > 0``, cheaper where counting them is not."""
        ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def health_problem(self) -> str | None:
        """Why the pool cannot serve now (readiness reports it), or None."""
        ...

    # Counters (plain attributes in the in-process pool).
    @property
    def steps(self) -> int: ...

    @property
    def aborted_total(self) -> int: ...

    @property
    def failed_total(self) -> int: ...

    @property
    def generated_ms_total(self) -> float: ...

    @property
    def last_batch_size(self) -> int: ...

    @property
    def step_seconds_total(self) -> float: ...

    @property
    def failed_steps_total(self) -> int: ...

    @property
    def worker_restarts_total(self) -> int: ...

    @property
    def step_timeouts_total(self) -> int: ...


class PinnedSession(EnginePoolAPI[S], Protocol[S]):
    """A pool as one session sees it: every stream it opens goes to the session's replica."""

    def unpin(self) -> None:
        """The session ended: forget its replica. Idempotent."""
        ...


@runtime_checkable
class SessionPinning(Protocol):
    """A pool with several engine replicas, which pins each session to one of them for the session's life."""

    def pin_session(self) -> PinnedSession[Any]: ...
