"""``http-speech``: the OpenAI speech API, ``POST /v1/audio/speech``, with the response body streamed.

Each session sends its utterances one after another, one request each, asking for ``mp3`` as the OpenAI SDK does by
default (``--format pcm`` asks for 24 kHz s16le mono, as OpenAI defines it). MP3 is decoded as it arrives, so each
chunk counts the audio its frames hold. The whole text goes in the request, so TTFA runs from sending the request to
the first body byte. A body that ends short (a frame or sample cut off, no audio at all, the connection dropped) fails
the utterance.
The API requires ``model`` and ``voice``: without ``--model`` the first id of ``GET /v1/models`` is sent, and without
``--voice`` OpenAI's ``alloy`` (servers map OpenAI's voice names to voices they serve).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec

from omnigate.loadtest.encoded_audio import EncodedAudioDecoder
from omnigate.loadtest.targets.base import Target, http_url
from omnigate.loadtest.traces import SessionTrace, UtteranceTrace

SPEECH_PATH = "/v1/audio/speech"
MODELS_PATH = "/v1/models"
DEFAULT_VOICE = "alloy"
OPENAI_PCM_SAMPLE_RATE = 24_000
CONTENT_TYPES = {"mp3": "audio/mpeg", "pcm": "audio/pcm"}


class ModelEntry(msgspec.Struct):
    id: str


class ModelList(msgspec.Struct):
    """The part of ``GET /v1/models`` the target reads."""

    data: list[ModelEntry]


class HttpSpeechTarget(Target):
    kind = "http-speech"
    formats = ("mp3", "pcm")
    _client: httpx.AsyncClient | None = None
    _model: str | None = None

    async def open(self) -> None:
        settings = self.settings
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.utterance_timeout_s, connect=settings.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            trust_env=False,
            headers=self.auth_headers(),
        )
        self._model = self.spec.model or await self._first_served_model(self._client)

    async def _first_served_model(self, client: httpx.AsyncClient) -> str | None:
        """The first model the server lists, or ``None`` if it lists none (the request then omits ``model``)."""
        try:
            response = await client.get(http_url(self.spec.url, MODELS_PATH))
            models = msgspec.json.decode(response.content, type=ModelList) if response.status_code == 200 else None
        except (httpx.HTTPError, msgspec.DecodeError):
            return None
        return models.data[0].id if models is not None and models.data else None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def run_session(self, texts: Sequence[str], trace: SessionTrace) -> None:
        if self._client is None:
            raise RuntimeError("HttpSpeechTarget.open() was not awaited")
        for text in texts:
            utterance = trace.begin_utterance(time.perf_counter(), text)
            utterance.sample_rate = OPENAI_PCM_SAMPLE_RATE
            failure = await self._speak(self._client, utterance, trace)
            if failure is not None:
                code, detail = failure
                trace.error(code, detail)
                utterance.finish(time.perf_counter(), "failed")
                return
            utterance.finish(time.perf_counter(), "completed")

    async def _speak(
        self, client: httpx.AsyncClient, utterance: UtteranceTrace, trace: SessionTrace
    ) -> tuple[str, str] | None:
        """One request; returns (error code, detail) when it fails."""
        body: dict[str, Any] = {"input": utterance.text, "response_format": self.response_format}
        if self._model is not None:
            body["model"] = self._model
        body["voice"] = self.spec.voice or DEFAULT_VOICE
        utterance.text_sent(time.perf_counter(), len(utterance.text))
        try:
            async with client.stream("POST", http_url(self.spec.url, SPEECH_PATH), json=body) as response:
                if trace.connected_s is None:
                    trace.connected(time.perf_counter())
                if response.status_code != 200:
                    return f"http_{response.status_code}", (await response.aread()).decode(errors="replace")
                content_type = response.headers.get("content-type", "none")
                trace.record_negotiated("content_type", content_type)
                trace.record_negotiated("format", self.response_format)
                if content_type.split(";")[0].strip() != CONTENT_TYPES[self.response_format]:
                    return "unexpected_content_type", f"asked for {self.response_format}, got {content_type}"
                if self.response_format == "pcm":
                    utterance.sample_rate = int(response.headers.get("x-sample-rate", OPENAI_PCM_SAMPLE_RATE))
                    async for chunk in response.aiter_bytes():
                        utterance.audio(time.perf_counter(), len(chunk))
                    return body_end_failure(utterance, utterance.bytes % 2, 0)
                decoder = EncodedAudioDecoder(self.response_format)
                async for chunk in response.aiter_bytes():
                    audio_ms = decoder.feed(chunk)
                    utterance.audio(time.perf_counter(), len(chunk), audio_ms)
                return body_end_failure(utterance, decoder.pending_bytes, decoder.errors)
        except httpx.ConnectError as exc:
            return "connect_failed", str(exc)
        except httpx.TimeoutException as exc:
            return "timeout", str(exc)
        except httpx.RemoteProtocolError as exc:
            return "http_incomplete", str(exc)
        except httpx.HTTPError as exc:
            return "http_error", str(exc)


def body_end_failure(utterance: UtteranceTrace, pending_bytes: int, decode_errors: int) -> tuple[str, str] | None:
    """Why a body that ended cleanly is still not a whole utterance, or None when it is."""
    if pending_bytes:
        return "http_truncated_body", f"the body ended {pending_bytes} bytes into an audio frame"
    if decode_errors:
        return "audio_decode_error", f"{decode_errors} frames did not decode"
    if utterance.audio_ms <= 0:
        return "http_empty_body", "the response held no audio"
    return None
