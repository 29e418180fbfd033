"""Who a request is: API keys (kept only as SHA-256 digests) and short-lived, single-session browser client secrets.

A client secret (``ek_...``) is minted by a caller holding an API key and inherits that key's identity, so the
per-key limits count the browser sessions it opens against the key that paid for them.
"""

from __future__ import annotations

import contextvars
import hashlib
import heapq
import secrets
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import msgspec

CLIENT_SECRET_PREFIX = "ek_"
HASH_PREFIX = "sha256:"

PrincipalKind = Literal["api_key", "client_secret", "anonymous"]


class Principal(msgspec.Struct, frozen=True):
    """An authenticated caller. ``id`` is safe to log (a digest prefix, never the key) and keys the limits."""

    id: str
    kind: PrincipalKind
    # the session configuration bound to a client secret (OpenAI's ``client_secrets`` ``session``), else None
    session: dict[str, Any] | None = None


ANONYMOUS = Principal("anonymous", "anonymous")

current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("omnigate_principal", default=None)
"""The principal of the request or WebSocket being served; set by the auth middleware for the app call."""


def api_key_hash(key: str) -> str:
    """The hex SHA-256 digest under which a key is configured."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_principal(digest: str) -> Principal:
    return Principal(f"key-{digest[:10]}", "api_key")


def read_api_keys_file(path: Path) -> list[str]:
    """Digests of the keys in a keys file: one key per line, or ``sha256:<hex>`` to avoid storing the key itself;
    blank lines and ``#`` comments are skipped. Raises ValueError for a malformed digest."""
    digests: list[str] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(HASH_PREFIX):
            digest = line.removeprefix(HASH_PREFIX).lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"{path}:{number}: expected sha256:<64 hex digits>")
            digests.append(digest)
        else:
            digests.append(api_key_hash(line))
    return digests


class ApiKeys:
    """The configured keys. Empty means authentication is off."""

    def __init__(self, digests: Iterable[str]) -> None:
        self._digests = frozenset(d.lower() for d in digests)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def lookup(self, presented: str) -> Principal | None:
        # Only digests are compared, so response timing reveals nothing about a configured key.
        digest = api_key_hash(presented)
        return key_principal(digest) if digest in self._digests else None


class SecretRefused(Exception):
    """A client secret that is unknown, expired or already used; ``code`` is the wire error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class StoreFull(Exception):
    """Too many unexpired client secrets are outstanding, in all or for the minting key."""


class MintedSecret(msgspec.Struct, frozen=True):
    value: str
    expires_at: float


class _Record(msgspec.Struct):
    owner: Principal
    expires_at: float
    session: dict[str, Any] | None
    used: bool = False


class ClientSecretStore:
    """Outstanding client secrets, bounded in number in all and per minting key; each admits one session before it
    expires.

    Secrets are kept by digest, so a memory dump holds none. ``now`` is wall-clock seconds (``time.time()``),
    the clock ``expires_at`` is reported in. Expired secrets are swept on every call; a used one keeps only its
    digest and expiry (to answer ``client_secret_used``), not its session.
    """

    def __init__(self, max_secrets: int, max_per_key: int | None = None) -> None:
        self.max_secrets = max_secrets
        self.max_per_key = max_per_key
        self._records: dict[str, _Record] = {}
        self._expiry: list[tuple[float, str]] = []  # heap of (expires_at, digest)
        self._per_key: Counter[str] = Counter()
        self.minted_total = 0

    def __len__(self) -> int:
        return len(self._records)

    def mint(self, owner: Principal, ttl_s: float, now: float, session: dict[str, Any] | None = None) -> MintedSecret:
        """A new secret for ``owner``. Raises :class:`StoreFull`."""
        self._expire(now)
        if len(self._records) >= self.max_secrets:
            raise StoreFull(f"{self.max_secrets} client secrets are outstanding")
        if self.max_per_key is not None and self._per_key[owner.id] >= self.max_per_key:
            raise StoreFull(f"this API key has {self.max_per_key} client secrets outstanding, its limit")
        value = CLIENT_SECRET_PREFIX + secrets.token_urlsafe(32)
        digest = api_key_hash(value)
        expires_at = now + ttl_s
        self._records[digest] = _Record(owner, expires_at, session)
        self._per_key[owner.id] += 1
        heapq.heappush(self._expiry, (expires_at, digest))
        self.minted_total += 1
        return MintedSecret(value, expires_at)

    def check(self, value: str, now: float) -> Principal:
        """The principal a secret stands for, without using it up. Raises :class:`SecretRefused`."""
        record = self._records.get(api_key_hash(value))
        self._expire(now)  # after the lookup: an expired secret is still told apart from an unknown one
        if record is None:
            raise SecretRefused("invalid_client_secret", "the client secret is not valid")
        if record.used:
            raise SecretRefused("client_secret_used", "the client secret was already used for a session")
        if now >= record.expires_at:
            raise SecretRefused("expired_client_secret", "the client secret has expired")
        return Principal(record.owner.id, "client_secret", record.session)

    def consume(self, value: str, now: float) -> Principal:
        """Use the secret for one session. Raises :class:`SecretRefused`."""
        principal = self.check(value, now)
        record = self._records[api_key_hash(value)]
        record.used = True
        record.session = None  # handed to the session it opens; nothing else needs it
        return principal

    def outstanding(self, owner_id: str) -> int:
        """Unexpired secrets minted by ``owner_id`` (used ones included until they expire)."""
        return self._per_key[owner_id]

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, digest = heapq.heappop(self._expiry)
            record = self._records.pop(digest, None)
            if record is not None:
                self._per_key[record.owner.id] -= 1
                if self._per_key[record.owner.id] <= 0:
                    del self._per_key[record.owner.id]
