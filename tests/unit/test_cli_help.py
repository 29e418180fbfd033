"""``omnigate serve --help``: every option explained, each default printed once and only where it says something."""

from __future__ import annotations

import argparse
import re

from omnigate.engines.registry import LOADERS
from omnigate.gateway.cli.serve import build_parser


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    [sub] = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    serve: argparse.ArgumentParser = sub.choices["serve"]
    return serve


def test_every_option_has_help_and_one_meaningful_default() -> None:
    text = serve_parser().format_help()
    assert "(default: None)" not in text and "(default: [])" not in text and "(default: False)" not in text
    for action in serve_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
    help_text = re.sub(r"\s+", " ", text)
    assert "(default: the engine's slots)" in help_text and "(default: 30.0)" in help_text
    for option in help_text.split(" --")[1:]:
        assert option.count("(default") <= 1, option


def test_engine_help_names_every_engine_family() -> None:
    [engine] = [action for action in serve_parser()._actions if "--engine" in action.option_strings]
    assert engine.help is not None
    for family in LOADERS:
        assert f"{family} (" in engine.help, family


def test_limits_say_what_happens_when_reached() -> None:
    actions = {action.dest: action.help or "" for action in serve_parser()._actions}
    assert "closed" in actions["idle_timeout"]
    assert "max_duration" in actions["max_utterance_audio"]
    assert actions["log_level"]
