"""The load-test API key: how it reaches every request, and that it never shows itself."""

from __future__ import annotations

import argparse

import httpx
import msgspec
import pytest

from omnigate.loadtest.api_key import (
    API_KEY_ENV,
    ApiKey,
    auth_headers,
    auth_refusal_notice,
    parse_api_key,
    resolve_api_key,
)
from omnigate.loadtest.cli import run_parser
from omnigate.loadtest.report import TargetSpec
from omnigate.loadtest.soak import soak_parser
from omnigate.loadtest.targets import SessionSettings, target_class

SECRET = "sk-test-0123456789"


def test_the_key_is_presented_as_a_bearer_header() -> None:
    assert ApiKey(SECRET).headers() == {"Authorization": f"Bearer {SECRET}"}
    assert auth_headers(ApiKey(SECRET)) == {"Authorization": f"Bearer {SECRET}"}
    assert auth_headers(None) == {}


def test_the_key_never_shows_itself() -> None:
    key = ApiKey(SECRET)
    settings = SessionSettings(api_key=key)
    for shown in (repr(key), str(key), f"{key}", repr(settings), repr(msgspec.structs.replace(settings))):
        assert SECRET not in shown
        assert "***" in shown


@pytest.mark.parametrize("bad", ["", "has space", "trailing-newline\n", "tab\tinside", "caf\u00e9"])
def test_unusable_keys_are_refused_without_repeating_them(bad: str) -> None:
    with pytest.raises(ValueError, match="printable ASCII") as refused:
        ApiKey(bad)
    if bad:
        assert bad not in str(refused.value)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_api_key(bad)


def test_a_bad_key_on_the_command_line_is_not_echoed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run_parser().parse_args(["--api-key", "sk-with a-space"])
    assert "sk-with a-space" not in capsys.readouterr().err


@pytest.mark.parametrize("parser", [run_parser(), soak_parser()], ids=["run", "soak"])
def test_run_and_soak_take_the_key(parser: argparse.ArgumentParser) -> None:
    args = parser.parse_args(["http://h:1", "--api-key", SECRET])
    assert isinstance(args.api_key, ApiKey)
    assert args.api_key.headers()["Authorization"] == f"Bearer {SECRET}"
    assert SECRET not in repr(args)
    assert parser.parse_args(["http://h:1"]).api_key is None


def test_the_option_wins_over_the_environment_which_is_the_default() -> None:
    option = ApiKey("from-option")
    assert resolve_api_key(option, {API_KEY_ENV: "from-env"}) is option
    from_env = resolve_api_key(None, {API_KEY_ENV: "from-env"})
    assert from_env is not None and from_env.headers()["Authorization"] == "Bearer from-env"
    assert resolve_api_key(None, {}) is None
    assert resolve_api_key(None, {API_KEY_ENV: ""}) is None


def test_an_unusable_key_in_the_environment_is_named_not_shown() -> None:
    with pytest.raises(ValueError, match=API_KEY_ENV) as refused:
        resolve_api_key(None, {API_KEY_ENV: "sk-bad key"})
    assert "sk-bad key" not in str(refused.value)


def test_redaction_masks_the_key_as_json_spells_it() -> None:
    key = ApiKey('sk-"quoted"\\slash')
    document = msgspec.json.encode({"error": 'invalid key sk-"quoted"\\slash given', "other": "kept"})
    redacted = key.redact_json(document)
    assert msgspec.json.decode(redacted) == {"error": "invalid key *** given", "other": "kept"}
    assert ApiKey(SECRET).redact(f"bad key {SECRET}!") == "bad key ***!"


def test_refusal_notice_only_when_every_session_failed_on_authentication() -> None:
    missing = auth_refusal_notice([{"http_401": 1}, {"http_401": 1}], key_sent=False)
    assert missing is not None and "requires an API key" in missing and "401" in missing
    refused = auth_refusal_notice([{"http_401": 1}, {"http_403": 1}], key_sent=True)
    assert refused is not None and "refused the API key" in refused and "401/403" in refused
    assert auth_refusal_notice([{"http_401": 1}, {}], key_sent=False) is None
    assert auth_refusal_notice([{"http_401": 1}, {"http_503": 1}], key_sent=False) is None
    assert auth_refusal_notice([{"http_401": 1, "timeout": 1}], key_sent=False) is None
    assert auth_refusal_notice([], key_sent=False) is None


@pytest.mark.parametrize("kind", ["ws-speech", "http-speech", "webrtc", "realtime"])
def test_every_target_presents_the_key(kind: str) -> None:
    spec = TargetSpec(label=kind, target=kind, url="http://192.0.2.1:1", model="m")
    keyed = target_class(kind)(spec, SessionSettings(api_key=ApiKey(SECRET)))
    assert keyed.auth_headers() == {"Authorization": f"Bearer {SECRET}"}
    assert target_class(kind)(spec, SessionSettings()).auth_headers() == {}


@pytest.mark.parametrize("kind", ["http-speech", "webrtc"])
async def test_http_targets_send_the_key_on_every_request(kind: str) -> None:
    # A documentation address and a given model: open() builds the client without touching the network.
    spec = TargetSpec(label=kind, target=kind, url="http://192.0.2.1:1", model="m")
    target = target_class(kind)(spec, SessionSettings(api_key=ApiKey(SECRET)))
    await target.open()
    try:
        client = target._client  # type: ignore[attr-defined]
        assert isinstance(client, httpx.AsyncClient)
        assert client.headers["authorization"] == f"Bearer {SECRET}"
        assert SECRET not in repr(client.headers)
    finally:
        await target.close()
