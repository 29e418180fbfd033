"""Arrival models: when sessions start. Sans-I/O; times are seconds from the start of a run."""

from __future__ import annotations

import random

import msgspec


class ClosedLoop(msgspec.Struct, frozen=True, tag="closed"):
    """``sessions`` concurrent sessions; each starts a new session as soon as its previous one ends.

    The workers start spread evenly over ``ramp_s`` so a server is not hit by every handshake at once.
    """

    sessions: int
    ramp_s: float = 0.0

    def start_offsets(self) -> list[float]:
        """When each worker starts its first session."""
        if self.sessions <= 0:
            return []
        step = self.ramp_s / self.sessions
        return [i * step for i in range(self.sessions)]


class OpenLoop(msgspec.Struct, frozen=True, tag="poisson"):
    """New sessions arrive as a Poisson process at ``rate`` per second, whatever the server's state.

    ``max_in_flight`` bounds the client's own resources; an arrival beyond it is recorded as a client overflow.
    """

    rate: float
    max_in_flight: int = 1000


ArrivalModel = ClosedLoop | OpenLoop


def arrival_label(arrival: ArrivalModel) -> str:
    """Short label: the session count of a closed loop, or the rate of an open loop."""
    if isinstance(arrival, ClosedLoop):
        return str(arrival.sessions)
    return f"{arrival.rate:g}/s"


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of ``rate`` per second over ``[0, duration_s)``, reproducible by seed."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    times: list[float] = []
    now = rng.expovariate(rate)
    while now < duration_s:
        times.append(now)
        now += rng.expovariate(rate)
    return times
