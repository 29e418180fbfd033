"""``omnigate-loadtest``'s usage: every subcommand in its help, a mistyped subcommand or a URL that is none refused
at once (argparse's exit code 2), and the SLO a run is judged by when none is given."""

from __future__ import annotations

import pytest

from omnigate.loadtest.cli import DEFAULT_SLO, SUBCOMMANDS, main, resolve_slo
from omnigate.loadtest.report import TargetSpec
from omnigate.loadtest.targets.realtime import TALK_SLO


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_the_help_lists_every_subcommand_and_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    shown = capsys.readouterr().out
    assert set(SUBCOMMANDS) == {"run", "baseline", "standins", "soak"}
    for name in SUBCOMMANDS:
        assert f"\n  {name} " in shown, name
    assert "exit status" in shown and "1  a level missed its SLO, no session connected" in shown


def test_a_mistyped_subcommand_is_refused_with_the_closest_one(capsys: pytest.CaptureFixture[str]) -> None:
    error = usage_error(capsys, "standin", "--port", "8090")
    assert "'standin' is neither a subcommand (run, baseline, standins, soak) nor a server URL" in error
    assert error.rstrip().endswith("did you mean 'standins'?")
    assert "did you mean 'soak'?" in usage_error(capsys, "soka")


@pytest.mark.parametrize(
    ("argv", "wording"),
    [
        (["localhost:8000"], "a server URL starts with http:// or https:// or ws:// or wss://"),
        (["run", "127.0.0.1:8000"], "a server URL starts with http://"),
        (["run", "http:///v1/realtime", "--target", "realtime"], "for the realtime target: the URL names no host"),
        (["run", "http://h:99999"], "the port is not a number within 0..65535"),
        (["--compare", "http://h:1", "label=b,url=ftp://h:2"], "'ftp://h:2' is not a server URL"),
        (["soak", "h:1", "--sessions", "1"], "'h:1' is not a server URL"),
    ],
)
def test_a_url_that_names_no_server_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], wording: str
) -> None:
    assert wording in usage_error(capsys, *argv)


def spec(url: str, target: str = "realtime") -> TargetSpec:
    return TargetSpec(label=target, target=target, url=url)


def test_talk_mode_is_judged_by_its_voice_to_voice_slo_unless_one_is_given() -> None:
    talk = spec("http://h:8000#talk=1")
    assert resolve_slo(None, [talk]) == TALK_SLO
    assert TALK_SLO.limit_ms == 1500.0 and "voice to voice" in TALK_SLO.basis
    assert resolve_slo(None, [spec("http://h:8000")]) == DEFAULT_SLO
    assert resolve_slo(None, [spec("http://h:8000", "ws-speech")]) == DEFAULT_SLO
    given = resolve_slo(250.0, [talk])
    assert (given.limit_ms, given.basis) == (250.0, "--slo-ttfa-ms")
    with pytest.raises(ValueError, match="different default SLOs"):
        resolve_slo(None, [talk, spec("http://h:8000", "ws-speech")])
    assert resolve_slo(None, [talk, talk]) == TALK_SLO


def test_the_run_help_names_the_talk_slo(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"talk mode, whose TTFA is a whole voice-to-voice turn: {TALK_SLO.limit_ms:g}" in help_text
    assert "omnigate-loadtest --help" in help_text
