"""Per-key limits: a request rate (token bucket) and a cap on concurrent sessions per key.

The session cap lives in the session registry, so it counts exactly the sessions routes admit, whatever their
transport and however long they live (a WebRTC session outlives its ``POST``). The key comes from the principal the
auth middleware put in the request's context.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from omnigate.gateway.security.credentials import current_principal
from omnigate.sessions.registry import SessionLease, SessionLimitReached, SessionRegistry


class TokenBucket:
    """``rate`` tokens per second up to ``burst``; starts full."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float) -> float:
        """Take one token: 0.0 when granted, else the seconds until one is available."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def full(self, now: float) -> bool:
        return self.tokens + (now - self.stamp) * self.rate >= self.burst


class KeyRateLimiter:
    """A token bucket per key. At most ``max_keys`` buckets are kept; the least recently used full one goes first
    (a full bucket carries no state worth keeping)."""

    def __init__(self, rate: float, burst: int, max_keys: int = 10_000) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def check(self, key: str, now: float) -> float:
        """0.0 when the request may proceed, else a Retry-After in seconds."""
        bucket = self._buckets.get(key)
        if bucket is None:
            self._make_room(now)
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, now)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(now)

    def _make_room(self, now: float) -> None:
        if len(self._buckets) < self.max_keys:
            return
        for key, bucket in self._buckets.items():
            if bucket.full(now):
                del self._buckets[key]
                return
        # Every bucket is in use: drop the least recently used (it refills to full, the lenient side).
        self._buckets.popitem(last=False)


class KeySessionLimitReached(SessionLimitReached):
    """The caller's key already holds its maximum number of sessions."""

    def __str__(self) -> str:
        return f"this API key is at its limit of {self.limit} concurrent sessions"


class KeyedSessionRegistry(SessionRegistry):
    """A session registry that also caps concurrent sessions per API key (``max_per_key``; None: no cap)."""

    def __init__(self, max_sessions: int, retry_after_s: float = 1.0, max_per_key: int | None = None) -> None:
        super().__init__(max_sessions, retry_after_s)
        self.max_per_key = max_per_key
        self._by_key: dict[str, set[SessionLease]] = {}

    def active_for(self, key: str) -> int:
        """Live sessions of ``key`` (released leases are dropped as they are counted)."""
        leases = self._by_key.get(key)
        if leases is None:
            return 0
        leases.difference_update([lease for lease in leases if lease.released])
        if not leases:
            del self._by_key[key]
        return len(leases)

    def key_full(self, key: str) -> bool:
        return self.max_per_key is not None and self.active_for(key) >= self.max_per_key

    def acquire(self, transport: str) -> SessionLease:
        principal = current_principal.get()
        key = principal.id if principal is not None and principal.kind != "anonymous" else None
        if key is not None and self.max_per_key is not None and self.key_full(key):
            self.refused_total["key_limit"] += 1
            raise KeySessionLimitReached(self.max_per_key, self.retry_after_s)
        lease = super().acquire(transport)
        if key is not None and self.max_per_key is not None:
            self._by_key.setdefault(key, set()).add(lease)
        return lease


def retry_after_header(seconds: float) -> str:
    """A Retry-After value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
