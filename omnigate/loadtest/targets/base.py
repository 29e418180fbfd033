"""What a load-test target is: something that runs one client session against a server and records its trace."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar
from urllib.parse import urlsplit, urlunsplit

import msgspec

from omnigate.loadtest.api_key import ApiKey, auth_headers
from omnigate.loadtest.report import TargetSpec, TtfaSlo
from omnigate.loadtest.traces import SessionTrace

URL_SCHEMES = ("http", "https", "ws", "wss")
"""Every built-in target takes a server URL of any of these: each transport maps the scheme to its own."""


def url_problem(url: str, schemes: Sequence[str] = URL_SCHEMES) -> str | None:
    """Why ``url`` cannot be a server URL (None when it can): it needs one of ``schemes`` and a host."""
    parts = urlsplit(url)
    if parts.scheme not in schemes:
        return f"a server URL starts with {' or '.join(f'{scheme}://' for scheme in schemes)}"
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number in range
    except ValueError:
        return "the port is not a number within 0..65535"
    if not parts.hostname:
        return "the URL names no host"
    return None


class SessionSettings(msgspec.Struct, frozen=True):
    """How every session of a run behaves, whatever the target."""

    words_per_second: float = 20.0
    """Pace of streamed text; 0 sends each utterance's text in one message."""
    utterance_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    video_fps: float = 2.0
    """Camera frames per second a ``video-chat`` session sends."""
    query_every_s: float = 5.0
    """Seconds a ``video-chat`` session waits after an answer before its next question."""
    api_key: ApiKey | None = None
    """Sent as ``Authorization: Bearer`` on every request and WebSocket handshake."""
    compression: bool = True
    """Offer ``permessage-deflate`` on WebSocket handshakes, as browsers and the ``websockets`` library do."""
    response_format: str | None = None
    """The audio format asked for; ``None`` asks for the target's default (what its real clients ask for)."""
    control_rate_hz: float = 10.0
    """``robot``: observations per second of each simulated robot."""
    robot_image_px: int | None = None
    """``robot``: side of the square camera images sent; None sends the size the policy's spec names."""


class Target(abc.ABC):
    """One kind of client. Subclasses set ``kind`` and implement :meth:`run_session`.

    A target records into the :class:`SessionTrace` it is given and turns every failure it can classify into
    ``trace.error(code)``; the runner ends the trace. Cancellation (the run is over) must propagate.
    """

    kind: ClassVar[str]
    formats: ClassVar[tuple[str, ...]] = ("pcm",)
    """The audio formats the target can ask for and measure; the first is its real clients' default."""
    schemes: ClassVar[tuple[str, ...]] = URL_SCHEMES
    """The URL schemes the target's server URL may have."""

    def __init__(self, spec: TargetSpec, settings: SessionSettings) -> None:
        self.spec = spec
        self.settings = settings
        fmt = settings.response_format or self.formats[0]
        if fmt not in self.formats:
            raise ValueError(f"the {self.kind} target measures {', '.join(self.formats)}, not {fmt!r}")
        self.response_format = fmt
        """The format every session asks for."""

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Acquire resources shared by all sessions (connection pools)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what :meth:`open` acquired."""

    @abc.abstractmethod
    async def run_session(self, texts: Sequence[str], trace: SessionTrace) -> None:
        """Run one session that speaks ``texts`` in order, one utterance each."""

    @classmethod
    def default_slo(cls, spec: TargetSpec) -> TtfaSlo | None:
        """The SLO the target's sessions are judged by when none is given, where its TTFA measures something other
        than a speech stream's first audio; None: the run's default. Raises ``ValueError`` for a bad ``spec``."""
        return None

    def auth_headers(self) -> dict[str, str]:
        """Headers every request of a session carries: the API key, when one is set."""
        return auth_headers(self.settings.api_key)

    def metrics_url(self) -> str:
        """Where the server publishes Prometheus metrics."""
        return http_url(self.spec.url, "/metrics")


def http_url(url: str, path: str) -> str:
    """``path`` on the server at ``url`` over HTTP(S), whatever scheme and path ``url`` has."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme or "http")
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def ws_url(url: str, default_path: str) -> str:
    """A WebSocket URL for ``url``: ``http(s)`` becomes ``ws(s)``, and a bare host gets ``default_path``."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme or "ws")
    path = parts.path if parts.path not in ("", "/") else default_path
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))
