"""``omnigate serve`` video options reach the settings; without them no video engine is configured."""

from __future__ import annotations

from omnigate.gateway.cli.serve import build_parser, settings_from_args


def test_video_model_and_options_reach_the_settings() -> None:
    args = build_parser().parse_args(
        ["serve", "--video-model", "preset:tiny", "-V", "max_sessions=3", "--video-option", "device=cpu"]
    )
    settings = settings_from_args(args)
    assert settings.video_model == "preset:tiny"
    assert settings.video_options == {"max_sessions": "3", "device": "cpu"}


def test_no_video_engine_unless_a_model_is_named() -> None:
    settings = settings_from_args(build_parser().parse_args(["serve"]))
    assert settings.video_model is None and settings.video_options == {}
