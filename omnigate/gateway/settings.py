"""Every limit and option of a gateway process, in one settings object (defaults from DESIGN §8)."""

from __future__ import annotations

import msgspec


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Gateway settings. ``omnigate serve --help`` documents each one."""

    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "piper"
    model: str | None = None
    engine_options: dict[str, str] = {}
    max_sessions: int | None = None  # None: the engine's slot count
    # kernel send buffer of each connection (None: the OS autotunes it, up to megabytes)
    socket_send_buffer_bytes: int | None = 64 * 1024
    # transport message limits
    ws_max_message_bytes: int = 4 * 1024 * 1024
    ws_max_text_event_bytes: int = 128 * 1024
    ws_max_config_bytes: int = 4 * 1024 * 1024
    http_max_body_bytes: int = 1024 * 1024
    max_input_chars: int = 4096
    # timeouts
    config_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    max_session_s: float = 3600.0
    stall_timeout_s: float = 10.0
    # generated audio buffered unsent per session
    ws_outbox_ms: float = 2000.0
    http_outbox_ms: float = 4000.0
    outbox_bytes: int = 2 * 1024 * 1024
    max_utterance_audio_s: float = 120.0
    ttfa_target_s: float = 0.25
    retry_after_s: float = 1.0
    # segmenter forced flush
    segment_max_chars: int = 120
    segment_max_wait_ms: float = 400.0
    log_level: str = "info"
