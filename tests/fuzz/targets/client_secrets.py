"""``POST /v1/realtime/client_secrets``: OpenAI's client-secret request body."""

from __future__ import annotations

import httpx
import msgspec
from hypothesis import strategies as st

from omnigate.gateway.settings import Settings
from tests.fuzz.harness import HttpTarget
from tests.fuzz.mutations import json_values, malformed_frames, mutate

bodies = st.fixed_dictionaries(
    {},
    optional={
        "expires_after": st.fixed_dictionaries(
            {}, optional={"anchor": st.just("created_at"), "seconds": st.integers(-5, 10_000)}
        ),
        "session": st.dictionaries(st.text(max_size=10), json_values, max_size=3),
    },
)


class ClientSecretsTarget(HttpTarget):
    name = "client-secrets"
    path = "/v1/realtime/client_secrets"

    def requests(self) -> st.SearchStrategy[tuple[dict[str, str], bytes]]:
        limit = Settings().http_max_body_bytes
        payloads = st.one_of(
            bodies.map(msgspec.json.encode),
            mutate(bodies, limit).map(msgspec.json.encode),
            json_values.map(msgspec.json.encode),
            malformed_frames(bodies, limit).map(lambda m: m.data),
        )
        return st.tuples(st.just({"content-type": "application/json"}), payloads)

    async def probe(self, client: httpx.AsyncClient) -> None:
        r = await client.post(self.path, json={"expires_after": {"anchor": "created_at", "seconds": 60}})
        assert r.status_code == 200 and r.json()["value"].startswith("ek_"), r.text[:200]


TARGET = ClientSecretsTarget()
