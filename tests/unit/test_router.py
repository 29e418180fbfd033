"""SessionRouter: sticky pins, admission by free slots, refusals, lost and removed replicas; scale-in choice."""

from __future__ import annotations

import pytest

from omnigate.engines.remote.admin import choose_emptiest
from omnigate.engines.remote.protocol import ReplicaReport
from omnigate.engines.remote.router import SessionRouter


def report(instance: str, free: int, *, active: int = 0, slots: int = 8, draining: bool = False) -> ReplicaReport:
    return ReplicaReport(replica=instance, free_slots=free, max_sessions=slots, active=active, draining=draining)


def router_with(**free: int) -> SessionRouter:
    router = SessionRouter()
    for name, slots in free.items():
        router.report(name, report(f"{name}-1", slots))
    return router


def test_a_session_is_pinned_to_the_replica_with_most_free_slots_and_stays() -> None:
    router = router_with(a=2, b=5)
    assert router.route("s1") == "b"
    # b's free estimate drops with every open; the pin does not move while b admits.
    router.report("a", report("a-1", 8))
    assert router.route("s1") == "b"
    assert router.pinned("s1") == "b"
    assert router.sessions_on("b") == 1


def test_opens_since_the_last_report_spread_a_burst() -> None:
    router = router_with(a=3, b=3)
    chosen = [router.route(f"s{i}") for i in range(6)]
    assert sorted(chosen) == ["a", "a", "a", "b", "b", "b"]
    assert router.route("s6") is None  # every slot believed taken until the replicas report again
    router.report("a", report("a-1", 1))
    assert router.route("s6") == "a"


def test_places_asked_for_before_the_replicas_answer_spread_a_burst() -> None:
    router = router_with(a=4, b=4)
    asked = []
    for _ in range(6):  # sessions arriving together: each asks before any replica has answered
        first = router.reserving_order()[0]
        router.asking(first)
        asked.append(first)
    assert sorted(asked) == ["a", "a", "a", "b", "b", "b"]
    router.note_free("a", 0)  # a's answer: it is full now; b still has one place not asked for
    assert router.reserving_order() == ["b", "a"]


def test_adding_a_replica_moves_no_live_session() -> None:
    router = router_with(a=4, b=4)
    pins = {s: router.route(s) for s in ("s1", "s2", "s3", "s4")}
    router.report("c", report("c-1", 8))
    assert {s: router.route(s) for s in pins} == pins
    assert router.route("s5") == "c"


def test_a_refusal_unpins_the_session_and_the_next_choice_skips_the_refuser() -> None:
    router = router_with(a=4, b=2)
    assert router.route("s1") == "a"
    router.refused("a", "s1", free_slots=0, draining=False)
    assert router.pinned("s1") is None
    assert router.route("s1", exclude={"a"}) == "b"
    assert router.pinned("s1") == "b"


def test_no_replica_outside_the_excluded_ones_means_refuse() -> None:
    router = router_with(a=4)
    assert router.route("s1", exclude={"a"}) is None


def test_a_draining_replica_admits_nothing_and_its_sessions_move_at_their_next_stream() -> None:
    router = router_with(a=4, b=4)
    assert router.route("s1") == "a"
    router.report("a", report("a-1", 0, draining=True))
    assert router.route("s1") == "b"
    assert router.route("s2") == "b"
    assert router.free_slots == 2  # b's 4 less the two opens since its report; a counts nothing


def test_a_lost_replica_admits_nothing_until_it_reports_again() -> None:
    router = router_with(a=4, b=4)
    assert router.route("s1") == "a"
    assert router.route("s2") == "b"
    router.lost("a")
    assert router.pinned("s1") is None
    assert router.pinned("s2") == "b"
    assert router.replicas_up == 1
    assert router.route("s1") == "b"
    router.report("a", report("a-1", 4))
    assert router.replicas_up == 2


def test_a_restarted_replica_keeps_no_pins_of_its_predecessor() -> None:
    router = router_with(a=4)
    assert router.route("s1") == "a"
    router.report("a", report("a-2", 4))
    assert router.pinned("s1") is None


def test_a_removed_replica_is_forgotten() -> None:
    router = router_with(a=4, b=1)
    assert router.route("s1") == "a"
    router.remove("a")
    assert router.names == ["b"]
    assert router.pinned("s1") is None
    assert router.route("s1") == "b"


def test_unpin_is_idempotent_and_frees_the_count() -> None:
    router = router_with(a=4)
    router.route("s1")
    router.unpin("s1")
    router.unpin("s1")
    assert router.sessions_on("a") == 0


def test_streams_without_a_session_are_not_pinned() -> None:
    router = router_with(a=1, b=1)
    assert {router.route(None), router.route(None)} == {"a", "b"}
    assert router.sessions_on("a") == router.sessions_on("b") == 0


def test_scale_in_drains_the_emptiest_replica_and_among_equals_the_newest() -> None:
    reports = {
        "omnigate-engine-0": report("x", 5, active=3),
        "omnigate-engine-1": report("y", 7, active=1),
        "omnigate-engine-2": report("z", 7, active=1),
    }
    assert choose_emptiest(reports) == "omnigate-engine-2"
    reports["omnigate-engine-2"] = report("z", 6, active=2)
    assert choose_emptiest(reports) == "omnigate-engine-1"
    with pytest.raises(ValueError, match="no engine replica"):
        choose_emptiest({})
