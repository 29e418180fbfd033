"""What a running gateway process holds: settings, the engine pool, the session registry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnigate.engines.duplex.stats import ClockStats
from omnigate.engines.omni.stats import ThinkerStats
from omnigate.engines.pool_api import EnginePoolAPI
from omnigate.engines.qwen3_omni.encoder_stats import EncoderStats
from omnigate.gateway.settings import Settings
from omnigate.sessions.registry import SessionRegistry
from omnigate.sessions.speech import SessionLimits

if TYPE_CHECKING:
    from omnigate.engines.policy.pool import PolicyPool
    from omnigate.gateway.robot.decode import ObservationDecoder


@dataclass(eq=False)
class Gateway:
    """The process-wide state the routes share (``request.app.state.gateway``)."""

    settings: Settings
    pool: EnginePoolAPI[Any] | None = None
    registry: SessionRegistry = field(default_factory=lambda: SessionRegistry(0))
    load_error: str | None = None
    robot_pool: PolicyPool | None = None  # the robot policy scheduler, when --robot-model names a policy
    robot_decoder: ObservationDecoder | None = None  # the robot route's observation-decoding threads, beside it
    duplex_stats: ClockStats | None = None  # the duplex engine's tick clock, when one serves /v1/realtime
    # the Qwen3-Omni input encoder's counters (in this process, or as the engine core last sent them)
    encoder_stats: EncoderStats | None = None
    omni_stats: ThinkerStats | None = None  # the omni thinker's worker loop, when one serves video chat

    @property
    def ready(self) -> bool:
        return self.pool is not None and not self.registry.draining and self.pool.healthy

    def served_models(self) -> frozenset[str]:
        """Names a client may put in ``model``: the model id, the engine family, and OpenAI's TTS model names."""
        assert self.pool is not None
        info = self.pool.info
        return frozenset({info.model, info.family, "tts-1", "tts-1-hd", "gpt-4o-mini-tts"})

    def limits(self, outbox_ms: float) -> SessionLimits:
        s = self.settings
        return SessionLimits(
            outbox_media_ms=outbox_ms,
            outbox_bytes=s.outbox_bytes,
            idle_timeout_ms=s.idle_timeout_s * 1000.0,
            max_session_ms=s.max_session_s * 1000.0,
            max_utterance_chars=s.max_utterance_chars,
            max_pending_chars=s.max_pending_input_chars,
        )
