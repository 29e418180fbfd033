"""``POST /v1/audio/speech``: the OpenAI TTS request body."""

from __future__ import annotations

import httpx
import msgspec
from hypothesis import strategies as st

from omnigate.gateway.settings import Settings
from tests.fuzz.harness import HttpRequest, HttpTarget, KnownIssue, invalid_utf8, nesting_depth_at_least
from tests.fuzz.mutations import json_values, malformed_frames, mutate, strings

bodies = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["tts-1", "synthetic", "gpt-4o-mini-tts", "nope"]),
        "input": strings,
        "voice": st.sampled_from(["alloy", "tone", "noise", "nobody"]),
    },
    optional={
        "response_format": st.sampled_from(["mp3", "opus", "aac", "flac", "wav", "pcm", "ogg"]),
        "speed": st.floats(0.1, 5.0),
        "instructions": strings,
        "stream_format": st.sampled_from(["audio", "sse", "nope"]),
    },
)
content_types = st.sampled_from(["application/json", "text/plain", "application/octet-stream", ""])


class HttpSpeechTarget(HttpTarget):
    name = "http-speech"
    path = "/v1/audio/speech"

    def known_issues(self) -> list[KnownIssue[HttpRequest]]:
        # msgspec raises UnicodeDecodeError and RecursionError, which speech_http._parse does not catch: HTTP 500.
        json_type = {"content-type": "application/json"}
        return [
            KnownIssue(
                "invalid UTF-8 inside a JSON string: HTTP 500",
                [(json_type, b'{"model":"\xfftts-1","input":"","voice":"alloy"}')],
                lambda request: invalid_utf8(request[1]),
            ),
            KnownIssue(
                "JSON nested 1000 deep: HTTP 500",
                [(json_type, b'{"model":"tts-1","input":"a","voice":"alloy","x":' + b"[" * 5000 + b"]" * 5000 + b"}")],
                lambda request: nesting_depth_at_least(request[1], 900),
            ),
        ]

    def requests(self) -> st.SearchStrategy[tuple[dict[str, str], bytes]]:
        limit = Settings().http_max_body_bytes
        payloads = st.one_of(
            bodies.map(msgspec.json.encode),
            mutate(bodies, limit).map(msgspec.json.encode),
            json_values.map(msgspec.json.encode),
            malformed_frames(bodies, limit).map(lambda m: m.data),
        )
        return st.tuples(content_types.map(lambda t: {"content-type": t} if t else {}), payloads)

    async def probe(self, client: httpx.AsyncClient) -> None:
        r = await client.post(self.path, json={"model": "tts-1", "input": "Probe.", "voice": "alloy"})
        assert r.status_code == 200 and r.content, r.text[:200]


TARGET = HttpSpeechTarget()
