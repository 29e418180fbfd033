from __future__ import annotations

from collections.abc import Iterator

import pytest

from omnigate.engines.piper import PiperEngine
from omnigate.engines.synthetic import SyntheticEngine
from omnigate.gateway.settings import Settings
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def piper_engine() -> PiperEngine:
    return PiperEngine.load(None, workers=2)


@pytest.fixture(scope="module")
def piper_server(piper_engine: PiperEngine) -> Iterator[RunningServer]:
    with serve(Settings(engine="piper"), engine=piper_engine) as server:
        yield server


@pytest.fixture(scope="module")
def default_server() -> Iterator[RunningServer]:
    """The server as ``omnigate serve`` runs it with no options: the hibari voice, loaded by its settings."""
    with serve(Settings()) as server:
        yield server


@pytest.fixture(scope="module")
def synthetic_server() -> Iterator[RunningServer]:
    with serve(Settings(engine="synthetic", ws_max_message_bytes=1024 * 1024)) as server:
        yield server


def make_synthetic_server(**settings: object) -> object:
    return serve(Settings(engine="synthetic", **settings))  # type: ignore[arg-type]


__all__ = ["SyntheticEngine", "make_synthetic_server"]
