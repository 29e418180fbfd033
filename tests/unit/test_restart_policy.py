"""The supervisor's restart policy on a virtual clock: backoff, the stable run that starts the count over, the limit."""

from __future__ import annotations

from omnigate.gateway.cli.restart_policy import GiveUp, Restart, RestartPolicy, RestartTracker


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def advance(self, seconds: float) -> float:
        self.now_s += seconds
        return self.now_s


def crash_after(tracker: RestartTracker, clock: Clock, ran_s: float) -> Restart | GiveUp:
    tracker.started(clock.now_s)
    return tracker.exited(clock.advance(ran_s))


def test_quick_crashes_back_off_doubling_then_give_up_at_the_limit() -> None:
    clock, tracker = Clock(), RestartTracker(RestartPolicy())
    decisions = [crash_after(tracker, clock, 1.0) for _ in range(5)]
    assert decisions == [Restart(0.2, 1), Restart(0.4, 2), Restart(0.8, 3), Restart(1.6, 4), GiveUp(5)]


def test_the_backoff_is_capped() -> None:
    clock, tracker = Clock(), RestartTracker(RestartPolicy(max_failures=10))
    backoffs = [crash_after(tracker, clock, 0.5) for _ in range(9)]
    assert [d.after_s for d in backoffs if isinstance(d, Restart)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0, 5.0]


def test_a_stable_run_starts_the_count_over() -> None:
    clock, tracker = Clock(), RestartTracker(RestartPolicy())
    for _ in range(4):
        crash_after(tracker, clock, 1.0)
    # Killed after running 30 s: healthy until then, so this is the first failure of a new run of them.
    assert crash_after(tracker, clock, 30.0) == Restart(0.2, 1)
    assert [crash_after(tracker, clock, 29.9) for _ in range(4)] == [
        Restart(0.4, 2),
        Restart(0.8, 3),
        Restart(1.6, 4),
        GiveUp(5),
    ]


def test_a_child_killed_every_minute_is_restarted_forever() -> None:
    clock, tracker = Clock(), RestartTracker(RestartPolicy())
    decisions = [crash_after(tracker, clock, 60.0) for _ in range(100)]
    assert decisions == [Restart(0.2, 1)] * 100


def test_the_wait_before_a_restart_does_not_count_as_running() -> None:
    clock, tracker = Clock(), RestartTracker(RestartPolicy())
    assert crash_after(tracker, clock, 1.0) == Restart(0.2, 1)
    clock.advance(100.0)  # a long backoff or a stop: only the time since the next start counts
    assert crash_after(tracker, clock, 1.0) == Restart(0.4, 2)
