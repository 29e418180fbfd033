"""The responder's sans-I/O parts: the LLM's messages from a conversation, tools, streamed tool calls, timings."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from omnigate.engines.openai_compat.messages import ChatMessage, ToolCallDelta
from omnigate.gateway.ops.metrics import Metrics
from omnigate.gateway.settings import Settings
from omnigate.gateway.state import Gateway
from omnigate.sessions.realtime.responder import (
    HistoryItem,
    ResponderInputError,
    ToolCallAssembler,
    ToolCallError,
    TurnTiming,
    chat_messages,
    chat_request,
    chat_tool_choice,
    chat_tools,
)


def user(text: str) -> HistoryItem:
    return HistoryItem(role="user", text=text)


def assistant(text: str, response_id: str = "resp_1") -> HistoryItem:
    return HistoryItem(role="assistant", text=text, response_id=response_id)


def call(call_id: str, response_id: str = "resp_2", name: str = "get_weather") -> HistoryItem:
    return HistoryItem(
        kind="function_call", call_id=call_id, name=name, arguments='{"city": "Oslo"}', response_id=response_id
    )


def output(call_id: str, text: str = "sunny") -> HistoryItem:
    return HistoryItem(kind="function_call_output", call_id=call_id, output=text)


def wire(messages: list[ChatMessage]) -> list[dict[str, object]]:
    return msgspec.json.decode(msgspec.json.encode(messages))  # type: ignore[no-any-return]


def test_a_conversation_becomes_chat_messages_in_openai_form() -> None:
    history = [
        user("What's the weather in Oslo and Bergen?"),
        call("call_a"),
        call("call_b"),
        output("call_a", "sunny"),
        output("call_b", "rain"),
        assistant("Sunny in Oslo, rain in Bergen.", "resp_3"),
        user("Thanks!"),
    ]
    assert wire(chat_messages("Be brief.", history, max_chars=10_000)) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What's the weather in Oslo and Bergen?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    "type": "function",
                },
                {
                    "id": "call_b",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    "type": "function",
                },
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_a"},
        {"role": "tool", "content": "rain", "tool_call_id": "call_b"},
        {"role": "assistant", "content": "Sunny in Oslo, rain in Bergen."},
        {"role": "user", "content": "Thanks!"},
    ]


def test_a_truncated_reply_is_told_to_the_llm_as_far_as_it_was_heard() -> None:
    # The session hands over the transcript conversation.item.truncate left: the model hears what the user heard.
    messages = chat_messages("", [user("Tell me a story."), assistant("Once upon a"), user("Stop.")], max_chars=1000)
    assert [(m.role, m.content) for m in messages] == [
        ("user", "Tell me a story."),
        ("assistant", "Once upon a"),
        ("user", "Stop."),
    ]


def test_calls_without_answers_and_answers_without_calls_are_left_out() -> None:
    history = [user("a"), call("call_x"), user("b"), output("call_y"), call("call_z", "resp_9"), output("call_z")]
    messages = chat_messages("", history, max_chars=1000)
    assert [m.role for m in messages] == ["user", "user", "assistant", "tool"]
    assert messages[2].tool_calls[0].id == "call_z"  # type: ignore[index]


def test_calls_of_different_responses_are_separate_assistant_messages() -> None:
    history = [user("a"), call("c1", "r1"), output("c1"), call("c2", "r2"), output("c2")]
    assert [m.role for m in chat_messages("", history, max_chars=1000)] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]


def test_empty_items_are_skipped() -> None:
    assert chat_messages("  ", [user(" "), assistant("")], max_chars=100) == []


def test_history_is_trimmed_oldest_first_keeping_instructions_and_the_newest_user_turn() -> None:
    history = [user("1" * 40), assistant("2" * 40), user("3" * 40), assistant("4" * 40), user("5" * 40)]
    messages = chat_messages("I" * 10, history, max_chars=10 + 3 * 40)
    assert [m.content for m in messages] == ["I" * 10, "3" * 40, "4" * 40, "5" * 40]
    # Over budget on its own, the newest user turn still goes, with the instructions.
    messages = chat_messages("I" * 10, history, max_chars=5)
    assert [m.content for m in messages] == ["I" * 10, "5" * 40]


def test_trimming_drops_a_tool_call_with_its_outputs() -> None:
    history = [user("u" * 10), call("c1", "r1"), output("c1", "o" * 50), user("v" * 10)]
    messages = chat_messages("", history, max_chars=40)
    assert [m.role for m in messages] == ["user"]
    assert [m.role for m in chat_messages("", history, max_chars=200)] == ["user", "assistant", "tool", "user"]


def test_the_newest_user_turn_keeps_what_follows_it() -> None:
    # A tool round after the last user message (the client answered a call) is part of the turn being answered.
    history = [user("x" * 100), user("weather?"), call("c1"), output("c1", "o" * 100)]
    assert [m.role for m in chat_messages("", history, max_chars=10)] == ["user", "assistant", "tool"]


def test_realtime_tools_become_chat_tools() -> None:
    tools = [
        {"type": "function", "name": "get_weather", "description": "The weather", "parameters": {"type": "object"}},
        {"type": "function", "name": "hang_up"},
    ]
    assert msgspec.to_builtins(chat_tools(tools)) == [
        {
            "function": {"name": "get_weather", "description": "The weather", "parameters": {"type": "object"}},
            "type": "function",
        },
        {"function": {"name": "hang_up"}, "type": "function"},
    ]


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "mcp", "server_label": "x"}], "tools[0]"),
        ([{"type": "function"}], "tools[0].name"),
        ([{"type": "function", "name": "f", "parameters": "schema"}], "tools[0].parameters"),
        (["get_weather"], "tools[0]"),
    ],
)
def test_tools_the_llm_cannot_take_are_refused_with_the_parameter(tools: list[object], param: str) -> None:
    with pytest.raises(ResponderInputError) as caught:
        chat_tools(tools)
    assert caught.value.param == param


def test_tool_choice_maps_to_the_chat_shape() -> None:
    assert chat_tool_choice("required") == "required"
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    with pytest.raises(ResponderInputError):
        chat_tool_choice("sometimes")
    with pytest.raises(ResponderInputError):
        chat_tool_choice({"type": "function"})


def ids() -> itertools.count[int]:
    return itertools.count(1)


def test_streamed_tool_call_pieces_assemble_into_calls_in_index_order() -> None:
    counter = ids()
    assembler = ToolCallAssembler(lambda: f"call_gen{next(counter)}")
    pieces = [
        ToolCallDelta(1, "call_b", "hang_up", ""),
        ToolCallDelta(0, "call_a", "get_weather", '{"ci'),
        ToolCallDelta(0, None, None, 'ty": '),
        ToolCallDelta(1, None, "hang_up", "{}"),  # a server repeating the name on every piece
        ToolCallDelta(0, None, None, '"Oslo"}'),
    ]
    assert [assembler.add(piece) for piece in pieces] == ["call_b", "call_a", "call_a", "call_b", "call_a"]
    calls = assembler.complete()
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("call_a", "get_weather", '{"city": "Oslo"}'),
        ("call_b", "hang_up", "{}"),
    ]


def test_a_call_without_an_id_gets_one_and_empty_arguments_are_an_empty_object() -> None:
    assembler = ToolCallAssembler(lambda: "call_gen1")
    assert assembler.add(ToolCallDelta(0, None, "get_", "")) == "call_gen1"
    assembler.add(ToolCallDelta(0, None, "time", ""))  # a server splitting the name
    [only] = assembler.complete()
    assert (only.id, only.function.name, only.function.arguments) == ("call_gen1", "get_time", "{}")


def test_incomplete_or_broken_calls_are_errors() -> None:
    assembler = ToolCallAssembler(lambda: "c")
    assembler.add(ToolCallDelta(0, "c", None, "{}"))
    with pytest.raises(ToolCallError, match="no function name"):
        assembler.complete()
    assembler = ToolCallAssembler(lambda: "c")
    assembler.add(ToolCallDelta(0, "c", "f", '{"a": '))
    with pytest.raises(ToolCallError, match="not JSON"):
        assembler.complete()
    assembler = ToolCallAssembler(lambda: "c", max_argument_chars=8)
    with pytest.raises(ToolCallError, match="longer"):
        assembler.add(ToolCallDelta(0, "c", "f", "x" * 9))


def test_turn_timing_splits_voice_to_voice_into_the_services_and_omnigates_own_time() -> None:
    timing = TurnTiming(start=10.0)
    for step, at in [
        ("asr_sent", 10.010),
        ("transcript_done", 10.160),
        ("llm_sent", 10.165),
        ("first_token", 10.365),
        ("first_token", 10.9),  # later marks change nothing
        ("first_segment", 10.400),
        ("tts_sent", 10.402),
        ("tts_first_audio", 10.452),
        ("first_audio_out", 10.460),
    ]:
        timing.mark(step, at)
    t = timing.timings()
    assert t.transcript_ms == pytest.approx(160.0)
    assert t.asr_ms == pytest.approx(150.0)
    assert t.first_token_ms == pytest.approx(365.0)
    assert t.llm_ms == pytest.approx(235.0)
    assert t.tts_ms == pytest.approx(50.0)
    assert t.first_audio_ms == pytest.approx(460.0)
    assert t.overhead_ms == pytest.approx(25.0)
    assert t.metadata()["omnigate_overhead_ms"] == "25.0"


def test_a_text_turn_has_no_transcription_time_and_an_unfinished_turn_no_overhead() -> None:
    timing = TurnTiming(start=0.0)
    for step, at in [("llm_sent", 0.001), ("first_token", 0.2), ("tts_sent", 0.201), ("tts_first_audio", 0.25)]:
        timing.mark(step, at)
    assert timing.timings().overhead_ms is None
    timing.mark("first_audio_out", 0.26)
    t = timing.timings()
    assert t.asr_ms is None and t.transcript_ms is None
    assert t.overhead_ms == pytest.approx(260.0 - 199.0 - 49.0)
    assert "omnigate_asr_ms" not in t.metadata()
    with pytest.raises(ValueError, match="no turn step"):
        timing.mark("nonsense", 1.0)


def test_a_response_request_carries_model_tools_and_the_smaller_token_cap() -> None:
    tools = [{"type": "function", "name": "hang_up"}]
    request = chat_request(
        instructions="Be brief.",
        history=[user("bye")],
        max_chars=1000,
        max_tokens=1024,
        model="qwen",
        tools=tools,
        tool_choice="required",
        max_output_tokens=200,
    )
    assert msgspec.to_builtins(request) == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "bye"}],
        "model": "qwen",
        "tools": [{"function": {"name": "hang_up"}, "type": "function"}],
        "tool_choice": "required",
        "max_tokens": 200,
    }
    plain = msgspec.to_builtins(chat_request(instructions="", history=[user("hi")], max_chars=100, max_tokens=50))
    assert plain == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}


def test_turn_timings_feed_the_metrics_histogram() -> None:
    metrics = Metrics(Gateway(Settings()))
    timing = TurnTiming(start=0.0)
    timing.mark("transcript_done", 0.15)
    metrics.observe_responder_turn(timing.timings())
    text = metrics.render().decode()
    assert 'omnigate_responder_turn_seconds_count{step="transcript"} 1.0' in text
    assert 'step="overhead"' not in text
