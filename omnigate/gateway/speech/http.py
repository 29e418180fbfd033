"""``POST /v1/audio/speech``: OpenAI's TTS API, streamed with chunked transfer (or SSE with ``stream_format=sse``).

A response whose speech is cut off after the audio began (the engine failed, the session was closed, the audio
reached ``max_utterance_audio_s``) is aborted, never finished as if complete (see
:mod:`omnigate.gateway.speech.http_stream`); over SSE an ``error`` event comes first. An input that may need more
audio than that limit, read at :data:`~omnigate.gateway.settings.SLOWEST_CHARS_PER_S` and the request's speed, is
refused before any audio.
"""

from __future__ import annotations

import base64
import logging
import math
from collections.abc import AsyncGenerator
from typing import Literal

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from omnigate.codecs.formats import UnsupportedFormat, get_format
from omnigate.engines.base import speakable
from omnigate.gateway.errors import UNDECODABLE, HttpError, describe_validation_error
from omnigate.gateway.ops.metrics import Metrics
from omnigate.gateway.settings import SLOWEST_CHARS_PER_S
from omnigate.gateway.speech.adapter import INTERNAL_ERROR
from omnigate.gateway.speech.audio_out import AudioOut
from omnigate.gateway.speech.http_stream import AbortableStreamingResponse, BodyAborted
from omnigate.gateway.speech.voices import resolve_voice
from omnigate.gateway.state import Gateway
from omnigate.sessions.driver import SessionDriver
from omnigate.sessions.messages import (
    AppendText,
    Configure,
    ErrorEvent,
    Flush,
    MediaChunk,
    SessionClosed,
    SessionConfig,
    UtteranceDone,
)
from omnigate.sessions.registry import SessionLimitReached
from omnigate.sessions.segmenter import SegmenterConfig
from omnigate.sessions.speech import ConfigError, synthesis_params

log = logging.getLogger(__name__)

TRANSPORT = "http-speech"
# Refusals of the engine tier, not of the request: 503 with Retry-After (anything else is the request's fault, 400).
RETRYABLE_REFUSALS = frozenset({"engine_busy", "engine_unavailable", "shutting_down"})
# OpenAI's TTS output is 24 kHz for every format (Opus is carried at 48 kHz).
OPENAI_SAMPLE_RATE = 24_000


class SpeechRequest(msgspec.Struct, kw_only=True):
    """The OpenAI ``audio.speech.create`` body. Unknown fields are ignored, as OpenAI-compatible clients expect."""

    model: str
    input: str
    voice: str
    response_format: str = "mp3"
    speed: float = 1.0
    instructions: str | None = None
    stream_format: Literal["audio", "sse"] = "audio"


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, f"request body over {limit} bytes", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"request body over {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(body: bytes, gateway: Gateway) -> tuple[SpeechRequest, SessionConfig]:
    try:
        req = msgspec.json.decode(body, type=SpeechRequest)
    except msgspec.ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise HttpError(400, message, code="invalid_request", param=param) from None
    except UNDECODABLE:
        raise HttpError(400, "request body is not valid JSON", code="invalid_json") from None
    assert gateway.pool is not None
    info = gateway.pool.info
    if req.model not in gateway.served_models():
        raise HttpError(404, f"model {req.model!r} is not served", code="model_not_found", param="model")
    if not req.input.strip():
        raise HttpError(400, "input must not be empty", code="invalid_value", param="input")
    if not speakable(req.input):
        raise HttpError(400, "input has nothing to speak (no letter or digit)", code="nothing_to_speak", param="input")
    if len(req.input) > gateway.settings.max_input_chars:
        raise HttpError(
            400,
            f"input is longer than {gateway.settings.max_input_chars} characters",
            code="string_above_max_length",
            param="input",
        )
    try:
        get_format(req.response_format)
    except UnsupportedFormat as exc:
        raise HttpError(400, str(exc), code="unsupported_format", param="response_format") from None
    config = SessionConfig(
        voice=resolve_voice(info, req.voice),
        speed=req.speed,
        instructions=req.instructions,
        max_audio_ms=int(gateway.settings.max_utterance_audio_s * 1000),
        segmenter=SegmenterConfig(max_chars=gateway.settings.segment_max_chars),
    )
    try:
        synthesis_params(info, config)
    except ConfigError as exc:
        raise HttpError(400, exc.message, code=exc.code, param=exc.param) from None
    _check_audio_limit(len(req.input), req.speed, gateway.settings.max_utterance_audio_s)
    return req, config


def _check_audio_limit(chars: int, speed: float, limit_s: float) -> None:
    """Refuse, before any audio, an input that may need more audio than the limit (at the slowest speech the
    limit is sized for): the audio of an accepted request is not cut short by the limit."""
    fits = math.floor(limit_s * SLOWEST_CHARS_PER_S * speed + 1e-6)  # 4096.0 may come out as 4095.99...
    if chars > fits:
        raise HttpError(
            400,
            f"input is longer than {fits} characters, the most this server speaks at speed {speed:g} within its "
            f"limit of {limit_s:g} s of audio per request",
            code="string_above_max_length",
            param="input",
        )


async def speech_endpoint(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    metrics: Metrics = request.app.state.metrics
    try:
        if gateway.pool is None:
            raise HttpError(503, "the engine is not loaded yet", code="not_ready", retry_after_s=1.0)
        # As OpenAI's API. It also keeps other sites' pages out: a page may send a cross-site form or text/plain
        # POST without asking, but a JSON one only after a CORS preflight this server does not grant.
        if request.headers.get("content-type", "").partition(";")[0].strip().lower() != "application/json":
            raise HttpError(415, "send the request body as application/json", code="unsupported_media_type")
        try:
            body = await _read_body(request, gateway.settings.http_max_body_bytes)
        except ClientDisconnect:
            return Response(status_code=499)
        req, config = _parse(body, gateway)
        try:
            lease = gateway.registry.acquire(TRANSPORT)
        except SessionLimitReached as exc:
            raise HttpError(503, str(exc), code="server_busy", retry_after_s=exc.retry_after_s) from None
    except HttpError as exc:
        return exc.response()

    driver = SessionDriver(
        gateway.pool,
        gateway.limits(gateway.settings.http_outbox_ms),
        on_first_audio=lambda ms: metrics.ttfa.labels(TRANSPORT).observe(ms / 1000.0),
    )
    lease.driver = driver
    driver.submit(Configure(config))
    driver.submit(AppendText(req.input))
    driver.submit(Flush())
    try:
        out = await AudioOut.open(req.response_format, gateway.pool.info.sample_rate, OPENAI_SAMPLE_RATE)
    except Exception:
        log.exception("could not open the audio encoder")
        driver.release()
        lease.release()
        return HttpError(500, "the server could not start the audio stream; retry", code=INTERNAL_ERROR).response()

    def cleanup() -> None:
        out.close()
        driver.release()
        lease.release()

    # The first event decides the status: a refusal before any audio is still an HTTP error.
    first = await driver.next_event()
    if isinstance(first, ErrorEvent):
        cleanup()
        status = 503 if first.code in RETRYABLE_REFUSALS else 400
        retry_after_s = gateway.settings.retry_after_s if status == 503 else None
        return HttpError(status, first.message, code=first.code, retry_after_s=retry_after_s).response()

    async def audio_bytes() -> AsyncGenerator[bytes, None]:
        event: object = first
        error: ErrorEvent | None = None
        try:
            while True:
                if isinstance(event, MediaChunk):
                    data = await out.encode(event.pcm)
                    if data:
                        yield data
                elif isinstance(event, ErrorEvent):
                    error = event
                elif isinstance(event, UtteranceDone):
                    if event.status in ("error", "cancelled"):
                        raise SpeechCutOff(error or ErrorEvent("generation_failed", event.error or event.status))
                    if event.status == "max_duration":
                        limit_s = gateway.settings.max_utterance_audio_s
                        message = f"the audio reached this server's limit of {limit_s:g} s before the input was spoken"
                        raise SpeechCutOff(ErrorEvent("max_duration", message))
                    tail = await out.finish()
                    if tail:
                        yield tail
                    return
                elif isinstance(event, SessionClosed):
                    raise SpeechCutOff(error or ErrorEvent(event.code or event.reason, "the session was closed"))
                event = await driver.next_event()
        except SpeechCutOff:
            raise
        except Exception as exc:  # the encoder (or anything else serving the body) failed: cut off, typed
            log.exception("a speech response failed")
            message = "the server failed while speaking; retry"
            raise SpeechCutOff(ErrorEvent(INTERNAL_ERROR, message)) from exc
        finally:
            cleanup()

    rate = {"x-sample-rate": str(out.output_rate)}
    stall_s = gateway.settings.stall_timeout_s
    if req.stream_format == "sse":
        sse = _sse(audio_bytes(), req.input, out)
        return AbortableStreamingResponse(
            sse, media_type="text/event-stream", headers=rate, stall_timeout_s=stall_s, on_end=cleanup
        )
    return AbortableStreamingResponse(
        audio_bytes(), media_type=out.content_type, headers=rate, stall_timeout_s=stall_s, on_end=cleanup
    )


class SpeechCutOff(BodyAborted):
    """The speech ended before the whole input was spoken (the engine failed, the session was closed, the audio
    reached its limit)."""

    def __init__(self, error: ErrorEvent) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


async def _sse(audio: AsyncGenerator[bytes, None], text: str, out: AudioOut) -> AsyncGenerator[bytes, None]:
    try:
        async for data in audio:
            event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
            yield b"data: " + msgspec.json.encode(event) + b"\n\n"
    except SpeechCutOff as exc:
        # An SSE client reads events, not the transfer encoding: it is told why before the stream is aborted.
        error = {"message": exc.error.message, "type": "server_error", "param": None, "code": exc.error.code}
        yield b"data: " + msgspec.json.encode({"type": "error", "error": error}) + b"\n\n"
        raise
    finally:
        await audio.aclose()
    input_tokens = len(text.split())
    output_tokens = out.bytes_out // 2
    done = {
        "type": "speech.audio.done",
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
        },
    }
    yield b"data: " + msgspec.json.encode(done) + b"\n\n"
