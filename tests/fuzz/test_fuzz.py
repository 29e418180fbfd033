"""Property-based fuzzing of every wire protocol against the real server (short; ``benchmarks/fuzz_long.py`` is the
long run). See ``tests/fuzz/harness.py`` for the properties."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests import image_bombs
from tests.fuzz import pictures
from tests.fuzz.harness import (
    FuzzMessage,
    HttpRequest,
    HttpTarget,
    ServerErrors,
    Tally,
    WsTarget,
    run_http_case,
    run_ws_case,
)
from tests.fuzz.server import fuzz_server, fuzz_settings, routes, settle
from tests.fuzz.targets import all_targets
from tests.serving import RunningServer

pytestmark = pytest.mark.integration

TARGETS = all_targets()
WS_TARGETS = [t for t in TARGETS if isinstance(t, WsTarget)]
HTTP_TARGETS = [t for t in TARGETS if isinstance(t, HttpTarget)]
KNOWN_ISSUES = [(target, issue) for target in TARGETS for issue in target.known_issues() if issue.example is not None]
CI = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[RunningServer, ServerErrors]]:
    with fuzz_server() as running:
        yield running


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as loop_runner:
        yield loop_runner


def served(target: WsTarget | HttpTarget, running: RunningServer) -> None:
    if not target.available(routes(running)):
        pytest.skip(f"{target.path} is not served")


def report(capsys: pytest.CaptureFixture[str], name: str, tally: Tally) -> None:
    with capsys.disabled():
        print(
            f"\nfuzz {name}: {tally.messages} messages in {tally.sessions} sessions, {tally.errors} typed errors, "
            f"{tally.closes} typed closes, {tally.requests} requests {dict(sorted(tally.by_status.items()))}, "
            "0 crashes"
        )


async def http_case(running: RunningServer, target: HttpTarget, requests: list[HttpRequest]) -> Tally:
    async with httpx.AsyncClient(base_url=running.http_url, timeout=30.0) as client:
        return await run_http_case(client, target, requests)


@pytest.mark.parametrize("target", WS_TARGETS, ids=lambda t: t.name)
def test_websocket_protocol_survives_fuzzing(
    target: WsTarget,
    server: tuple[RunningServer, ServerErrors],
    runner: asyncio.Runner,
    capsys: pytest.CaptureFixture[str],
) -> None:
    running, errors = server
    served(target, running)
    tally = Tally()

    @CI
    @given(st.lists(target.generated(), min_size=1, max_size=20))
    def fuzz(messages: list[FuzzMessage]) -> None:
        tally.add(runner.run(run_ws_case(running.ws_url, target, messages, fuzz_settings())))

    for regression in target.regressions():
        fuzz = example(regression)(fuzz)
    fuzz()
    runner.run(settle(running))
    assert not errors.records, errors.describe()
    assert tally.errors > 0 and tally.messages >= tally.errors
    report(capsys, target.name, tally)


@pytest.mark.parametrize("target", HTTP_TARGETS, ids=lambda t: t.name)
def test_http_body_survives_fuzzing(
    target: HttpTarget,
    server: tuple[RunningServer, ServerErrors],
    runner: asyncio.Runner,
    capsys: pytest.CaptureFixture[str],
) -> None:
    running, errors = server
    served(target, running)
    tally = Tally()

    @settings(CI, max_examples=20)
    @given(st.lists(target.generated(), min_size=1, max_size=6))
    def fuzz(requests: list[HttpRequest]) -> None:
        tally.add(runner.run(http_case(running, target, requests)))

    for regression in target.regressions():
        fuzz = example(regression)(fuzz)
    fuzz()
    runner.run(settle(running))
    assert not errors.records, errors.describe()
    assert sum(n for status, n in tally.by_status.items() if status >= 400) > 0
    report(capsys, target.name, tally)


def test_video_chat_pictures_survive_the_bomb_corpus_and_mutations(
    server: tuple[RunningServer, ServerErrors], runner: asyncio.Runner, capsys: pytest.CaptureFixture[str]
) -> None:
    running, errors = server
    if pictures.PATH not in routes(running):
        pytest.skip(f"{pictures.PATH} is not served")
    tally = Tally()

    @settings(CI, max_examples=20)
    @given(st.lists(pictures.pictures(), min_size=1, max_size=6))
    @example(pictures.corpus_pictures())
    def fuzz(batch: list[pictures.Picture]) -> None:
        tally.add(runner.run(pictures.run_picture_case(running.ws_url, batch)))

    fuzz()
    runner.run(settle(running))
    assert not errors.records, errors.describe()
    assert tally.errors >= len(image_bombs.REFUSALS)
    report(capsys, "video-chat pictures", tally)


def test_every_known_issue_still_reproduces(request: pytest.FixtureRequest, runner: asyncio.Runner) -> None:
    """Each known issue with a deterministic example still breaks its property; the moment one is fixed this fails,
    as a reminder to delete the issue from its target. With no known issue (as today) there is nothing to run and it
    passes."""
    if not KNOWN_ISSUES:
        return
    running, _ = request.getfixturevalue("server")
    for target, issue in KNOWN_ISSUES:
        assert target.available(routes(running)), f"{target.path} is not served"
        if isinstance(target, WsTarget):
            case = run_ws_case(running.ws_url, target, issue.example, fuzz_settings())  # type: ignore[arg-type]
        else:
            case = http_case(running, target, issue.example)  # type: ignore[arg-type]
        with pytest.raises(AssertionError):  # the harness's properties are assertions
            runner.run(case)
