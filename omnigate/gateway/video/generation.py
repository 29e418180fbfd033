"""One video generation from ``video.create`` to ``video.done``, whatever carries its frames.

:func:`handle_client_text` answers one client event of a session (one generation at a time);
:func:`submit_generation` checks a ``video.create`` and takes an engine slot; :func:`run_generation` then sends
``video.start``, hands each decoded frame group to the transport's :class:`FrameOutlet` (fMP4 fragments on a
WebSocket, frames on a WebRTC track), and ends with ``video.done``. The outlet returns the engine's frame credit
once its frames are delivered, so a consumer that stops taking frames stops its own decoding.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from omnigate.engines.base import EngineError
from omnigate.engines.video.outputs import FrameGroup, PromptUpdated, VideoDone
from omnigate.gateway.video.protocol import (
    ProtocolError,
    SessionClose,
    VideoCancel,
    VideoCreate,
    VideoPrompt,
    chunk_event,
    decode_client_event,
    done_event,
    failed_event,
    prompt_updated_event,
    start_event,
)

if TYPE_CHECKING:
    from omnigate.engines.video.engine import VideoEngine, VideoJob
    from omnigate.engines.video.request import VideoRequest
    from omnigate.gateway.settings import Settings

log = logging.getLogger(__name__)

SendEvent = Callable[[dict[str, Any]], Awaitable[bool]]


class FrameOutlet(Protocol):
    """Where one generation's frames go. Each method returns False once the client is gone."""

    @property
    def frames_out(self) -> int:
        """Frames delivered so far (what ``video.done`` reports)."""
        ...

    @property
    def bytes_out(self) -> int | None:
        """Bytes sent so far, or None where the transport does not count them."""
        ...

    async def open(self, request: VideoRequest) -> str:
        """Get ready for ``request``; return the ``mime`` of ``video.start``."""
        ...

    async def begin(self) -> bool:
        """Right after ``video.start`` (an fMP4 init segment, say)."""
        ...

    async def deliver(self, group: FrameGroup, job: VideoJob) -> bool:
        """Deliver ``group`` and return its credit to ``job`` (:meth:`VideoJob.consumed`) once it is delivered."""
        ...

    async def finish(self, done: VideoDone) -> bool:
        """After the last frame group, before ``video.done``."""
        ...


class VideoSession(Protocol):
    """A client's session (a WebSocket, a WebRTC call): at most one generation at a time."""

    @property
    def job(self) -> VideoJob | None:
        """The generation in progress."""
        ...

    def start_generation(self, job: VideoJob) -> None:
        """Serve the admitted ``job`` (with :func:`run_generation`, in a task of its own)."""
        ...

    def cancel_generation(self) -> None:
        """Stop the generation in progress, if any (its ``video.done`` says ``cancelled``)."""
        ...

    async def send_event(self, body: dict[str, Any]) -> bool:
        """Send one JSON event; False once the client is gone."""
        ...


def rearm_receive_timeout(
    timeout: asyncio.Timeout | None, session_deadline: float, generating: bool, settings: Settings
) -> None:
    """Idle timeout while no video is being generated; otherwise only the session's maximum duration."""
    if timeout is None:
        return
    deadline = session_deadline
    if not generating:
        deadline = min(deadline, asyncio.get_running_loop().time() + settings.idle_timeout_s)
    timeout.reschedule(deadline)


async def handle_client_text(session: VideoSession, engine: VideoEngine, text: str, settings: Settings) -> bool:
    """Answer one client event: a bad one with a typed ``error`` (the session goes on); False on ``session.close``."""
    retry_after_s = settings.retry_after_s
    try:
        event = decode_client_event(text, settings.ws_max_text_event_bytes)
        if isinstance(event, SessionClose):
            return False
        if isinstance(event, VideoCancel):
            session.cancel_generation()
            return True
        if isinstance(event, VideoPrompt):
            await session.send_event(prompt_accepted(session.job, event))
            return True
        if session.job is not None:
            raise ProtocolError(
                "busy", "a video is already being generated here; send video.cancel or await video.done"
            )
        session.start_generation(submit_generation(engine, event, retry_after_s))
    except ProtocolError as exc:
        await session.send_event(exc.event())
    return True


def prompt_accepted(job: VideoJob | None, event: VideoPrompt) -> dict[str, Any]:
    """Hand a live stream its new prompt; the ``video.prompt.accepted`` event naming its id. Raises
    :class:`ProtocolError` when no live stream runs here or the prompt is refused."""
    # Imported here: the live engine loads torch models, which this module does not otherwise need.
    from omnigate.engines.video.live import LiveJob

    if not isinstance(job, LiveJob) or not job.request.live:
        raise ProtocolError("no_live_stream", "video.prompt needs a live stream here (video.create with live: true)")
    try:
        prompt_id = job.set_prompt(event.prompt)
    except EngineError as exc:
        raise ProtocolError(exc.code, exc.message, exc.param) from None
    return {"type": "video.prompt.accepted", "prompt_id": prompt_id}


def submit_generation(engine: VideoEngine, event: VideoCreate, retry_after_s: float) -> VideoJob:
    """Check ``event`` against the engine and take a slot (nothing runs if it fails). Raises :class:`ProtocolError`."""
    info = engine.info
    if event.model is not None and event.model not in (info.model, info.family):
        raise ProtocolError("model_not_found", f"model {event.model!r} is not served", "model")
    if event.live and event.num_frames is not None:
        raise ProtocolError(
            "invalid_value", "a live stream has no num_frames: it runs until video.cancel", "num_frames"
        )
    request = engine.resolve(
        event.prompt,
        width=event.width,
        height=event.height,
        num_frames=event.num_frames,
        fps=event.fps,
        steps=event.steps,
        seed=event.seed,
        guidance_scale=event.guidance_scale,
        live=event.live,
        chunk_frames=event.chunk_frames,
    )
    try:
        return engine.submit(request, loop=asyncio.get_running_loop())
    except EngineError as exc:
        extra: dict[str, Any] = {"retry_after": retry_after_s} if exc.code == "server_busy" else {}
        raise ProtocolError(exc.code, exc.message, exc.param, **extra) from None


async def run_generation(job: VideoJob, outlet: FrameOutlet, send_event: SendEvent) -> None:
    """Serve ``job`` to its end through ``outlet`` and ``send_event``; the job is cancelled (its slot freed) on the way
    out, also when the client is gone or the task is cancelled."""
    try:
        mime = await outlet.open(job.request)
        if not (await send_event(start_event(job.request, mime)) and await outlet.begin()):
            return
        while True:
            output = await job.next_output()
            if isinstance(output, PromptUpdated):
                if not await send_event(prompt_updated_event(output)):
                    return
                continue
            if isinstance(output, FrameGroup):
                if output.chunk_index is not None and not await send_event(chunk_event(output)):
                    return
                if not await outlet.deliver(output, job):
                    return
                continue
            if await outlet.finish(output):
                await send_event(done_event(output, outlet.frames_out, outlet.bytes_out))
            return
    except Exception as exc:
        log.exception("video streaming failed")
        await send_event(failed_event(exc, outlet.frames_out, outlet.bytes_out))
    finally:
        job.cancel()
