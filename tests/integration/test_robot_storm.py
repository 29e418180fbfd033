"""Robots that burst bombs and observations in single writes while they read, on the real server: every message is
answered once (typed refusals, actions), every session goes on, and ``/health`` answers throughout."""

from __future__ import annotations

import pytest

from omnigate.loadtest.msgpack_bombs import corpus
from omnigate.loadtest.robot_storm import run_robot_storm
from tests.integration.test_robot_policy import robot_settings, wait_for_server
from tests.serving import serve


async def test_bursting_robots_get_every_answer_and_keep_their_sessions(capsys: pytest.CaptureFixture[str]) -> None:
    with serve(robot_settings()) as server:
        result = await run_robot_storm(server.http_url, 4, bursts=3, bombs_per_burst=5, seed=7)
        wait_for_server(server, lambda pool: pool.active == 0 and server.gateway.registry.total_active == 0)
    with capsys.disabled():
        print(f"\nrobot storm: {result}")
    assert result.unexpected == {}
    assert result.messages == 4 * (3 * (5 + 6) + 1)
    assert result.actions >= 4 * (3 + 1)
    assert set(result.refusals) <= {bomb.code for bomb in corpus()} | {"observation_in_flight"}
    assert result.health_checks > 0 and result.health_failures == 0
