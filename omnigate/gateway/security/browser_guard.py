"""Which browser pages may use a server that runs without authentication on loopback.

Without an API key anything that reaches the port may use the server, which on loopback means this machine's
programs, but also every web page its user opens: WebSockets are not covered by CORS, a page may POST to any
address, and DNS rebinding (a hostname of the attacker's that resolves to 127.0.0.1) even lets it read the answers.
So, while authentication is off on loopback:

- the ``Host`` header must name this server (``localhost``, a loopback address, or the bound host): a rebound
  hostname is refused;
- a request that carries an ``Origin`` (browsers send one on WebSockets and cross-origin requests) must come from
  the server's own pages (the origin of its ``Host``) or from an origin the operator allowed (``--allow-origin``),
  which also gets the CORS headers that let its pages read the answers.

Requests without an ``Origin`` (SDKs, curl, the load test) are not browser pages and pass. With API keys the
checks are off: a page cannot present a key it does not have.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

import msgspec
from starlette.types import Scope

from omnigate.gateway.settings import Settings

CORS_METHODS = b"GET, POST, OPTIONS"
CORS_HEADERS = b"authorization, content-type"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BrowserRefusal(Exception):
    """A request this server's browser policy refuses; ``code`` is the wire error code (HTTP 403)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class BrowserPolicy(msgspec.Struct, frozen=True):
    """The names this server answers to and the origins besides its own allowed to use it."""

    enabled: bool
    bound_host: str
    allowed_origins: frozenset[str] = frozenset()

    @classmethod
    def from_settings(cls, settings: Settings) -> BrowserPolicy:
        return cls(
            enabled=not settings.api_key_hashes and is_loopback(settings.host),
            bound_host=settings.host.lower(),
            allowed_origins=frozenset(normalize_origin(o) for o in settings.allowed_origins),
        )

    def check(self, scope: Scope) -> str | None:
        """Raise :class:`BrowserRefusal` for a request from a page that may not use this server; return the
        origin that must get CORS headers (an allowed foreign origin), else None."""
        if not self.enabled:
            return None
        headers = _headers(scope.get("headers", ()))
        host = headers.get(b"host")
        if host is not None and not self._names_this_server(host.decode("latin-1")):
            raise BrowserRefusal(
                "host_not_allowed",
                "the Host header does not name this server; without authentication it answers only to localhost "
                "and its loopback address",
            )
        origin = headers.get(b"origin")
        if origin is None:
            return None
        value = normalize_origin(origin.decode("latin-1"))
        if host is not None and value.partition("://")[2] == host.decode("latin-1").strip().lower():
            return None  # the server's own pages
        if value in self.allowed_origins:
            return value
        raise BrowserRefusal(
            "origin_not_allowed",
            f"requests from the web page origin {value!r} are not allowed without authentication; start the "
            "server with --allow-origin for it, or configure an API key",
        )

    def _names_this_server(self, host: str) -> bool:
        name = _hostname(host)
        if name in ("localhost", self.bound_host) or name.endswith(".localhost"):
            return True  # *.localhost always resolves to loopback in browsers: it cannot be rebound
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False


def normalize_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def cors_headers(origin: str, preflight: bool) -> list[tuple[bytes, bytes]]:
    """The CORS headers an allowed foreign origin gets on every response, and on a preflight's answer."""
    headers = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"origin")]
    if preflight:
        headers += [
            (b"access-control-allow-methods", CORS_METHODS),
            (b"access-control-allow-headers", CORS_HEADERS),
            (b"access-control-max-age", b"600"),
        ]
    return headers


def _headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    return {name.lower(): value for name, value in raw}


def _hostname(host: str) -> str:
    """The name of a ``Host`` header without its port (``[::1]:8000`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        return host.partition(":")[0]
    return host
