"""``omnigate serve`` options for authentication, per-key limits, drain and logs, and the startup safety check."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from omnigate.gateway.security.browser_guard import is_loopback
from omnigate.gateway.security.credentials import api_key_hash, read_api_keys_file
from omnigate.gateway.settings import Settings

_DEFAULTS = Settings()


def add_reliability_options(serve: argparse.ArgumentParser) -> None:
    auth = serve.add_argument_group("authentication")
    auth.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="accept this API key (Authorization: Bearer KEY), repeatable; visible to other local users in the "
        "process list, so prefer --api-keys-file",
    )
    auth.add_argument(
        "--api-keys-file",
        type=Path,
        help="file of API keys, one per line (or sha256:<hex digest> of a key); # starts a comment",
    )
    auth.add_argument(
        "--allow-unauthenticated-public",
        action="store_true",
        help="with no API key configured, still listen on a non-loopback address",
    )
    auth.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="without an API key on loopback, browser pages may use the server only from its own origin and from "
        "this one (scheme://host:port), repeatable; it gets CORS headers",
    )
    auth.add_argument("--metrics-auth", action="store_true", help="require an API key for /metrics too")
    auth.add_argument(
        "--client-secret-ttl",
        type=float,
        default=_DEFAULTS.client_secret_ttl_s,
        help="default lifetime in seconds of a browser client secret (POST /v1/realtime/client_secrets)",
    )
    auth.add_argument(
        "--web-token-url",
        default=_DEFAULTS.web_token_url,
        help="where the web client fetches a client secret before it connects (your app server's endpoint that "
        "calls POST /v1/realtime/client_secrets with an API key)",
    )
    lim = serve.add_argument_group("per-key limits and shutdown")
    lim.add_argument("--max-sessions-per-key", type=int, default=None, help="concurrent sessions per API key")
    lim.add_argument("--rate-limit", type=float, default=None, help="requests and connections per second per key")
    lim.add_argument(
        "--rate-burst", type=int, default=_DEFAULTS.request_burst_per_key, help="requests a key may send at once"
    )
    lim.add_argument(
        "--drain-timeout",
        type=float,
        default=_DEFAULTS.drain_timeout_s,
        help="seconds live utterances may finish after SIGTERM before their sessions are closed",
    )
    lim.add_argument(
        "--engine-step-timeout",
        type=float,
        default=_DEFAULTS.engine_step_timeout_s,
        help="an engine step running longer fails its requests and marks the engine unready",
    )
    serve.add_argument("--log-json", action="store_true", help="log one JSON object per line")


def reliability_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Settings fields from the options above. Raises ValueError for an unreadable or malformed keys file."""
    digests = [api_key_hash(key) for key in args.api_key]
    if args.api_keys_file is not None:
        digests.extend(read_api_keys_file(args.api_keys_file))
    return {
        "api_key_hashes": tuple(dict.fromkeys(digests)),
        "allow_unauthenticated_public": args.allow_unauthenticated_public,
        "allowed_origins": tuple(args.allow_origin),
        "metrics_require_auth": args.metrics_auth,
        "client_secret_ttl_s": args.client_secret_ttl,
        "web_token_url": args.web_token_url,
        "max_sessions_per_key": args.max_sessions_per_key,
        "requests_per_s_per_key": args.rate_limit,
        "request_burst_per_key": args.rate_burst,
        "drain_timeout_s": args.drain_timeout,
        "engine_step_timeout_s": args.engine_step_timeout,
        "log_json": args.log_json,
    }


def exposure_problem(settings: Settings) -> str | None:
    """Why the server must not start as configured: no API key on a non-loopback address, unless allowed."""
    if settings.api_key_hashes or settings.allow_unauthenticated_public or is_loopback(settings.host):
        return None
    return (
        f"refusing to listen on {settings.host} without authentication: give --api-key or --api-keys-file, "
        "or --allow-unauthenticated-public to serve anyone who can reach this address"
    )


def auth_summary(settings: Settings) -> str:
    """The line the server logs at start about who may use it."""
    if settings.api_key_hashes:
        return f"authentication on: {len(settings.api_key_hashes)} API key(s)"
    if is_loopback(settings.host):
        return "authentication off (no API key configured): listening on loopback only"
    return f"authentication OFF: anyone who reaches {settings.host} may use this server"
