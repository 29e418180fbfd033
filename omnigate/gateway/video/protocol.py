"""The video generation protocol, whatever carries it (``WS /v1/realtime/video``, the ``video`` data channel of a
WebRTC video call): client events, their checks as typed errors, and the server's JSON events.

Client events: ``video.create`` {prompt, width, height, num_frames, fps, steps, seed, guidance_scale, live,
chunk_frames} (all but the prompt optional: the model's defaults), ``video.prompt`` {prompt} (a live stream's new
prompt), ``video.cancel``, ``session.close``. Server: ``video.start`` {mime, width, height, fps, num_frames, seed,
live}, ``video.chunk`` {index, frames, prompt_id} before each chunk's media (chunk-causal models),
``video.prompt.accepted`` {prompt_id} (at once), ``video.prompt.updated`` {prompt_id, chunk_index, step} (before the
first chunk generated with it), ``video.done`` {status, frames, bytes, stats, code}, and
``error`` {code, message, param} for a bad message, after which the session stays usable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from omnigate.engines.video.outputs import (
    FrameGroup,
    PromptUpdated,
    VideoDone,
    decoded_before_first_consumed,
    first_time,
)
from omnigate.gateway.errors import UNDECODABLE, describe_validation_error, json_error
from omnigate.gateway.json_budget import CODE as JSON_BUDGET_CODE
from omnigate.gateway.json_budget import json_budget_problem
from omnigate.gateway.speech.protocol import event_type_of

if TYPE_CHECKING:
    from omnigate.engines.video.request import VideoRequest


class VideoCreate(msgspec.Struct, tag="video.create", forbid_unknown_fields=True, kw_only=True):
    """Start a generation; fields left out take the model's defaults (a random seed)."""

    prompt: str
    model: str | None = None
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    steps: int | None = None
    seed: int | None = None
    guidance_scale: float | None = None
    live: bool = False  # stream until video.cancel (a chunk-causal model; no num_frames)
    chunk_frames: int | None = None  # latent frames per chunk (chunk-causal models)


class VideoPrompt(msgspec.Struct, tag="video.prompt", forbid_unknown_fields=True):
    """Change a live stream's prompt from its next chunk on (answered by ``video.prompt.updated``)."""

    prompt: str


class VideoCancel(msgspec.Struct, tag="video.cancel", forbid_unknown_fields=True):
    """Stop the generation in progress (its ``video.done`` says ``cancelled``); ignored when there is none."""


class SessionClose(msgspec.Struct, tag="session.close", forbid_unknown_fields=True):
    """Cancel what runs and close the session normally."""


ClientEvent = VideoCreate | VideoPrompt | VideoCancel | SessionClose
CLIENT_EVENT_TYPES = ("video.create", "video.prompt", "video.cancel", "session.close")


class ProtocolError(Exception):
    """A client message refused with one typed ``error`` event; the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.extra = extra

    def event(self) -> dict[str, Any]:
        """The ``error`` event to send."""
        extra = dict(self.extra)
        if self.param is not None:
            extra["param"] = self.param
        return json_error(self.code, self.message, **extra)


def decode_client_event(text: str, max_bytes: int) -> ClientEvent:
    """One client event from its JSON text. Raises :class:`ProtocolError`."""
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise ProtocolError("message_too_large", f"event of {size} bytes exceeds the limit of {max_bytes} bytes")
    problem = json_budget_problem(text)
    if problem is not None:
        raise ProtocolError(JSON_BUDGET_CODE, problem)
    try:
        event: ClientEvent = msgspec.json.decode(text, type=ClientEvent)
    except msgspec.ValidationError as exc:
        kind = event_type_of(text)
        if kind is None:
            raise ProtocolError(
                "invalid_event", "each message must be a JSON object with a string 'type' field"
            ) from None
        if kind not in CLIENT_EVENT_TYPES:
            expected = list(CLIENT_EVENT_TYPES)
            raise ProtocolError("unknown_event", f"unknown event type {kind!r}; expected one of {expected}") from None
        message, param = describe_validation_error(exc)
        raise ProtocolError("invalid_event", f"invalid {kind}: {message}", param) from None
    except UNDECODABLE:
        raise ProtocolError("invalid_json", "message is not valid JSON") from None
    return event


def binary_refused() -> ProtocolError:
    """The error for a binary message: every client event is JSON text."""
    return ProtocolError("invalid_message", "binary messages are not accepted on this endpoint; send JSON text")


def start_event(request: VideoRequest, mime: str) -> dict[str, Any]:
    """``video.start``: what the frames that follow are (``mime``) and the request as resolved."""
    return {
        "type": "video.start",
        "mime": mime,
        "width": request.width,
        "height": request.height,
        "fps": request.fps,
        "num_frames": None if request.live else request.num_frames,
        "seed": request.seed,
        "live": request.live,
    }


def chunk_event(group: FrameGroup) -> dict[str, Any]:
    """``video.chunk``: the chunk whose media follows, and the prompt it was generated with."""
    return {"type": "video.chunk", "index": group.chunk_index, "frames": group.count, "prompt_id": group.prompt_id}


def prompt_updated_event(update: PromptUpdated) -> dict[str, Any]:
    """``video.prompt.updated``: from which chunk on the stream follows the new prompt."""
    return {
        "type": "video.prompt.updated",
        "prompt_id": update.prompt_id,
        "chunk_index": update.chunk_index,
        "step": update.step,
    }


def done_event(done: VideoDone, frames: int, total_bytes: int | None) -> dict[str, Any]:
    """``video.done`` with the engine's timeline condensed to stats; ``bytes`` when the transport counts them."""
    timeline = done.timeline
    admitted = first_time(timeline, "admitted") or 0.0
    stats: dict[str, Any] = {
        "latent_frames": done.latent_frames,
        "decoded_before_first_send": decoded_before_first_consumed(timeline),
    }
    first_sent = first_time(timeline, "consumed")
    if first_sent is not None:
        stats["first_frame_sent_ms"] = round((first_sent - admitted) * 1000.0, 1)
    ended = first_time(timeline, "done")
    if ended is not None:
        stats["total_ms"] = round((ended - admitted) * 1000.0, 1)
    body: dict[str, Any] = {"type": "video.done", "status": done.status, "frames": frames}
    if total_bytes is not None:
        body["bytes"] = total_bytes
    body["stats"] = stats
    if done.code is not None:
        body["code"] = done.code
    if done.error is not None:
        body["error"] = done.error
    return body


def failed_event(exc: Exception, frames: int, total_bytes: int | None) -> dict[str, Any]:
    """``video.done`` for a generation whose frames could not be delivered (the server's fault, not the engine's)."""
    body: dict[str, Any] = {"type": "video.done", "status": "error", "frames": frames}
    if total_bytes is not None:
        body["bytes"] = total_bytes
    body["code"] = "stream_error"
    body["error"] = f"{type(exc).__name__}: {exc}"
    return body
