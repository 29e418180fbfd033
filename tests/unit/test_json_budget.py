"""The JSON value budget checked before a client message is decoded."""

from __future__ import annotations

import json

import msgspec

from omnigate.gateway.json_budget import MAX_JSON_VALUES, json_budget_problem, json_values_bound


def _count_values(value: object) -> int:
    if isinstance(value, dict):
        return 1 + sum(_count_values(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_count_values(v) for v in value)
    return 1


def test_the_bound_is_never_below_the_values_a_message_holds() -> None:
    messages = [
        {"type": "input.text", "text": "Hello, world. {Braces} and [brackets] in a string count too."},
        {"type": "session.update", "session": {"tools": [{"type": "function", "parameters": {"a": [1, 2, {}]}}] * 9}},
        [[], [[]], {}, {"a": {"b": [None, True, 1.5]}}],
        "a string",
        7,
    ]
    for message in messages:
        raw = json.dumps(message)
        assert json_values_bound(raw) >= _count_values(message)
        assert json_values_bound(raw.encode()) == json_values_bound(raw)


def test_a_message_over_the_budget_is_refused_before_decoding_and_one_within_it_is_not() -> None:
    bomb = '{"type":"ping","x":[' + ",".join(["{}"] * MAX_JSON_VALUES) + "]}"
    assert json_budget_problem(bomb) is not None
    assert json_budget_problem(bomb.encode()) is not None
    audio = json.dumps({"type": "input_audio_buffer.append", "audio": "QUJD" * 1_000_000})  # 4 MB in one value
    assert json_budget_problem(audio) is None
    tools = {"type": "session.update", "session": {"tools": [{"name": f"t{i}", "parameters": {}} for i in range(128)]}}
    assert json_budget_problem(json.dumps(tools)) is None
    assert msgspec.json.decode(json.dumps(tools))["session"]["tools"][127]["name"] == "t127"
