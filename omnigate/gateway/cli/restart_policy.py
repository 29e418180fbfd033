"""When the supervisor starts a child again, and when it gives up (sans-I/O: the caller passes the clock).

A child that exits unexpectedly is restarted after a backoff that doubles with each exit in a row (0.2 s, 0.4 s,
... at most 5 s). A child that ran long enough before exiting (30 s) was healthy: its count starts over. A child
that fails :attr:`RestartPolicy.max_failures` times in a row, each time within the stable time of its start, is
broken (the port is taken, the options are bad, the engine cannot load): the supervisor stops serve instead of
restarting it forever.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """The backoff and the limit, the same for the engine core and every gateway worker."""

    backoff_s: float = 0.2
    backoff_max_s: float = 5.0
    stable_after_s: float = 30.0
    max_failures: int = 5


@dataclass(frozen=True)
class Restart:
    """Start the child again after ``after_s``; this exit is its ``failures_in_a_row``-th in a row."""

    after_s: float
    failures_in_a_row: int


@dataclass(frozen=True)
class GiveUp:
    """The child failed ``failures_in_a_row`` times in a row without running stably: stop serve."""

    failures_in_a_row: int


class RestartTracker:
    """One child's run history under a :class:`RestartPolicy`: call :meth:`started` and :meth:`exited` with the
    time of each start and exit (any monotonic clock, in seconds)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.failures_in_a_row = 0
        self._started_at: float | None = None

    def started(self, now_s: float) -> None:
        self._started_at = now_s

    def exited(self, now_s: float) -> Restart | GiveUp:
        """Book an unexpected exit: the restart to schedule, or the decision to give up."""
        ran_s = 0.0 if self._started_at is None else now_s - self._started_at
        self._started_at = None
        self.failures_in_a_row = 1 if ran_s >= self.policy.stable_after_s else self.failures_in_a_row + 1
        if self.failures_in_a_row >= self.policy.max_failures:
            return GiveUp(self.failures_in_a_row)
        backoff = self.policy.backoff_s * 2.0 ** (self.failures_in_a_row - 1)
        return Restart(min(self.policy.backoff_max_s, backoff), self.failures_in_a_row)
