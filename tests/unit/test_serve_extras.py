"""Which optional extras ``omnigate serve`` requires for its options, checked against the modules that are present."""

from __future__ import annotations

from importlib.machinery import ModuleSpec

import pytest

from omnigate.engines import extras
from omnigate.gateway.cli.serve import extras_problem
from omnigate.gateway.settings import Settings

INSTALL_MODELS = 'pip install -e ".[models]" in a checkout, or pip install "omnigate[models]"'


def installed_except(monkeypatch: pytest.MonkeyPatch, *absent: str) -> None:
    def find_spec(name: str) -> ModuleSpec | None:
        return None if name in absent else ModuleSpec(name, None)

    monkeypatch.setattr(extras, "find_spec", find_spec)


def test_the_default_server_needs_no_extra_and_piper_needs_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    installed_except(monkeypatch, "piper", "torch", "transformers", "diffusers", "safetensors", "PIL", "ray")
    assert Settings().engine == "hibari"
    assert extras_problem(Settings()) is None
    assert extras_problem(Settings(engine="synthetic")) is None
    assert extras_problem(Settings(engine="piper")) == (
        '--engine piper needs the piper extra, which is not installed (no piper): pip install -e ".[piper]" in a '
        'checkout, or pip install "omnigate[piper]"'
    )


def test_each_model_engine_names_the_models_extra_and_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    installed_except(monkeypatch, "torch", "safetensors")
    assert extras_problem(Settings(robot_model="preset:tiny")) == (
        f"--robot-model needs the models extra, which is not installed (no torch, safetensors): {INSTALL_MODELS}"
    )
    both = Settings(engine="talker", video_model="preset:tiny", omni_model="preset:tiny")
    assert extras_problem(both) == (
        f"--engine talker, --video-model, --omni-model need the models extra, which is not installed (no torch): "
        f"{INSTALL_MODELS}"
    )


def test_an_engine_loaded_elsewhere_is_not_required_here(monkeypatch: pytest.MonkeyPatch) -> None:
    installed_except(monkeypatch, "torch", "transformers")
    # A gateway worker attached to an engine core, and a gateway of Ray replicas, load no speech engine themselves.
    assert extras_problem(Settings(engine="talker", core_socket="/tmp/core.sock")) is None
    assert extras_problem(Settings(engine="duplex", engine_pool="ray")) is None
    # ... but a worker loads the engines beside it.
    assert "--duplex-model needs the models extra" in (
        extras_problem(Settings(engine="piper", core_socket="/tmp/core.sock", duplex_model="preset:tiny")) or ""
    )
    installed_except(monkeypatch, "ray")
    assert extras_problem(Settings(engine_pool="ray")) == (
        '--engine-pool ray needs the ray extra, which is not installed (no ray): pip install -e ".[ray]" in a '
        'checkout, or pip install "omnigate[ray]"'
    )
