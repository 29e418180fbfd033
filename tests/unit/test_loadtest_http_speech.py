"""``http-speech`` against a fake HTTP transport: mp3 by default, decoded for its duration; short bodies fail."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx
import numpy as np
import pytest

from omnigate.codecs.encoder import encode_all
from omnigate.loadtest.encoded_audio import EncodedAudioDecoder
from omnigate.loadtest.report import TargetSpec
from omnigate.loadtest.targets.base import SessionSettings
from omnigate.loadtest.targets.http_speech import HttpSpeechTarget
from omnigate.loadtest.traces import SessionTrace

RATE = 24_000
SPEC = TargetSpec(label="http-speech", target="http-speech", url="http://speech.test", model="m")


def tone(seconds: float) -> bytes:
    samples = np.sin(np.arange(int(RATE * seconds)) * 2 * np.pi * 440 / RATE) * 8000
    return samples.astype("<i2").tobytes()


MP3 = encode_all("mp3", tone(2.0), RATE)
FRAME_MS = 576 * 1000 / RATE  # an MPEG-2 layer III frame


def pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


class Body(httpx.AsyncByteStream):
    """A streamed response body; ``fail`` raises after the pieces, as a dropped connection does."""

    def __init__(self, chunks: list[bytes], fail: Exception | None = None) -> None:
        self._chunks = chunks
        self._fail = fail

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk
        if self._fail is not None:
            raise self._fail


Handler = Callable[[httpx.Request], httpx.Response]


async def speak(handler: Handler, response_format: str | None = None) -> tuple[SessionTrace, list[httpx.Request]]:
    target = HttpSpeechTarget(SPEC, SessionSettings(response_format=response_format))
    requests: list[httpx.Request] = []

    def recording(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return handler(request)

    target._client = httpx.AsyncClient(transport=httpx.MockTransport(recording))
    target._model = "m"
    trace = SessionTrace(0, 0.0)
    try:
        await target.run_session(["Hello there."], trace)
    finally:
        await target.close()
    trace.end(1.0)
    return trace, requests


def mp3_response(chunks: list[bytes], fail: Exception | None = None) -> Handler:
    return lambda request: httpx.Response(200, headers={"content-type": "audio/mpeg"}, stream=Body(chunks, fail))


def test_the_decoder_counts_the_audio_of_each_complete_frame() -> None:
    decoder = EncodedAudioDecoder("mp3")
    total_ms = sum(decoder.feed(piece) for piece in pieces(MP3, 700))
    assert decoder.pending_bytes == 0
    assert decoder.sample_rate == RATE
    # The encoder's priming and padding add at most three frames (24 ms each at 24 kHz), as a player hears them.
    assert 2000.0 <= total_ms <= 2000.0 + 3 * FRAME_MS
    assert EncodedAudioDecoder("mp3").feed(MP3[:-50]) < total_ms


def test_the_decoder_refuses_formats_it_cannot_measure() -> None:
    with pytest.raises(ValueError, match="mp3"):
        EncodedAudioDecoder("flac")


async def test_mp3_is_asked_for_by_default_and_measured_by_its_duration() -> None:
    trace, requests = await speak(mp3_response(pieces(MP3, 1000)))
    assert requests[0].read().count(b'"response_format":"mp3"') == 1
    (utterance,) = trace.utterances
    assert utterance.status == "completed", trace.errors
    assert 2000.0 <= utterance.audio_ms <= 2000.0 + 3 * FRAME_MS
    assert utterance.bytes == len(MP3)
    assert trace.negotiated == {"content_type": "audio/mpeg", "format": "mp3"}
    assert utterance.play(100.0).underruns == 0


async def test_an_mp3_body_that_ends_inside_a_frame_fails() -> None:
    trace, _ = await speak(mp3_response(pieces(MP3[:-50], 1000)))
    assert trace.utterances[0].status == "failed"
    assert set(trace.errors) == {"http_truncated_body"}


async def test_a_dropped_connection_mid_body_fails() -> None:
    trace, _ = await speak(mp3_response(pieces(MP3, 1000)[:3], fail=httpx.RemoteProtocolError("peer closed")))
    assert trace.utterances[0].status == "failed"
    assert set(trace.errors) == {"http_incomplete"}


async def test_a_body_without_audio_fails() -> None:
    trace, _ = await speak(mp3_response([]))
    assert set(trace.errors) == {"http_empty_body"}


async def test_a_format_other_than_asked_fails() -> None:
    handler = lambda request: httpx.Response(200, headers={"content-type": "audio/wav"}, content=b"RIFF")  # noqa: E731
    trace, _ = await speak(handler)
    assert set(trace.errors) == {"unexpected_content_type"}


async def test_pcm_on_request_at_the_rate_the_server_names() -> None:
    pcm = tone(0.5)

    def handler(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "audio/pcm", "x-sample-rate": "24000"}
        return httpx.Response(200, headers=headers, stream=Body(pieces(pcm, 960)))

    trace, requests = await speak(handler, response_format="pcm")
    assert b'"response_format":"pcm"' in requests[0].read()
    assert trace.utterances[0].status == "completed"
    assert trace.utterances[0].audio_ms == pytest.approx(500.0)
    odd, _ = await speak(
        lambda request: httpx.Response(200, headers={"content-type": "audio/pcm"}, stream=Body([pcm[:-1]])),
        response_format="pcm",
    )
    assert set(odd.errors) == {"http_truncated_body"}


def test_formats_the_target_cannot_measure_are_refused() -> None:
    with pytest.raises(ValueError, match="mp3, pcm"):
        HttpSpeechTarget(SPEC, SessionSettings(response_format="flac"))
