"""``POST /v1/audio/speech``: the OpenAI TTS request body."""

from __future__ import annotations

import httpx
import msgspec
from hypothesis import strategies as st

from omnigate.gateway.settings import Settings
from tests.fuzz.harness import HttpRequest, HttpTarget
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
# Half the requests carry a JSON content type (with and without parameters), so most reach the body parser; the rest
# check that other types are refused (415) whatever the body.
content_types = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "text/plain",
        "application/octet-stream",
        "",
    ]
)


class HttpSpeechTarget(HttpTarget):
    name = "http-speech"
    path = "/v1/audio/speech"

    def regressions(self) -> list[list[HttpRequest]]:
        # Once HTTP 500s: invalid UTF-8 inside a JSON string, and JSON nested deeper than msgspec recurses.
        json_type = {"content-type": "application/json"}
        deep = b'{"model":"tts-1","input":"a","voice":"alloy","x":' + b"[" * 5000 + b"]" * 5000 + b"}"
        return [[(json_type, b'{"model":"\xfftts-1","input":"","voice":"alloy"}'), (json_type, deep)]]

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
