"""Target registry and URL handling."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from omnigate.loadtest import targets
from omnigate.loadtest.cli import main
from omnigate.loadtest.report import TargetSpec
from omnigate.loadtest.targets import SessionSettings, Target, register_target, target_class, target_kinds
from omnigate.loadtest.targets.base import http_url, ws_url
from omnigate.loadtest.targets.http_speech import HttpSpeechTarget
from omnigate.loadtest.targets.ws_speech import WsSpeechTarget
from omnigate.loadtest.traces import SessionTrace


def test_builtin_targets_load_by_name() -> None:
    assert {"ws-speech", "http-speech"} <= set(target_kinds())
    assert target_class("ws-speech") is WsSpeechTarget
    assert target_class("http-speech") is HttpSpeechTarget


def test_unknown_target_names_the_choices() -> None:
    with pytest.raises(ValueError, match="ws-speech"):
        target_class("carrier-pigeon")


def test_registered_targets_are_selectable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(targets, "_registered", {})

    class EchoTarget(Target):
        kind = "test-echo"

        async def run_session(self, texts: Sequence[str], trace: SessionTrace) -> None:
            trace.connected(0.0)

    register_target(EchoTarget)
    assert target_class("test-echo") is EchoTarget
    assert "test-echo" in target_kinds()


def test_urls_follow_the_scheme_of_each_transport() -> None:
    assert ws_url("http://h:1", "/v1/audio/speech/stream") == "ws://h:1/v1/audio/speech/stream"
    assert ws_url("https://h", "/p") == "wss://h/p"
    assert ws_url("ws://h:2/custom?x=1", "/p") == "ws://h:2/custom?x=1"
    assert http_url("ws://h:3/v1/audio/speech/stream", "/metrics") == "http://h:3/metrics"
    assert http_url("wss://h", "/metrics") == "https://h/metrics"


def test_metrics_url_is_on_the_target_server() -> None:
    spec = TargetSpec(label="a", target="ws-speech", url="ws://h:4")
    assert WsSpeechTarget(spec, SessionSettings()).metrics_url() == "http://h:4/metrics"


def test_each_target_asks_for_what_its_real_clients_ask_for_by_default() -> None:
    spec = TargetSpec(label="a", target="http-speech", url="http://h:4")
    assert HttpSpeechTarget(spec, SessionSettings()).response_format == "mp3"
    assert HttpSpeechTarget(spec, SessionSettings(response_format="pcm")).response_format == "pcm"
    assert WsSpeechTarget(spec, SessionSettings()).response_format == "pcm"
    assert SessionSettings().compression


def test_the_cli_refuses_a_format_the_target_cannot_measure(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--target", "ws-speech", "--format", "mp3"])
    assert exit_info.value.code == 2
    assert "ws-speech target measures pcm" in capsys.readouterr().err
