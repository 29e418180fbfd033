"""``serve --llm-url/--asr-url`` and their options become the responder's settings, which the page learns of."""

from __future__ import annotations

import argparse

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from omnigate.gateway.cli.serve import build_parser, settings_from_args
from omnigate.gateway.realtime.responder_clients import ResponderClients
from omnigate.gateway.settings import EMBEDDED_LLM_HISTORY_CHARS, ResponderSettings, Settings, responder_summary
from omnigate.web import web_routes


def parse(*options: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *options])


def test_without_an_llm_and_without_the_embedded_agent_there_is_no_responder() -> None:
    settings = settings_from_args(parse("--no-embedded-agent"))
    assert settings.responder is None and responder_summary(settings) is None


def test_without_an_llm_url_the_embedded_llm_answers_and_a_url_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gguf")
    monkeypatch.delenv("OMNIGATE_EMBEDDED_AGENT")  # the test servers' default: off
    embedded = settings_from_args(parse()).responder
    assert embedded is not None and (embedded.llm_url, embedded.embedded_llm) == (None, True)
    assert embedded.history_max_chars == EMBEDDED_LLM_HISTORY_CHARS  # what the embedded LLM's context holds
    remote = settings_from_args(parse("--llm-url", "http://127.0.0.1:8080/v1")).responder
    assert remote is not None and (remote.llm_url, remote.embedded_llm) == ("http://127.0.0.1:8080/v1", False)
    with pytest.raises(ValueError, match="needs an LLM"):
        ResponderSettings()
    seeded = settings_from_args(parse("--llm-seed", "7")).responder
    assert seeded is not None and seeded.llm_seed == 7 and embedded.llm_seed is None
    with pytest.raises(ValueError, match="llm-seed"):
        settings_from_args(parse("--llm-seed", "-1"))


def test_the_options_fill_the_responder_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIGATE_ASR_API_KEY", "sk-from-env")
    settings = settings_from_args(
        parse(
            "--llm-url", "http://127.0.0.1:8080/v1", "--llm-model", "qwen", "--llm-api-key", "sk-llm",
            "--llm-first-token-timeout", "4", "--asr-url", "http://127.0.0.1:8001/v1", "--asr-model", "small",
            "--history-max-chars", "9000",
        )
    )  # fmt: skip
    responder = settings.responder
    assert responder is not None
    assert (responder.llm_url, responder.llm_model, responder.llm_api_key) == (
        "http://127.0.0.1:8080/v1",
        "qwen",
        "sk-llm",
    )
    assert responder.llm_first_token_timeout_s == 4.0 and responder.history_max_chars == 9000
    assert (responder.asr_url, responder.asr_model, responder.asr_api_key) == (
        "http://127.0.0.1:8001/v1",
        "small",
        "sk-from-env",
    )
    assert responder_summary(settings) == {"transcription": True}


@pytest.mark.parametrize(
    "options",
    [
        ("--asr-url", "http://127.0.0.1:8001/v1", "--no-embedded-agent"),  # transcripts with nobody to answer them
        ("--llm-url", "127.0.0.1:8080"),  # not a URL
        ("--llm-url", "http://127.0.0.1:8080/v1", "--llm-timeout", "0"),
        ("--llm-url", "http://127.0.0.1:8080/v1", "--llm-seed", "3"),  # the seed is the embedded LLM's
        ("--no-embedded-agent", "--llm-seed", "3"),
    ],
)
def test_options_that_cannot_work_are_refused(options: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        settings_from_args(parse(*options))


async def test_the_clients_come_from_the_settings_and_close() -> None:
    clients = ResponderClients.start(ResponderSettings(llm_url="http://127.0.0.1:9/v1", llm_timeout_s=7.0))
    assert clients.chat.url == "http://127.0.0.1:9/v1/chat/completions" and clients.chat.timeouts.total_s == 7.0
    assert clients.transcription is None and clients.recognizer is not None  # the embedded one hears turns
    await clients.aclose()
    off = ResponderClients.start(ResponderSettings(llm_url="http://127.0.0.1:9/v1", embedded_asr=False))
    assert off.transcription is None and off.recognizer is None
    await off.aclose()
    remote = ResponderClients.start(ResponderSettings(llm_url="http://127.0.0.1:9/v1", asr_url="http://127.0.0.1:9/v1"))
    assert remote.transcription is not None and remote.recognizer is None  # --asr-url wins
    await remote.aclose()
    assert clients.http.is_closed


def test_the_page_config_says_whether_the_realtime_route_answers() -> None:
    with_llm = Settings(responder=ResponderSettings(llm_url="http://127.0.0.1:9/v1"))
    unheard = Settings(responder=ResponderSettings(llm_url="http://127.0.0.1:9/v1", embedded_asr=False))
    cases = ((Settings(), None), (with_llm, {"transcription": True}), (unheard, {"transcription": False}))
    for settings, expected in cases:
        app = Starlette(routes=web_routes(None, responder_summary(settings)))
        with TestClient(app) as client:
            assert client.get("/web/config.json").json() == {"token_url": None, "responder": expected}
