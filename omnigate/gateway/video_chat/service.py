"""The omni engine's life in a gateway process: loaded beside the speech engine when ``--omni-model`` names one."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from omnigate.engines.cpus import available_cpus
from omnigate.gateway.settings import Settings
from omnigate.gateway.video_chat.frames import FrameDecodePool
from omnigate.gateway.video_chat.image_budget import FrameBudget

if TYPE_CHECKING:
    from omnigate.engines.omni.engine import OmniEngine

log = logging.getLogger(__name__)


async def start_omni_engine(settings: Settings) -> OmniEngine | None:
    """Load and start the omni engine (off the event loop: it builds a model), or None without ``--omni-model``."""
    if not settings.omni_model:
        return None
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


async def stop_omni_engine(engine: OmniEngine | None) -> None:
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
