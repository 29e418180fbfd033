"""The video-chat engine's life in a gateway process: the omni engine loaded beside the speech engine when
``--omni-model`` names one, or the served engine itself when it answers with its own voice (``--engine qwen3-omni``)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, cast

from omnigate.engines.cpus import available_cpus
from omnigate.engines.pool import EnginePool
from omnigate.engines.pool_api import EnginePoolAPI
from omnigate.gateway.settings import Settings
from omnigate.gateway.video_chat.frames import FrameDecodePool
from omnigate.gateway.video_chat.image_budget import FrameBudget

if TYPE_CHECKING:
    from omnigate.engines.omni.engine import OmniEngine
    from omnigate.engines.qwen3_omni.video_chat import Qwen3VideoChat

QWEN3_OMNI = "qwen3-omni"

log = logging.getLogger(__name__)


async def start_omni_engine(
    settings: Settings, pool: EnginePoolAPI[Any] | None = None
) -> OmniEngine | Qwen3VideoChat | None:
    """Load and start the omni engine (off the event loop: it builds a model); without ``--omni-model``, the pool's
    Qwen3-Omni engine when it serves one, else None."""
    if not settings.omni_model:
        if pool is None or pool.info.family != QWEN3_OMNI:
            return None
        from omnigate.engines.qwen3_omni.video_chat import Qwen3VideoChat  # torch: a qwen3-omni gateway has it

        if not isinstance(pool, EnginePool):
            # The engine core carries realtime answers only; video chat hands the engine frames in this process.
            log.warning(
                "video chat is not served: the %s engine runs in an engine core (--engine-process inline serves it)",
                QWEN3_OMNI,
            )
            return None
        chat = Qwen3VideoChat(cast(Any, pool.engine).turns)
        log.info(
            "video chat on %s: %d vision tokens a frame, in its own voice", chat.info.model, chat.info.tokens_per_frame
        )
        return chat
    from omnigate.engines.omni.engine import OmniEngine  # torch: imported only by a gateway that serves video chat

    engine = await asyncio.to_thread(OmniEngine.load, settings.omni_model, **settings.omni_options)
    engine.start()
    log.info(
        "omni engine %s ready: %d slots, %d vision tokens per frame%s",
        engine.info.model,
        engine.info.max_sessions,
        engine.info.tokens_per_frame,
        " (random weights: random text)" if engine.info.random_weights else "",
    )
    return engine


async def stop_omni_engine(engine: OmniEngine | Qwen3VideoChat | None) -> None:
    if engine is not None:
        await asyncio.to_thread(engine.stop)


def frame_decode_pool(settings: Settings) -> FrameDecodePool:
    """The pool that decodes every session's camera frames (its threads start with the first frame)."""
    threads = settings.video_chat_decode_threads
    if threads is None:
        # Decoding is CPU-bound: more threads than this would take the cores the loop and the encoders need.
        threads = max(1, min(4, available_cpus() // 4))
    if threads < 1 or settings.video_chat_max_decoding_frames < 1 or settings.video_chat_max_frame_pixels < 1:
        raise ValueError("the video chat frame decoding options must be positive")
    budget = FrameBudget(max_pixels=settings.video_chat_max_frame_pixels)
    return FrameDecodePool(threads, settings.video_chat_max_decoding_frames, budget)
