"""One turn's transcription: ``POST {base}/audio/transcriptions`` with the audio as a WAV, the text back."""

from __future__ import annotations

import io
import wave

import httpx
import msgspec

from omnigate.engines.openai_compat.errors import ServiceError
from omnigate.engines.openai_compat.http_calls import (
    Deadline,
    ServiceTimeouts,
    bearer,
    endpoint,
    next_chunk,
    raise_for_status,
    send,
)

SAMPLE_RATES = (16_000, 24_000)


class _Transcription(msgspec.Struct):
    text: str


_DECODER = msgspec.json.Decoder(_Transcription)


def wav_bytes(pcm: bytes, sample_rate: int) -> bytes:
    """Mono 16-bit little-endian PCM as a WAV file."""
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(sample_rate)
        writer.writeframes(pcm)
    return out.getvalue()


class TranscriptionClient:
    """Transcriptions from one OpenAI-compatible server (speaches, whisper.cpp's server, vLLM, OpenAI)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        base_url: str,
        *,
        model: str = "whisper-1",
        api_key: str | None = None,
        timeouts: ServiceTimeouts | None = None,
        max_audio_s: float = 60.0,
        max_response_bytes: int = 1024 * 1024,
    ) -> None:
        self._http = http
        self.url = endpoint(base_url, "/audio/transcriptions")
        self.model = model
        self._headers = bearer(api_key)
        self.timeouts = timeouts or ServiceTimeouts(first_byte_s=10.0, total_s=15.0)
        self.max_audio_s = max_audio_s
        self.max_response_bytes = max_response_bytes

    async def transcribe(self, pcm: bytes, sample_rate: int = 24_000, *, language: str | None = None) -> str:
        """The text of ``pcm`` (mono s16le at 16 or 24 kHz; of a turn longer than ``max_audio_s`` its newest
        ``max_audio_s`` go). Raises ServiceError."""
        if sample_rate not in SAMPLE_RATES:
            raise ValueError(f"sample_rate must be one of {SAMPLE_RATES}")
        if len(pcm) % 2:
            raise ValueError("pcm16 audio has an even number of bytes")
        pcm = pcm[-int(self.max_audio_s * sample_rate) * 2 :]
        t = self.timeouts
        deadline = Deadline("asr", t.total_s)
        fields = {"model": self.model, "response_format": "json"}
        if language:
            fields["language"] = language
        request = self._http.build_request(
            "POST",
            self.url,
            data=fields,
            files={"file": ("audio.wav", wav_bytes(pcm, sample_rate), "audio/wav")},
            headers=self._headers,
        )
        response = await send(self._http, request, deadline, t.first_byte_s, "the transcription")
        try:
            await raise_for_status(response, deadline, t.idle_s)
            body = bytearray()
            chunks = response.aiter_bytes()
            while (chunk := await next_chunk(chunks, deadline, t.idle_s, "the next chunk")) is not None:
                body += chunk
                if len(body) > self.max_response_bytes:
                    raise ServiceError("asr", "bad_response", f"a response longer than {self.max_response_bytes} bytes")
        finally:
            await response.aclose()
        try:
            return _DECODER.decode(body).text
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ServiceError("asr", "bad_response", f'not a transcription ({{"text": ...}}): {exc}') from exc
