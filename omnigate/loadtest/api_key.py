"""The API key the load-test clients present, and how refusals of it are recognised.

A key comes from ``--api-key`` or, so it can stay out of process lists and shell history, from the environment
variable :data:`API_KEY_ENV`. Every request carries it as ``Authorization: Bearer <key>``. The key never shows
itself: its ``repr`` and ``str`` are masked, argparse errors do not echo it, and written reports pass through
:meth:`ApiKey.redact_json` in case a server quoted it back in an error message.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping

import msgspec

API_KEY_ENV = "OMNIGATE_API_KEY"
MASK = "***"
AUTH_REFUSAL_CODES = frozenset({"http_401", "http_403"})


class ApiKey:
    """A bearer credential that is sent, never shown."""

    __slots__ = ("_secret",)

    def __init__(self, secret: str) -> None:
        # Refused here rather than by every request later (a key pasted with its trailing newline); the message
        # never repeats the key.
        if not secret or not all("!" <= character <= "~" for character in secret):
            raise ValueError("an API key must be non-empty printable ASCII without spaces")
        self._secret = secret

    def headers(self) -> dict[str, str]:
        """The request headers that present the key."""
        return {"Authorization": f"Bearer {self._secret}"}

    def redact(self, text: str) -> str:
        """``text`` with every occurrence of the key masked."""
        return text.replace(self._secret, MASK)

    def redact_json(self, encoded: bytes) -> bytes:
        """A JSON document with every occurrence of the key, as JSON spells it inside a string, masked."""
        spelled = msgspec.json.encode(self._secret)[1:-1]
        return encoded.replace(spelled, MASK.encode())

    def __repr__(self) -> str:
        return f"ApiKey({MASK!r})"

    __str__ = __repr__


def auth_headers(key: ApiKey | None) -> dict[str, str]:
    """The headers that present ``key``; none without one."""
    return key.headers() if key is not None else {}


def parse_api_key(text: str) -> ApiKey:
    """An argparse ``type=`` for ``--api-key``: its error, unlike argparse's own, does not print the value."""
    try:
        return ApiKey(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_api_key_option(parser: argparse.ArgumentParser) -> None:
    """``--api-key KEY`` (default: the environment variable :data:`API_KEY_ENV`)."""
    parser.add_argument(
        "--api-key",
        type=parse_api_key,
        metavar="KEY",
        help=f"sent as Authorization: Bearer KEY on every request (default: ${API_KEY_ENV}, which keeps the key "
        "out of process lists and shell history)",
    )


def resolve_api_key(option: ApiKey | None, environ: Mapping[str, str]) -> ApiKey | None:
    """The key from the command line, else from the environment (unset or empty: no key).

    Raises ValueError (without the key in its message) for an unusable key in the environment.
    """
    if option is not None:
        return option
    value = environ.get(API_KEY_ENV, "")
    if not value:
        return None
    try:
        return ApiKey(value)
    except ValueError as exc:
        raise ValueError(f"{API_KEY_ENV}: {exc}") from None


def auth_refusal_notice(session_errors: Iterable[Mapping[str, int]], key_sent: bool) -> str | None:
    """What to tell the user when every session failed on authentication (HTTP 401/403 only), else None."""
    statuses: set[str] = set()
    sessions = 0
    for errors in session_errors:
        failed_codes = {code for code, count in errors.items() if count > 0}
        if not failed_codes or not failed_codes <= AUTH_REFUSAL_CODES:
            return None
        statuses |= failed_codes
        sessions += 1
    if sessions == 0:
        return None
    status = "/".join(sorted(code.removeprefix("http_") for code in statuses))
    if key_sent:
        return f"the server refused the API key: every session got HTTP {status}; check --api-key or ${API_KEY_ENV}"
    return f"the server requires an API key: every session got HTTP {status}; pass --api-key KEY or set ${API_KEY_ENV}"
