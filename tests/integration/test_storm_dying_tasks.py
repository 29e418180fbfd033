"""A storm in which a task serving the session dies: the server's mp3 encoder raises on its first chunk (injected),
mixed with the abort and disconnect patterns. Every dying session must end typed (``internal_error``: close 1011 on
the WebSocket, an SSE ``error`` before the cut-off body) and the server must hold no session, engine stream or
lease afterwards, nor more tasks than before.
"""

from __future__ import annotations

import pytest

from omnigate.gateway.settings import Settings
from omnigate.gateway.speech.audio_out import AudioOut
from omnigate.loadtest.footprint import settled_footprint
from omnigate.loadtest.storm import DYING_ENCODER_PATTERNS, DYING_FORMAT, PATTERNS, run_storm
from tests.serving import serve

pytestmark = pytest.mark.slow


class InjectedFault(RuntimeError):
    pass


def make_the_encoder_die(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``DYING_FORMAT`` stream's encoder raises on its first chunk; other formats encode as usual."""
    encode = AudioOut.encode

    async def encode_or_die(self: AudioOut, pcm: bytes) -> bytes:
        if self.encoder.format.name == DYING_FORMAT:
            raise InjectedFault("the encoder died")
        return await encode(self, pcm)

    monkeypatch.setattr(AudioOut, "encode", encode_or_die)


async def test_a_storm_of_dying_encoders_ends_every_session_typed_and_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make_the_encoder_die(monkeypatch)
    patterns = (*PATTERNS, *DYING_ENCODER_PATTERNS, *DYING_ENCODER_PATTERNS)  # a third of the sessions die
    with serve(Settings(engine="synthetic", admission="slots")) as server:
        metrics = server.http_url + "/metrics"
        warm_up = await run_storm(server.http_url, 40, concurrency=20, patterns=patterns, seed=1)
        assert warm_up.unexpected == {}
        before = await settled_footprint(metrics)
        result = await run_storm(server.http_url, 200, concurrency=20, patterns=patterns, seed=2)
        after = await settled_footprint(metrics)
        leases = server.call(lambda: len(server.gateway.registry.leases))
    assert result.unexpected == {}
    assert all(result.by_pattern.get(p, 0) > 0 for p in DYING_ENCODER_PATTERNS)
    assert after.sessions == 0 and after.engine_streams == 0 and leases == 0
    assert after.tasks <= before.tasks
