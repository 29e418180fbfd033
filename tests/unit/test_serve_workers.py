"""How many gateway processes ``omnigate serve`` starts, and where the engine runs, for its options."""

from __future__ import annotations

import pytest

from omnigate.gateway.cli import serve
from omnigate.gateway.settings import Settings


@pytest.mark.parametrize(("cpus", "expected"), [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (128, 4)])
def test_automatic_workers_follow_the_cores_with_an_engine_core(
    monkeypatch: pytest.MonkeyPatch, cpus: int, expected: int
) -> None:
    monkeypatch.setattr(serve, "available_cpus", lambda: cpus)
    settings = Settings(engine="talker")
    assert serve.engine_process(settings) == "core"
    assert serve.gateway_workers(settings, "core") == expected


def test_an_inline_engine_has_one_gateway_and_a_given_count_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "available_cpus", lambda: 64)
    assert serve.engine_process(Settings(engine="piper")) == "inline"
    assert serve.gateway_workers(Settings(engine="piper"), "inline") == 1
    assert serve.gateway_workers(Settings(engine="talker", workers=3), "core") == 3


def test_a_negative_worker_count_is_refused() -> None:
    with pytest.raises(ValueError, match="--workers"):
        serve.engine_process(Settings(workers=-1))


@pytest.mark.parametrize(("cpus", "expected"), [(2, 1), (8, 2), (16, 4), (128, 4)])
def test_a_duplex_engine_runs_in_a_core_on_cuda_with_workers_by_the_cores(
    monkeypatch: pytest.MonkeyPatch, cpus: int, expected: int
) -> None:
    monkeypatch.setattr(serve, "available_cpus", lambda: cpus)
    on_gpu = Settings(engine="duplex", engine_options={"device": "cuda"})
    assert serve.engine_process(on_gpu) == "core"
    assert serve.gateway_workers(on_gpu, "core") == expected  # automatic workers: like the talker's


def test_a_duplex_engine_picks_its_process(monkeypatch: pytest.MonkeyPatch) -> None:
    assert serve.engine_process(Settings(engine="duplex")) == "inline"  # the CPU default stays in the gateway
    assert serve.engine_process(Settings(engine="duplex", engine_process="core")) == "core"
    assert serve.engine_process(Settings(engine="duplex", engine_options={"device": "cuda:0"})) == "core"
    inline = Settings(engine="duplex", engine_process="inline", engine_options={"device": "cuda"})
    assert serve.engine_process(inline) == "inline"


def test_a_duplex_engine_serves_several_gateway_workers_from_a_core() -> None:
    given = Settings(engine="duplex", engine_process="core", workers=3)
    assert serve.engine_process(given) == "core"
    assert serve.gateway_workers(given, "core") == 3
    assert serve.engine_process(Settings(engine="duplex", workers=2)) == "core"  # auto: workers need a core
    with pytest.raises(ValueError, match="--workers above 1 needs --engine-process core"):
        serve.engine_process(Settings(engine="duplex", engine_process="inline", workers=2))


def test_ray_keeps_the_engine_inline() -> None:
    assert serve.engine_process(Settings(engine_pool="ray")) == "inline"
    with pytest.raises(ValueError, match="--engine-pool ray"):
        serve.engine_process(Settings(engine_pool="ray", engine_process="core"))


def test_engines_loaded_in_each_gateway_process_keep_one_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "available_cpus", lambda: 16)
    beside = Settings(engine="talker", omni_model="preset:tiny")
    assert serve.gateway_workers(beside, serve.engine_process(beside)) == 1  # not one thinker per worker
    with pytest.raises(ValueError, match=r"--omni-model.*--workers 1"):
        serve.gateway_workers(Settings(engine="talker", omni_model="preset:tiny", workers=4), "core")
    assert serve.gateway_workers(Settings(engine="talker"), "core") == 4


def test_the_qwen3_omni_engine_runs_inline_or_in_a_core_and_answers_without_an_llm() -> None:
    assert serve.engine_process(Settings(engine="qwen3-omni", engine_options={"device": "cuda"})) == "inline"
    for core in (Settings(engine="qwen3-omni", workers=2), Settings(engine="qwen3-omni", engine_process="core")):
        assert serve.engine_process(core) == "core"
    with pytest.raises(ValueError, match="--workers above 1 needs --engine-process core"):
        serve.engine_process(Settings(engine="qwen3-omni", engine_process="inline", workers=2))
    parser = serve.build_parser()
    argv = ["serve", "--engine", "qwen3-omni", "--model", "preset:tiny"]
    assert serve.settings_from_args(parser.parse_args(argv)).responder is None  # no embedded LLM or recognizer
    with pytest.raises(ValueError, match="no --llm-url"):
        serve.responder_settings(parser.parse_args([*argv, "--llm-url", "http://127.0.0.1:9/v1"]))
