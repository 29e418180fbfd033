"""Every limit and option of a gateway process, in one settings object (defaults from DESIGN §8)."""

from __future__ import annotations

import msgspec

from omnigate.engines.admission import AdmissionPolicy
from omnigate.engines.base import MIN_SPEED

# OpenAI's limit on the input of one speech request.
MAX_INPUT_CHARS = 4096
# The slowest speech the audio limit is sized for: 10 characters a second at speed 1 (slow, deliberate reading;
# piper's voice reads the load-test corpus at 16.5), slower still by the request's speed.
SLOWEST_CHARS_PER_S = 10.0
# The conversation sent to the embedded LLM at most: its 2048-token context less a 512-token answer, at the ~3.5
# characters a token of SmolLM2's tokenizer on English, with room for the chat markup.
EMBEDDED_LLM_HISTORY_CHARS = 4_500


class ResponderSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The services a ``/v1/realtime`` session answers the user with (``serve --llm-url``, ``--asr-url``): an
    OpenAI-compatible chat-completions server, streamed, and optionally a transcription server. URLs are the base an
    OpenAI SDK takes (``http://host:port/v1``); API keys go out as ``Authorization: Bearer``. Without an LLM URL,
    ``embedded_llm`` answers with the model embedded in the server (``serve`` without ``--no-embedded-agent``)."""

    llm_url: str | None = None  # wins over embedded_llm
    embedded_llm: bool = False  # the embedded LLM (omnigate.engines.llm), loaded in the background at startup
    llm_model: str | None = None  # None: the request names no model (vLLM and llama.cpp serve their own)
    llm_api_key: str | None = None
    llm_max_tokens: int = 1024  # per response, below a smaller max_output_tokens of the session
    # the embedded LLM's first answer's sampling seed, counting up by one per answer (None: random): answers that
    # repeat from one start to the next, for tests and demos
    llm_seed: int | None = None
    llm_first_token_timeout_s: float = 10.0
    llm_idle_timeout_s: float = 10.0  # between two streamed chunks
    llm_timeout_s: float = 120.0  # a whole reply
    asr_url: str | None = None  # None: the embedded recognizer hears spoken turns (or, without it, text only)
    asr_model: str = "whisper-1"
    asr_api_key: str | None = None
    asr_timeout_s: float = 15.0  # a whole transcription
    asr_max_audio_s: float = 60.0  # of one turn's audio sent to transcription (the newest is kept)
    # without asr_url: pocketsphinx in this process hears spoken turns as they come (off: user turns are text only)
    embedded_asr: bool = True
    embedded_asr_max_decoders: int = 8  # turns heard at once (a decoder holds about 95 MB)
    connect_timeout_s: float = 3.0
    history_max_chars: int = 24_000  # the conversation sent to the LLM, oldest dropped first (about 6k tokens)

    def __post_init__(self) -> None:
        timeouts = (
            self.llm_first_token_timeout_s,
            self.llm_idle_timeout_s,
            self.llm_timeout_s,
            self.asr_timeout_s,
            self.connect_timeout_s,
        )
        if min(timeouts) <= 0:
            raise ValueError("the LLM and transcription timeouts must be positive")
        if self.llm_max_tokens < 1 or self.history_max_chars < 1 or self.asr_max_audio_s <= 0:
            raise ValueError("--llm-max-tokens, --history-max-chars and --asr-max-audio must be positive")
        if self.embedded_asr_max_decoders < 1:
            raise ValueError("the embedded recognizer needs at least one decoder")
        if self.llm_seed is not None and (self.llm_url is not None or not 0 <= self.llm_seed < 2**63):
            raise ValueError("--llm-seed seeds the embedded LLM (not one at --llm-url), from 0 to 2**63-1")
        if self.llm_url is None and not self.embedded_llm:
            raise ValueError("the responder needs an LLM: --llm-url, or the embedded one")
        for name, url in (("--llm-url", self.llm_url), ("--asr-url", self.asr_url)):
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(f"{name} must be an http:// or https:// URL, got {url!r}")


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Gateway settings. ``omnigate serve --help`` documents each one."""

    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "hibari"
    model: str | None = None
    engine_options: dict[str, str] = {}
    # where engines run: "local" (this process) or "ray" (engine replicas on a Ray cluster, see deploy/)
    engine_pool: str = "local"
    ray_address: str | None = None  # None: RAY_ADDRESS, or a cluster started on this machine
    ray_app_prefix: str = "omnigate-engine"  # engine replicas are the Serve applications named PREFIX-N
    # where a local engine runs: "core" (an engine-core process the gateway processes attach to), "inline" (in the
    # gateway process), "auto" (core for GPU model engines and for several workers, inline otherwise)
    engine_process: str = "auto"
    workers: int = 0  # gateway processes sharing the port (SO_REUSEPORT) on one engine core; 0: by the cores
    # set in a gateway worker: the engine core's Unix socket, which this process reaches instead of loading the engine
    core_socket: str | None = None
    # the video engine, loaded beside the speech engine only when a model is named (WS /v1/realtime/video)
    video_model: str | None = None
    video_options: dict[str, str] = {}
    # the robot policy (WS /v1/realtime/robot/openpi), loaded only when a model is named
    robot_model: str | None = None
    robot_options: dict[str, str] = {}
    robot_max_observation_bytes: int = 2 * 1024 * 1024  # one msgpack observation (three 224x224 cameras: 450 KB)
    # the omni engine of live video chat, loaded only when a model is named (WS /v1/video/chat/stream)
    omni_model: str | None = None
    omni_options: dict[str, str] = {}
    # camera frames of video chat: decoded on a pool of their own, each within a budget checked before decoding
    video_chat_max_frame_pixels: int = 3840 * 2160  # a frame's width x height from its header (a 4K camera frame)
    video_chat_decode_threads: int | None = None  # None: a quarter of the cores, 1 to 4 (decoding is CPU-bound)
    video_chat_max_decoding_frames: int = 64  # received and not yet decoded, all sessions together
    # a duplex engine beside a TTS main engine (WS /v1/duplex, /v1/realtime?duplex=1); --engine duplex serves only it
    duplex_model: str | None = None
    duplex_options: dict[str, str] = {}
    # the LLM (and transcription) that make /v1/realtime answer the user; None: the route speaks what clients send
    responder: ResponderSettings | None = None
    realtime_input_max_bytes: int = 1024 * 1024  # realtime input audio pending per session (24 kHz s16le)
    duplex_turn_end_ms: float = 480.0  # a duplex model listening this long has ended its turn (its response)
    max_sessions: int | None = None  # None: the engine's slot count
    # kernel send buffer of each connection (None: the OS autotunes it, up to megabytes)
    socket_send_buffer_bytes: int | None = 64 * 1024
    # transport message limits
    ws_max_message_bytes: int = 4 * 1024 * 1024
    ws_max_text_event_bytes: int = 128 * 1024
    ws_max_config_bytes: int = 4 * 1024 * 1024
    http_max_body_bytes: int = 1024 * 1024
    max_input_chars: int = MAX_INPUT_CHARS  # one HTTP request's input
    # speech-stream text: one utterance's (input.text events up to input.done), and accepted but not yet spoken
    # per session (16 384 characters are some 17 minutes of speech at speed 1)
    max_utterance_chars: int = 16_384
    max_pending_input_chars: int = 65_536
    # timeouts
    config_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    max_session_s: float = 3600.0
    stall_timeout_s: float = 10.0
    # generated audio buffered unsent per session
    ws_outbox_ms: float = 2000.0
    http_outbox_ms: float = 4000.0
    webrtc_outbox_ms: float = 500.0  # the RTP track consumes exactly in real time
    outbox_bytes: int = 2 * 1024 * 1024
    # the longest input at the slowest speech and speed fits (1638.4 s): no request the API accepts is cut
    max_utterance_audio_s: float = MAX_INPUT_CHARS / (SLOWEST_CHARS_PER_S * MIN_SPEED)
    ttfa_target_s: float = 0.25
    # admission: "headroom" admits a stream only while the engine keeps every admitted stream on time; "slots" admits
    # up to the engine's slot count
    admission: AdmissionPolicy = "headroom"
    admission_target_load: float = 0.8  # fraction of the engine workers' time admitted streams may need
    retry_after_s: float = 1.0
    # segmenter forced flush
    segment_max_chars: int = 120
    segment_max_wait_ms: float = 400.0
    # WebRTC (POST /v1/realtime/calls)
    webrtc_host_addresses: tuple[str, ...] = ()  # ICE host candidates; empty: every interface but loopback
    webrtc_udp_ports: tuple[int, int] | None = None  # inclusive UDP port range for ICE; None: OS-chosen ports
    webrtc_stun_servers: tuple[str, ...] = ()  # stun: URLs; none: host candidates only, no STUN wait
    webrtc_ice_timeout_s: float = 15.0  # a call whose ICE/DTLS has not connected by then is closed
    webrtc_max_offer_bytes: int = 64 * 1024
    webrtc_opus_bitrate: int = 32_000
    webrtc_microphone_bytes: int = 1024 * 1024  # inbound audio kept per call (mono s16le 48 kHz), oldest dropped
    log_level: str = "info"
    log_json: bool = False  # one JSON object per log line (session ids, never text or audio)
    # authentication: SHA-256 hex digests of the accepted API keys (the process never keeps a key itself)
    api_key_hashes: tuple[str, ...] = ()
    allow_unauthenticated_public: bool = False  # with no key, serve beyond loopback anyway
    # web page origins (https://app.example:3000) besides the server's own that may use it while auth is off
    allowed_origins: tuple[str, ...] = ()
    metrics_require_auth: bool = False
    client_secret_ttl_s: float = 60.0  # default lifetime of a browser client secret
    client_secret_max_ttl_s: float = 7200.0
    max_client_secrets: int = 10_000  # unexpired secrets held at once
    max_client_secrets_per_key: int = 1_000  # of them minted by one API key (one tenant cannot lock out the rest)
    client_secret_max_session_bytes: int = 16 * 1024  # the session configuration kept with a secret, as JSON
    web_token_url: str | None = None  # where the web client fetches a client secret (None: no auth on the page)
    # per-key limits (None: unlimited)
    max_sessions_per_key: int | None = None
    requests_per_s_per_key: float | None = None
    request_burst_per_key: int = 20
    # graceful drain on SIGTERM: live utterances may finish for this long
    drain_timeout_s: float = 25.0
    # engine faults: a step running longer fails its streams; this many failed steps in a row make /ready unready
    engine_step_timeout_s: float = 60.0
    engine_failure_threshold: int = 3


def responder_summary(settings: Settings) -> dict[str, bool] | None:
    """What clients may know of the responder (never its URLs or keys): None without one."""
    if settings.responder is None:
        return None
    responder = settings.responder
    return {"transcription": responder.asr_url is not None or responder.embedded_asr}
