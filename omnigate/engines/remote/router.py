"""Which engine replica serves a session: a sticky map, admission by free slots, and what refusals and deaths do.

Each gateway process routes its own sessions, so the map lives here and needs no shared store. A session is pinned
to one replica when it first needs one and stays there: it moves only at an utterance boundary when its replica
refuses it (full, draining) or is gone. The map is a dictionary, not a hash ring, so adding or removing replicas
never moves a live session.

Free slots come from the replicas' own reports (every reply carries one); streams this gateway opened since a
replica's last report are subtracted, so a burst of opens spreads instead of piling onto the replica that looked
emptiest a moment ago. The replica still has the final word: it refuses what it cannot take.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Set
from dataclasses import dataclass

from omnigate.engines.remote.protocol import ReplicaReport


@dataclass(eq=False)
class ReplicaState:
    """What the router knows of one replica."""

    name: str
    instance: str | None = None
    reported_free: int = 0
    max_sessions: int = 0
    opened_since_report: int = 0
    up: bool = False
    draining: bool = False

    @property
    def free_estimate(self) -> int:
        return max(0, self.reported_free - self.opened_since_report)

    @property
    def admits(self) -> bool:
        return self.up and not self.draining and self.free_estimate > 0


class SessionRouter:
    """Session → replica map over a changing set of replicas."""

    def __init__(self) -> None:
        self._replicas: dict[str, ReplicaState] = {}
        self._pins: dict[Hashable, str] = {}
        self._pinned_count: Counter[str] = Counter()

    # ---- what replicas say ----------------------------------------------------------------------------------

    def report(self, name: str, report: ReplicaReport) -> None:
        """A fresh report from ``name``. A new instance behind the same name (a restart) loses the old pins."""
        state = self._replicas.get(name)
        if state is None:
            state = self._replicas[name] = ReplicaState(name)
        elif state.instance is not None and state.instance != report.replica:
            self._unpin_all(name)
        state.instance = report.replica
        state.reported_free = report.free_slots
        state.max_sessions = report.max_sessions
        state.draining = report.draining
        state.opened_since_report = 0
        state.up = True

    def note_free(self, name: str, free_slots: int) -> None:
        """A reply that carries only the free slots (an admission)."""
        state = self._replicas.get(name)
        if state is not None:
            state.reported_free = free_slots
            state.opened_since_report = 0

    def refused(self, name: str, session: Hashable | None, *, free_slots: int, draining: bool) -> None:
        """``name`` refused a stream of ``session``: believe its numbers and move the session off it."""
        state = self._replicas.get(name)
        if state is not None:
            state.reported_free = free_slots
            state.opened_since_report = 0
            state.draining = state.draining or draining
        if session is not None and self._pins.get(session) == name:
            self.unpin(session)

    def lost(self, name: str) -> None:
        """``name`` stopped answering: admit nothing there until it reports again; its sessions re-pin."""
        state = self._replicas.get(name)
        if state is not None:
            state.up = False
        self._unpin_all(name)

    def remove(self, name: str) -> None:
        """``name`` is no longer deployed."""
        self._replicas.pop(name, None)
        self._unpin_all(name)

    # ---- choosing -----------------------------------------------------------------------------------------------

    def route(self, session: Hashable | None, exclude: Set[str] = frozenset()) -> str | None:
        """The replica for the next stream of ``session`` (None: a stream with no session), or None when no
        replica outside ``exclude`` admits. Pins the session to the replica chosen."""
        if session is not None:
            pinned = self._pins.get(session)
            if pinned is not None and pinned not in exclude and self._replicas[pinned].admits:
                self._replicas[pinned].opened_since_report += 1
                return pinned
        candidates = [s for s in self._replicas.values() if s.admits and s.name not in exclude]
        if not candidates:
            return None
        # Most free slots first; among equals the replica with fewer of this gateway's sessions, then by name.
        best = min(candidates, key=lambda s: (-s.free_estimate, self._pinned_count[s.name], s.name))
        best.opened_since_report += 1
        if session is not None:
            self._pin(session, best.name)
        return best.name

    def reserving_order(self) -> list[str]:
        """Replicas to ask for a session's place, most free first: every one up and not draining, since only the
        replica's own answer admits (the free counts here are as of its last report)."""
        candidates = [s for s in self._replicas.values() if s.up and not s.draining]
        candidates.sort(key=lambda s: (-s.free_estimate, self._pinned_count[s.name], s.name))
        return [s.name for s in candidates]

    def asking(self, name: str) -> None:
        """A session's place is being asked of ``name``: count it against its free slots until the replica answers,
        so that sessions arriving together are spread over the replicas instead of all asking the same one."""
        state = self._replicas.get(name)
        if state is not None:
            state.opened_since_report += 1

    def pin(self, session: Hashable, name: str) -> None:
        """Pin ``session`` to ``name`` (the replica holding its place)."""
        self._pin(session, name)

    def unpin(self, session: Hashable) -> None:
        """The session ended (or must move). Idempotent."""
        name = self._pins.pop(session, None)
        if name is not None:
            self._pinned_count[name] -= 1
            if self._pinned_count[name] <= 0:
                del self._pinned_count[name]

    # ---- queries ------------------------------------------------------------------------------------------------

    def pinned(self, session: Hashable) -> str | None:
        return self._pins.get(session)

    def sessions_on(self, name: str) -> int:
        return self._pinned_count[name]

    def state(self, name: str) -> ReplicaState | None:
        return self._replicas.get(name)

    @property
    def names(self) -> list[str]:
        return sorted(self._replicas)

    @property
    def free_slots(self) -> int:
        """Slots this gateway believes it can still open, over the replicas that admit."""
        return sum(s.free_estimate for s in self._replicas.values() if s.up and not s.draining)

    @property
    def replicas_up(self) -> int:
        return sum(1 for s in self._replicas.values() if s.up)

    def _pin(self, session: Hashable, name: str) -> None:
        self.unpin(session)
        self._pins[session] = name
        self._pinned_count[name] += 1

    def _unpin_all(self, name: str) -> None:
        for session in [s for s, n in self._pins.items() if n == name]:
            self.unpin(session)
