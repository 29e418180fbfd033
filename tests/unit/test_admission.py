"""Headroom admission on a virtual clock: a simulated pool of workers serving realtime streams.

The simulation is the pool's contract with the controller: each admitted stream needs one second of audio per second
of wall time and costs ``rtf`` worker seconds per second of audio; workers serve the stream with the earliest
deadline in pieces; the controller hears about every step, every late pick, every open and close.
"""

from __future__ import annotations

import math

import pytest

from omnigate.engines.admission import AdmissionController, AdmissionSettings

PIECE_S = 0.5  # audio one step produces for one stream


class SimulatedPool:
    """``workers`` workers at ``rtf`` serve streams that each play out in real time from their first piece."""

    def __init__(self, admission: AdmissionController, workers: int, rtf: float) -> None:
        self.admission = admission
        self.workers = workers
        self.rtf = rtf
        self.now = 0.0
        self.free_at = [0.0] * workers
        # per stream: when its listener runs dry
        self.deadlines: dict[int, float] = {}
        self.underruns = 0
        self.refused = 0
        self._ids = 0
        self.tickets: dict[int, int] = {}

    def offer(self) -> int | None:
        if not self.admission.admits(self.now):
            self.refused += 1
            return None
        self._ids += 1
        self.deadlines[self._ids] = self.now + 0.25  # the TTFA target
        self.tickets[self._ids] = self.admission.opened(self.now)
        return self._ids

    def close(self, stream: int) -> None:
        del self.deadlines[stream]
        self.admission.closed(self.now, keep_share=True, ticket=self.tickets.pop(stream))

    def run_until(self, end: float) -> None:
        """Workers pick the earliest deadline whenever they are free; a pick after the deadline is an underrun."""
        while True:
            worker = min(range(self.workers), key=lambda i: self.free_at[i])
            start = max(self.free_at[worker], self.now)
            if start >= end or not self.deadlines:
                self.now = end
                return
            self.now = start
            stream = min(self.deadlines, key=lambda s: self.deadlines[s])
            deadline = self.deadlines[stream]
            late = self.now - deadline
            self.admission.observe_late(self.now, late)
            if late > 0.0:
                self.underruns += 1
            cost = PIECE_S * self.rtf
            self.free_at[worker] = self.now + cost
            # the piece plays from its deadline (or now, when late): the next one is due when it has played
            self.deadlines[stream] = max(deadline, self.now + cost) + PIECE_S
            self.admission.observe_step(self.now + cost, cost, PIECE_S * 1000.0)
            if self.deadlines[stream] - (self.now + cost) >= self.admission.settings.young_lead_s:
                self.admission.ahead(self.tickets[stream])


def test_twice_the_capacity_offered_admits_what_fits_and_nobody_underruns() -> None:
    workers, rtf = 2, 0.08
    settings = AdmissionSettings(target_load=0.8)
    admission = AdmissionController(workers, max_streams=64, settings=settings)
    admission.seed(rtf)
    pool = SimulatedPool(admission, workers, rtf)
    capacity = math.floor(workers * 0.8 / rtf)  # 20 streams
    waiting = 2 * capacity  # clients that retry 0.5 s after a refusal, all at once
    while waiting and pool.now < 30.0:
        admitted = 0
        for _ in range(waiting):
            admitted += pool.offer() is not None
        waiting -= admitted
        pool.run_until(pool.now + 0.5)
    pool.run_until(pool.now + 30.0)
    # The streams run steady and leave room for one more young stream's burst (three steady shares), not more.
    assert len(pool.deadlines) == capacity - 2
    assert pool.refused >= capacity
    assert pool.underruns == 0
    assert admission.young == 0
    assert admission.headroom(pool.now) == 0


def test_slots_policy_admits_past_the_workers_and_every_stream_underruns() -> None:
    workers, rtf = 2, 0.08
    admission = AdmissionController(workers, max_streams=64, settings=AdmissionSettings(policy="slots"))
    pool = SimulatedPool(admission, workers, rtf)
    for _ in range(40):
        pool.offer()
    pool.run_until(10.0)
    assert len(pool.deadlines) == 40
    assert pool.refused == 0
    assert pool.underruns > 40


def test_cost_follows_the_machine_and_a_late_pick_closes_admission() -> None:
    settings = AdmissionSettings(target_load=1.0, late_hold_s=2.0, young_cost_factor=1.0)  # steady streams only
    admission = AdmissionController(2, max_streams=64, settings=settings)
    for t in range(10):
        admission.observe_step(float(t), 0.1, 1000.0)  # rtf 0.1: 20 streams on two workers
    assert admission.cost == pytest.approx(0.1)
    assert admission.headroom(10.0) == 20
    # The cores slow down (another process): the estimate follows within a few half-lives.
    for t in range(10, 40):
        admission.observe_step(float(t), 0.2, 1000.0)
    assert admission.headroom(40.0) == 10
    admission.observe_late(40.0, 0.01)  # within the tolerance
    assert admission.headroom(40.0) == 10
    admission.opened(40.0)
    admission.observe_late(40.0, 0.3)
    assert admission.headroom(41.0) == 0
    assert not admission.admits(41.0)
    assert admission.retry_after_s(41.0, 0.5) == pytest.approx(1.0)
    assert admission.headroom(42.0) == 9
    admission.closed(42.0, keep_share=False)
    admission.observe_late(42.0, 1.0)
    assert admission.headroom(42.5) == 1  # closed, but idle: one stream is always taken
    assert admission.late_total == 2 and admission.refused_total == 1


def test_before_anything_is_measured_the_slots_admit() -> None:
    admission = AdmissionController(2, max_streams=3, max_batch=1)
    assert admission.cost is None
    for _ in range(3):
        assert admission.admits(0.0)
        admission.opened(0.0)
    assert not admission.admits(0.0)


def test_an_idle_pool_takes_one_stream_whatever_it_costs() -> None:
    admission = AdmissionController(1, max_streams=8)
    admission.seed(5.0)  # five times slower than real time: no stream keeps its deadline
    assert admission.admits(0.0)
    admission.opened(0.0)
    assert not admission.admits(0.0)


def test_a_completed_stream_keeps_its_share_for_the_grace_time() -> None:
    settings = AdmissionSettings(target_load=1.0, grace_s=3.0, late_hold_s=5.0, young_cost_factor=1.0)
    admission = AdmissionController(1, max_streams=64, settings=settings)
    admission.seed(0.5)  # two streams fit
    for _ in range(2):
        assert admission.admits(0.0)
        admission.opened(0.0)
    admission.closed(1.0, keep_share=True)  # its session will speak again
    admission.observe_late(1.0, 1.0)  # and admission closes
    assert admission.headroom(1.5) == 0
    assert admission.admits(2.0)  # the next utterance within the grace is admitted all the same
    admission.opened(2.0)
    assert admission.active == 2
    admission.closed(3.0, keep_share=False)  # aborted: no share is held
    assert not admission.admits(3.5)
    admission.closed(4.0, keep_share=True)
    assert admission.headroom(7.5) == 2  # the hold is over


def test_a_batched_engine_shares_its_fixed_step_cost() -> None:
    # A step costs 20 ms plus 1 ms per stream and produces 80 ms per stream: one worker carries (80 - 20) / 1 streams.
    steady = AdmissionSettings(target_load=1.0, young_cost_factor=1.0)
    admission = AdmissionController(1, max_streams=1000, max_batch=512, settings=steady)
    for t, batch in enumerate([1, 4, 16, 32, 8, 2] * 5):
        admission.observe_step(t * 0.1, 0.020 + 0.001 * batch, 80.0 * batch, batch)
    assert admission.headroom(3.0) == 60
    # A caller asking whether one more fits stops counting there; a limit above the headroom changes nothing.
    assert admission.headroom(3.0, limit=1) == 1 and admission.headroom(3.0, limit=100) == 60
    assert admission.admits(3.0)
    # Young streams are priced at their burst: three rows each until they are ahead.
    bursty = AdmissionController(1, max_streams=1000, max_batch=512, settings=AdmissionSettings(target_load=1.0))
    for t, batch in enumerate([1, 4, 16, 32, 8, 2] * 5):
        bursty.observe_step(t * 0.1, 0.020 + 0.001 * batch, 80.0 * batch, batch)
    assert bursty.headroom(3.0) == 20
    # A step whose cost does not depend on the batch (a fixed-time test engine at real time) admits up to its batch.
    fixed = AdmissionController(1, max_streams=100, max_batch=64)
    for t in range(20):
        fixed.observe_step(t * 0.02, 0.020, 20.0, 1)
    assert fixed.headroom(1.0) == 64


def test_a_step_profile_prices_a_burst_of_sessions_before_any_step_and_no_row_is_free() -> None:
    # Measured at load: a step of R rows takes 10 ms + 40 us per row and each row makes 80 ms of audio, so within
    # 0.8 of the worker 1,350 rows fit; a session young at three rows, a burst of 1,350 / 3 of them fits.
    profile = [(rows, 0.010 + 0.00004 * rows) for rows in (1, 2, 4, 64, 256, 1024)]
    admission = AdmissionController(1, max_streams=1536, max_batch=1536)
    admission.profile(profile, 80.0)
    admitted = 0
    while admission.reserve(0.0) is not None:
        admitted += 1
    assert admitted == 450
    assert admission.load(1350) == pytest.approx(0.8)  # beyond the largest size measured, its last segment extended
    # The first steps are small and cost the same whatever their rows: measured alone they would price a new row as
    # free, and admit to the slots; the profile stays the floor.
    steady = AdmissionController(1, max_streams=1536, max_batch=1536, settings=AdmissionSettings(young_cost_factor=1))
    steady.profile(profile, 80.0)
    for t, batch in enumerate([1, 2, 4, 8] * 10):
        steady.observe_step(t * 0.01, 0.010, 80.0 * batch, batch)
    for _ in range(1349):
        steady.opened(1.0)
    assert steady.headroom(1.0) == 1
    steady.opened(1.0)
    assert steady.headroom(1.0) == 0 and not steady.admits(1.0)


def test_slots_policy_counts_slots_only() -> None:
    admission = AdmissionController(1, max_streams=2, settings=AdmissionSettings(policy="slots"))
    admission.observe_step(0.0, 10.0, 100.0)  # a cost that headroom would refuse everything at
    admission.observe_late(0.0, 5.0)
    assert admission.headroom(0.0) == 2
    for _ in range(2):
        assert admission.admits(0.0)
        admission.opened(0.0)
    assert not admission.admits(0.0)
    admission.closed(0.0, keep_share=True)
    assert admission.headroom(0.0) == 1


def test_a_session_holds_its_place_between_its_streams_and_opens_on_it_when_full() -> None:
    admission = AdmissionController(1, max_streams=2, settings=AdmissionSettings(policy="slots"))
    first, second = admission.reserve(0.0), admission.reserve(0.0)
    assert first is not None and second is not None
    assert admission.reserve(0.0) is None and not admission.admits(0.0)  # two idle places fill the room
    assert admission.headroom(0.0) == 0
    assert admission.holds(first)
    admission.opened(0.0, first)  # no admission check: the place is the session's
    assert not admission.holds(first) and admission.active == 1 and admission.headroom(0.0) == 0
    admission.closed(1.0, keep_share=True, held=first)  # the session keeps its place, no grace share on top
    assert admission.holds(first) and admission.headroom(1.0) == 0
    admission.release(second)
    assert admission.headroom(1.0) == 1 and admission.held == 1
    admission.release(first)
    admission.release(first)  # idempotent
    assert admission.headroom(1.0) == 2 and admission.held == 0


def test_a_held_place_is_priced_young_until_its_first_stream_opens() -> None:
    admission = AdmissionController(1, max_streams=100)
    admission.observe_step(0.0, 0.1, 1000.0)  # 0.1 worker s per audio s: 8 steady streams fit 0.8
    ticket = admission.reserve(0.0)
    assert ticket is not None and admission.young == 1
    admission.opened(0.0, ticket)
    assert admission.young == 1  # the stream's own ticket, not the place's as well
    admission.release(ticket)  # the session ends while its stream still runs: the stream still counts
    assert admission.active == 1
    admission.closed(0.5, keep_share=False, held=ticket)
    assert admission.active == 0 and admission.held == 0


@pytest.mark.parametrize(
    "settings",
    [
        {"policy": "fifo"},
        {"target_load": 0.0},
        {"target_load": 1.5},
        {"cost_halflife_s": 0.0},
        {"grace_s": -1.0},
        {"young_cost_factor": 0.5},
        {"young_lead_s": -1.0},
        {"min_slack_s": -1.0},
    ],
)
def test_bad_settings_are_refused(settings: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"admission|target_load|times|young"):
        AdmissionSettings(**settings)  # type: ignore[arg-type]


def steady_pool(streams: int, *, workers: int = 2, rtf: float = 0.08) -> AdmissionController:
    """A pool carrying ``streams`` streams that all run ahead of their playback (capacity 20 at the defaults)."""
    admission = AdmissionController(workers, max_streams=64)
    admission.seed(rtf)
    for _ in range(streams):
        admission.ahead(admission.opened(0.0))
    return admission


def test_a_reopening_admits_what_the_young_streams_bursts_fit_not_every_waiting_client() -> None:
    # 14 streams run steady; 6 more would fit at their steady cost, but a new stream needs three times that until it
    # is ahead of its playback: 14 + 3 + 3 = 20 streams' worth.
    admission = steady_pool(14)
    admission.observe_late(1.0, 0.3)  # closed for late_hold_s
    assert admission.headroom(2.0) == 0
    assert admission.headroom(3.5) == 2
    tickets = []
    for _ in range(6):  # six clients retry at the same instant
        if admission.admits(3.5):
            tickets.append(admission.opened(3.5))
    assert len(tickets) == 2
    assert admission.young == 2 and admission.headroom(3.5) == 0
    # Once they run ahead, their steady shares leave room for one more young stream (16 + 3 <= 20).
    for ticket in tickets:
        admission.ahead(ticket)
    assert admission.young == 0
    assert admission.headroom(4.0) == 1


def test_held_shares_admit_within_the_margin_not_past_the_workers() -> None:
    # 20 streams (the target load) run steady; 6 complete and keep their shares for the grace time.
    admission = steady_pool(20)
    for _ in range(6):
        admission.closed(1.0, keep_share=True)
    admission.observe_late(1.0, 0.3)  # and admission is closed
    admitted = sum(1 for _ in range(6) if admission.admits(1.5) and admission.opened(1.5))
    # Within the workers' whole time (25 streams' worth): 14 steady + 3 young at 3 each = 23; a fourth would be 26.
    assert admitted == 3
    assert admission.active == 17


def test_a_young_stream_that_never_gets_ahead_counts_for_young_max_s_only() -> None:
    admission = steady_pool(14)
    opened_at = 0.5
    for _ in range(2):
        assert admission.admits(opened_at)
        admission.opened(opened_at)  # waiting for text: they never run ahead
    assert not admission.admits(opened_at + 1.0)
    later = opened_at + admission.settings.young_max_s
    assert admission.young == 0 or admission.headroom(later) > 0
    assert admission.headroom(later) == 1  # 16 steady + 3 for one more young stream
    assert admission.young == 0


def test_a_closed_young_stream_frees_its_burst() -> None:
    admission = steady_pool(14)
    ticket = admission.opened(0.0)
    assert admission.headroom(0.0) == 1
    admission.closed(0.5, keep_share=False, ticket=ticket)
    assert admission.young == 0
    assert admission.headroom(0.5) == 2


def test_the_credit_limits_how_far_ahead_a_stream_must_run() -> None:
    admission = AdmissionController(1, max_streams=8)
    assert admission.ahead_lead_s(2000.0) == pytest.approx(1.0)  # young_lead_s
    assert admission.ahead_lead_s(500.0) == pytest.approx(0.4)  # a WebRTC outbox
    assert admission.ahead_lead_s(0.0) == pytest.approx(1.0)


def test_a_served_stream_running_out_of_slack_keeps_new_streams_out() -> None:
    admission = steady_pool(10)  # the estimate says three young streams more fit (10 + 3 * 3 <= 20)
    assert admission.headroom(1.0, slack_s=0.8) == 3
    # A stream that was ahead waits for a worker 0.1 s before it runs dry: the workers are behind, whatever the cost
    # estimate says, and a new stream would be served before it.
    assert admission.headroom(1.0, slack_s=0.1) == 0
    assert not admission.admits(1.0, slack_s=0.1)
    assert admission.admits(1.0, slack_s=None)  # nobody waits for a worker
    idle = AdmissionController(2, max_streams=8)
    assert idle.admits(0.0, slack_s=-1.0)  # an idle pool takes one stream all the same
