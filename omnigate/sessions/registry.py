"""Live sessions of a gateway process: admission against a cap, and the numbers metrics and drains read."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from omnigate.sessions.driver import SessionDriver


class SessionLimitReached(Exception):
    """The process already serves its maximum number of sessions, or is draining."""

    def __init__(self, limit: int, retry_after_s: float, draining: bool = False) -> None:
        super().__init__(
            "the server is draining and admits no new sessions"
            if draining
            else f"the server is at its limit of {limit} concurrent sessions"
        )
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.draining = draining


class DrainTarget(Protocol):
    """What a draining server needs of a session that has no :class:`SessionDriver` (the video routes)."""

    @property
    def idle(self) -> bool:
        """Nothing in progress: closing the session now loses no work."""
        ...

    def end(self, code: str, message: str) -> bool:
        """Start closing the session with a typed error (``code``); False when it was already ending."""
        ...


class SessionLease:
    """One admitted session's slot; :meth:`release` is idempotent.

    The route that serves the session sets ``driver`` (speech) or ``drain_target`` (other sessions), so a drain can
    tell whether the session is idle and close it typed.
    """

    def __init__(self, registry: SessionRegistry, transport: str) -> None:
        self._registry = registry
        self.transport = transport
        self.released = False
        self.driver: SessionDriver | None = None
        self.drain_target: DrainTarget | None = None

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.driver = None
        self.drain_target = None
        self._registry.leases.discard(self)
        active = self._registry.active
        active[self.transport] -= 1
        if active[self.transport] <= 0:
            del active[self.transport]


class SessionRegistry:
    """Counts live sessions by transport and refuses new ones beyond ``max_sessions`` or while draining."""

    def __init__(self, max_sessions: int, retry_after_s: float = 1.0) -> None:
        self.max_sessions = max_sessions
        self.retry_after_s = retry_after_s
        self.active: Counter[str] = Counter()
        self.admitted_total: Counter[str] = Counter()
        self.refused_total: Counter[str] = Counter()
        self.draining = False
        self.leases: set[SessionLease] = set()

    @property
    def total_active(self) -> int:
        return sum(self.active.values())

    def acquire(self, transport: str) -> SessionLease:
        """Admit one session. Raises :class:`SessionLimitReached`."""
        if self.draining or self.total_active >= self.max_sessions:
            self.refused_total["draining" if self.draining else "capacity"] += 1
            raise SessionLimitReached(self.max_sessions, self.retry_after_s, self.draining)
        self.active[transport] += 1
        self.admitted_total[transport] += 1
        lease = SessionLease(self, transport)
        self.leases.add(lease)
        return lease

    @contextmanager
    def admit(self, transport: str) -> Iterator[SessionLease]:
        """Hold one session slot for the ``with`` block."""
        lease = self.acquire(transport)
        try:
            yield lease
        finally:
            lease.release()
