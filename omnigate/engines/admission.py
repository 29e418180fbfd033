"""Admission by headroom: admit one more stream only while the streams already served keep their deadlines. Sans-I/O.

The pool tells the controller what its workers did (each step's worker time and the audio it produced), when a
stream it serves was picked later than its deadline for want of a worker, and when streams open and close; the
caller passes the time in, nothing here reads a clock.

The model: a realtime stream needs one second of audio per second of wall time. From the pool's recent steps (its
real-time factor per stream: worker seconds per second of audio, with the fixed part of a batched step shared by
its batch) follows the worker time per second that N streams need; ``workers * target_load`` is what it has. A
stream is admitted when one more still fits. The statistics decay exponentially, so they follow the machine (steps
slow down when other processes take the cores) and keep their last values while the pool is idle.

A young stream costs more than its steady share: its first unit is due within the TTFA target and its next ones
must get ahead of its playback, so it needs several seconds of audio per second until it runs ``young_lead_s`` ahead
of its deadline. Until then (at most ``young_max_s`` after it opened) it is priced at ``young_cost_factor`` steady
streams, in the headroom that :meth:`headroom` reports and in every admission check, so the streams admitted but not
yet ahead count too: when admission reopens (closed-loop clients retry together) only as many new streams are
admitted as the spare time carries at their burst, not as many as would fit once they run steady.

Three more rules keep admitted streams on time:

* Before anything is measured (no audio produced yet, and no estimate from the engine's load: :meth:`seed`) the
  slots admit; the first steps measure the cost, and the rule below guards the start.
* A batched engine that measured its step time by batch size at load (:meth:`profile`) is priced by it from the
  first session on and never below it: the first steps are small batches whose cost barely grows with their rows,
  so the measured line alone would price a new row as free until the batch is large, and a burst of sessions
  arriving at once would be admitted past what the device steps within a frame.
* A stream picked later than its deadline by more than ``late_tolerance_s``, after it had been waiting for a worker,
  closes admission for ``late_hold_s``: the estimate was wrong (cores taken by others, longer texts), and the streams
  already admitted come first.
* The measured slack: while a stream that had got ahead of its playback has waited for a worker and runs less than
  ``min_slack_s`` before its deadline, nothing new is admitted (the pool passes that slack in): the workers are
  falling behind, whatever the estimate says, and a new stream would be served before it.

A stream that completes keeps its share for ``grace_s``: a session usually speaks again soon, and its next
utterance is admitted within the grace even while admission is closed, as long as the young streams' bursts still
fit the whole of the workers' time (the ``target_load`` margin is what a held share may use). The pool does not know
sessions, so the next stream to open takes such a share, whoever's it is. :meth:`headroom` does not count held shares
as taken, so they never keep a new session out for long.

A session may hold a place of its own (:meth:`reserve`): a gateway that serves the pool from another process asks
for it when the session connects, so the admission of sessions is decided here, exactly, whichever gateway process
they reach. A held place counts as a stream carried while its session has no stream open (young until its first
stream opens), and that session's streams open on it without another admission check. It is held until released.

Policy ``slots`` admits by the slot count alone (the behaviour without headroom): every rule above is off.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from typing import Literal

import msgspec

AdmissionPolicy = Literal["headroom", "slots"]
ADMISSION_POLICIES: tuple[AdmissionPolicy, ...] = ("headroom", "slots")


class AdmissionSettings(msgspec.Struct, frozen=True):
    """How the pool decides it has room for one more stream."""

    policy: AdmissionPolicy = "headroom"
    target_load: float = 0.8
    """Fraction of the workers' time that admitted streams may need (the rest absorbs bursts and the event loop)."""
    cost_halflife_s: float = 5.0
    """Half-life of the cost estimate's memory."""
    grace_s: float = 3.0
    """A completed stream's share is held this long for its session's next utterance."""
    late_tolerance_s: float = 0.05
    """Lateness of a waiting stream beyond this closes admission."""
    late_hold_s: float = 2.0
    """How long admission stays closed after a late stream."""
    young_cost_factor: float = 3.0
    """A young stream is priced at this many steady streams: its first unit at once and the next ahead of playback
    (piper: a one-second first unit within the 0.25 s TTFA target, then two seconds of audio in its first second)."""
    young_lead_s: float = 1.0
    """A stream is young until its audio runs this far ahead of its playback (or its credit's limit, if smaller)."""
    young_max_s: float = 3.0
    """A stream counts as young at most this long after it opened (one that waits for its text costs nothing)."""
    min_slack_s: float = 0.25
    """A stream that got ahead and now waits for a worker this close to its deadline keeps new streams out: the
    workers are behind before anyone is late (other processes took the cores, or the estimate is low)."""

    def __post_init__(self) -> None:
        if self.policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission policy must be one of {', '.join(ADMISSION_POLICIES)}, not {self.policy!r}")
        if not 0.0 < self.target_load <= 1.0:
            raise ValueError("target_load must be within (0, 1]")
        if self.cost_halflife_s <= 0 or self.grace_s < 0 or self.late_tolerance_s < 0 or self.late_hold_s < 0:
            raise ValueError("admission times must be positive (grace, tolerance and hold may be 0)")
        if self.young_cost_factor < 1.0 or self.young_lead_s < 0 or self.young_max_s < 0 or self.min_slack_s < 0:
            raise ValueError("young_cost_factor must be >= 1 and the young stream's times >= 0")


class AdmissionController:
    """Headroom of one engine pool; the pool calls it under its lock."""

    def __init__(
        self, workers: int, max_streams: int, max_batch: int = 1, settings: AdmissionSettings | None = None
    ) -> None:
        if workers < 1 or max_streams < 1 or max_batch < 1:
            raise ValueError("workers, max_streams and max_batch must be >= 1")
        self.settings = settings or AdmissionSettings()
        self.workers = workers
        self.max_streams = max_streams
        self.max_batch = max_batch
        self.active = 0
        # places held by sessions (:meth:`reserve`): ticket -> whether a stream of the session is open on it now
        self._held: dict[int, bool] = {}
        self._held_idle = 0
        self._reservations: deque[float] = deque()  # expiry times of completed streams' shares, ascending
        # streams admitted but not yet ahead of their playback: ticket -> when they opened (ascending)
        self._young: dict[int, float] = {}
        self._tickets = 0
        # decayed sums over steps: count, worker seconds d, audio seconds a, streams b, a*a, a*d
        self._n = 0.0
        self._d = 0.0
        self._a = 0.0
        self._b = 0.0
        self._aa = 0.0
        self._ad = 0.0
        self._decayed_at: float | None = None
        self._closed_until = -math.inf
        self._profile: tuple[tuple[int, float], ...] = ()
        self._profile_audio_s = 0.0
        self.refused_total = 0
        self.late_total = 0

    def seed(self, cost: float, weight_audio_s: float = 1.0) -> None:
        """Start from ``cost`` (measured at load) as if ``weight_audio_s`` of audio had been observed at it."""
        if cost > 0 and weight_audio_s > 0:
            self._add(cost * weight_audio_s, weight_audio_s, 1)

    def profile(self, steps: Sequence[tuple[int, float]], audio_ms_per_row: float) -> None:
        """Price steps by ``steps``, (rows, seconds) pairs measured at load, each row making ``audio_ms_per_row``
        of audio: :meth:`load` is never below what they say, and is known before any step was observed."""
        by_rows: dict[int, float] = {}
        for rows, seconds in steps:
            if rows >= 1 and seconds > 0:
                by_rows[int(rows)] = max(float(seconds), by_rows.get(int(rows), 0.0))
        points = tuple(sorted(by_rows.items()))
        if points and audio_ms_per_row > 0:
            self._profile = points
            self._profile_audio_s = audio_ms_per_row / 1000.0

    # ---- what the pool reports ---------------------------------------------------------------------------------

    def observe_step(self, now: float, worker_s: float, audio_ms: float, streams: int = 1) -> None:
        """A step of ``streams`` streams took ``worker_s`` of one worker's time and produced ``audio_ms`` of audio."""
        self._decay(now)
        self._add(max(0.0, worker_s), max(0.0, audio_ms) / 1000.0, max(1, streams))

    def observe_late(self, now: float, late_s: float) -> None:
        """A stream was picked ``late_s`` after its deadline, having waited for a worker all that time."""
        if late_s > self.settings.late_tolerance_s:
            self.late_total += 1
            self._closed_until = max(self._closed_until, now + self.settings.late_hold_s)

    def reserve(self, now: float, slack_s: float | None = None) -> int | None:
        """Hold a place for a session if one more stream fits now (``slack_s`` as for :meth:`headroom`): its ticket,
        or None (a refusal, counted). The place is young until the session's first stream opens on it."""
        if not self.admits(now, slack_s):
            return None
        self._tickets += 1
        self._held[self._tickets] = False
        self._held_idle += 1
        self._young[self._tickets] = now
        return self._tickets

    def holds(self, ticket: int) -> bool:
        """Whether ``ticket`` is a held place with no stream open on it (a stream of its session may take it)."""
        return self._held.get(ticket) is False

    def release(self, ticket: int) -> None:
        """The session of a held place ended; a stream still open on it keeps counting until it closes."""
        in_use = self._held.pop(ticket, None)
        self._young.pop(ticket, None)
        if in_use is False:
            self._held_idle -= 1

    @property
    def held(self) -> int:
        """Places held by sessions."""
        return len(self._held)

    def opened(self, now: float, held: int | None = None) -> int:
        """A stream was admitted (after :meth:`admits` said yes, or on the held place ``held``, which :meth:`holds`
        said is free); returns its ticket, young until :meth:`ahead`."""
        self._expire(now)
        if held is not None and self.holds(held):
            self._held[held] = True
            self._held_idle -= 1
            self._young.pop(held, None)  # the stream's own ticket prices its burst from here
        elif self._reservations:
            self._reservations.popleft()
        self.active += 1
        self._tickets += 1
        self._young[self._tickets] = now
        return self._tickets

    def ahead(self, ticket: int) -> None:
        """The stream runs ahead of its playback now (see :meth:`ahead_lead_s`): its steady share is all it needs."""
        self._young.pop(ticket, None)

    def ahead_lead_s(self, credit_ms: float) -> float:
        """How far ahead of its deadline a stream with ``credit_ms`` of credit must run to stop being young."""
        limit_s = 0.8 * credit_ms / 1000.0  # a stream cannot run further ahead than its consumer has room for
        return min(self.settings.young_lead_s, limit_s) if limit_s > 0 else self.settings.young_lead_s

    @property
    def young(self) -> int:
        """Streams admitted but not yet ahead of their playback."""
        return len(self._young)

    def closed(self, now: float, *, keep_share: bool, ticket: int | None = None, held: int | None = None) -> None:
        """A stream ended; with ``keep_share`` (it completed) its share is held for the grace time, unless it ran on
        the held place ``held``, which its session keeps."""
        self.active = max(0, self.active - 1)
        if ticket is not None:
            self._young.pop(ticket, None)
        if held is not None and self._held.get(held) is True:
            self._held[held] = False
            self._held_idle += 1
            return
        if keep_share and self.settings.policy == "headroom" and self.settings.grace_s > 0:
            self._expire(now)
            self._reservations.append(now + self.settings.grace_s)

    # ---- what the pool asks ------------------------------------------------------------------------------------

    @property
    def cost(self) -> float | None:
        """Worker seconds per second of one stream's audio at the current load; None until audio was produced."""
        load = self.load(max(1, self.active))
        return None if load is None else load / max(1, self.active)

    def load(self, streams: float) -> float | None:
        """Worker seconds per second that ``streams`` realtime streams need, at the recent cost; None if unknown.

        A one-stream-per-step engine costs in proportion to the audio it makes (the ratio of worker time to audio).
        A batched engine's step has a fixed part its streams share and a part per audio (a least-squares line of
        step time over step audio); while the batch size has not varied, the step time counts as fixed. With a
        step profile (:meth:`profile`), the load is at least the profile's: every stream stepped once per frame.
        """
        floor = self._profile_load(streams)
        if self._a <= 0.0:
            return floor
        measured = self._measured_load(streams)
        return measured if floor is None else max(measured, floor)

    def _measured_load(self, streams: float) -> float:
        if self.max_batch == 1:
            return streams * self._d / self._a
        mean_a, mean_d = self._a / self._n, self._d / self._n
        var_a = self._aa / self._n - mean_a * mean_a
        slope = 0.0
        if var_a > (0.05 * mean_a) ** 2:
            slope = max(0.0, (self._ad / self._n - mean_a * mean_d) / var_a)
        fixed = max(0.0, mean_d - slope * mean_a)
        audio_per_stream_step = self._a / self._b
        batch = min(self.max_batch, max(1, math.ceil(streams / self.workers)))
        return slope * streams + fixed * streams / (batch * audio_per_stream_step)

    def _profile_load(self, streams: float) -> float | None:
        """Worker seconds per second that ``streams`` need by the step profile: batches of up to ``max_batch``
        rows per worker, each row ``_profile_audio_s`` of audio per step; None without a profile."""
        if not self._profile:
            return None
        batch = min(self.max_batch, max(1, math.ceil(streams / self.workers)))
        return streams * _interpolate(self._profile, batch) / (batch * self._profile_audio_s)

    def headroom(self, now: float, slack_s: float | None = None, limit: int | None = None) -> int:
        """How many more streams the workers would carry now, beyond the active ones (at most ``limit``).
        ``slack_s``: how far ahead of its deadline runs the most pressed stream that got ahead of its playback and
        now waits for a worker. Each stream counted prices the load once more, so a caller that only asks whether
        one more fits passes ``limit=1`` (a full count at a thousand streams takes milliseconds)."""
        self._expire(now)
        carried = self.active + self._held_idle
        room = self.max_streams - carried if limit is None else min(self.max_streams - carried, limit)
        if self.settings.policy == "slots":
            return max(0, room)
        if now < self._closed_until or (slack_s is not None and slack_s < self.settings.min_slack_s):
            return min(room, 1) if carried == 0 else 0  # an idle pool always takes one stream (see _fits)
        extra = 0
        while extra < room and self._fits(carried, extra, self.settings.target_load):
            extra += 1
        return extra

    def admits(self, now: float, slack_s: float | None = None) -> bool:
        """Whether one more stream may open now (``slack_s`` as for :meth:`headroom`); counts a refusal when not."""
        self._expire(now)
        carried = self.active + self._held_idle
        if self.settings.policy == "slots":
            ok = carried < self.max_streams
        elif self._reservations:
            # A reserved share is this stream's (or a newcomer's within the grace): the pool carried it already, and
            # it may use the margin, not more: the young streams' bursts must still fit the workers.
            ok = carried < self.max_streams and self._fits(carried, 0, 1.0)
        else:
            ok = self.headroom(now, slack_s, limit=1) > 0
        if not ok:
            self.refused_total += 1
        return ok

    def retry_after_s(self, now: float, default_s: float) -> float:
        """A retry hint: the end of a closed period, or ``default_s``."""
        if self.settings.policy == "headroom" and now < self._closed_until:
            return max(default_s, self._closed_until - now)
        return default_s

    # ---- internals ---------------------------------------------------------------------------------------------

    def _fits(self, carried: int, extra: int, target_load: float) -> bool:
        """Whether one more young stream, beyond ``carried`` and ``extra`` new (young) ones, keeps every stream on
        time within ``target_load`` of the workers."""
        if carried + extra == 0:
            return True  # an idle pool takes one stream, whatever it costs: refusing it would help nobody
        streams = carried + extra
        young = min(carried, len(self._young)) + extra
        factor = self.settings.young_cost_factor
        priced = self.load(streams + (factor - 1.0) * young + factor)  # steady shares, the young at their burst
        if priced is None:
            return True  # nothing measured yet: the first steps measure it, and a late stream closes admission
        if priced <= self.workers * target_load + 1e-9:
            return True
        if self._profile:
            return False  # a row's cost is known from the profile: none is free
        # A batch slot that adds no measurable work (a fixed-cost step, where a young stream is one more row like
        # any other) is free while the workers keep up.
        before, after = self.load(streams), self.load(streams + 1)
        assert before is not None and after is not None
        return after - before <= 0.01 * self.workers and after <= self.workers

    def _add(self, d: float, a: float, b: int) -> None:
        self._n += 1.0
        self._d += d
        self._a += a
        self._b += b
        self._aa += a * a
        self._ad += a * d

    def _decay(self, now: float) -> None:
        if self._decayed_at is not None and now > self._decayed_at:
            factor = 0.5 ** ((now - self._decayed_at) / self.settings.cost_halflife_s)
            self._n *= factor
            self._d *= factor
            self._a *= factor
            self._b *= factor
            self._aa *= factor
            self._ad *= factor
        if self._decayed_at is None or now > self._decayed_at:
            self._decayed_at = now

    def _expire(self, now: float) -> None:
        while self._reservations and self._reservations[0] <= now:
            self._reservations.popleft()
        while self._young:
            ticket, opened_at = next(iter(self._young.items()))
            if opened_at + self.settings.young_max_s > now:
                break
            del self._young[ticket]


def _interpolate(points: tuple[tuple[int, float], ...], rows: int) -> float:
    """Seconds of a step of ``rows`` rows: linear between the measured sizes, the last segment extended, never below
    the smallest step measured."""
    if len(points) == 1 or rows <= points[0][0]:
        return points[0][1]
    (r0, s0), (r1, s1) = points[-2], points[-1]
    for low, high in itertools.pairwise(points):
        if rows <= high[0]:
            (r0, s0), (r1, s1) = low, high
            break
    return max(points[0][1], s0 + (s1 - s0) * (rows - r0) / (r1 - r0))
