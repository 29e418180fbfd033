"""session.update and response.create rules: what each engine kind accepts, and typed refusals."""

from __future__ import annotations

import msgspec
import pytest

from omnigate.engines.base import EngineCapabilities, EngineInfo, VoiceInfo
from omnigate.sessions.realtime.capabilities import RealtimeCapabilities, capabilities_for
from omnigate.sessions.realtime.client_events import ResponseParams, SessionPatch
from omnigate.sessions.realtime.config import (
    ConfigRefused,
    RealtimeConfig,
    apply_update,
    default_config,
    response_settings,
    session_object,
)

TTS = capabilities_for(
    EngineInfo(
        family="piper",
        model="joe",
        sample_rate=22050,
        voices=(VoiceInfo(id="joe", name="Joe"),),
        default_voice="joe",
        capabilities=EngineCapabilities(),
        max_sessions=8,
    )
)
DUPLEX = capabilities_for(
    EngineInfo(
        family="duplex",
        model="preset:tiny",
        sample_rate=24000,
        voices=(VoiceInfo(id="moshi", name="Moshi"),),
        default_voice="moshi",
        capabilities=EngineCapabilities(duplex=True),
        max_sessions=4,
    )
)
SERVED = frozenset({"joe", "piper", "gpt-realtime"})


def resolve(name: str) -> str:
    return "joe" if name in ("joe", "alloy", "marin") else name


def patch(session: dict[str, object]) -> SessionPatch:
    return msgspec.convert(session, SessionPatch)


def update(
    config: RealtimeConfig, session: dict[str, object], *, caps: RealtimeCapabilities = TTS, locked: bool = False
) -> RealtimeConfig:
    return apply_update(
        config,
        patch(session),
        caps,
        served_models=SERVED,
        resolve_voice=resolve,
        voice_locked=locked,
    )


def test_capabilities_differ_by_engine_kind() -> None:
    assert TTS.speaks_text_items and not TTS.create_response and TTS.client_commit and not TTS.native_duplex
    assert DUPLEX.native_duplex and DUPLEX.create_response and not DUPLEX.speaks_text_items
    assert DUPLEX.output_modalities == ("audio", "text") and TTS.output_modalities == ("audio",)
    wire = session_object(default_config(TTS, "joe"), "sess_1", TTS)
    assert wire.capabilities.voices == ["joe"] and wire.audio.input.turn_detection is not None
    assert wire.audio.input.turn_detection.create_response is False


def test_only_named_fields_change() -> None:
    base = default_config(TTS, "joe")
    changed = update(
        base,
        {
            "type": "realtime",
            "audio": {
                "output": {"voice": "alloy", "format": {"type": "audio/pcmu"}},
                "input": {"format": {"type": "audio/pcma"}, "turn_detection": {"type": "server_vad", "threshold": 0.7}},
            },
        },
    )
    assert changed.voice == "joe" and changed.output_format == "audio/pcmu" and changed.input_format == "audio/pcma"
    assert changed.turn_detection is not None and changed.turn_detection.settings.threshold == 0.7
    assert changed.turn_detection.settings.silence_duration_ms == 500  # untouched
    assert changed.turn_detection.interrupt_response is True
    cleared = update(changed, {"audio": {"input": {"turn_detection": None}}})
    assert cleared.turn_detection is None and cleared.output_format == "audio/pcmu"


@pytest.mark.parametrize(
    ("session", "code", "param"),
    [
        ({"type": "transcription"}, "unsupported", "session.type"),
        ({"model": "gpt-9"}, "model_not_found", "session.model"),
        ({"output_modalities": ["text"]}, "unsupported", "session.output_modalities"),
        (
            {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            "unsupported_format",
            "session.audio.input.format",
        ),
        (
            {"audio": {"output": {"format": {"type": "audio/opus"}}}},
            "unsupported_format",
            "session.audio.output.format",
        ),
        ({"audio": {"output": {"speed": 1.2}}}, "unsupported", "session.audio.output.speed"),
        ({"max_output_tokens": 0}, "invalid_value", "session.max_output_tokens"),
    ],
)
def test_what_the_tts_engine_lacks_is_refused_typed(session: dict[str, object], code: str, param: str) -> None:
    base = default_config(TTS, "joe")
    with pytest.raises(ConfigRefused) as refused:
        update(base, session)
    assert (refused.value.code, refused.value.param) == (code, param)


def test_a_refused_update_changes_nothing() -> None:
    base = default_config(TTS, "joe")
    with pytest.raises(ConfigRefused):
        update(
            base,
            {
                "tools": [{"type": "function", "name": "f"}],
                "audio": {"output": {"format": {"type": "audio/pcmu"}, "speed": 1.2}},
            },
        )
    assert base == default_config(TTS, "joe")  # configs are immutable values: the session keeps the old one


# What LiveKit's and Pipecat's realtime clients send in their first session.update, whatever the model behind it.
FRAMEWORK_SESSION: dict[str, object] = {
    "type": "realtime",
    "instructions": "You are a helpful assistant.",
    "tools": [{"type": "function", "name": "lookup", "description": "d", "parameters": {"type": "object"}}],
    "tool_choice": "auto",
    "temperature": 0.8,
    "max_output_tokens": "inf",
    "include": ["item.input_audio_transcription.logprobs"],
    "tracing": "auto",
    "output_modalities": ["audio"],
    "audio": {
        "input": {
            "format": {"type": "audio/pcm", "rate": 24000},
            "transcription": {"model": "gpt-4o-mini-transcribe"},
            "noise_reduction": {"type": "near_field"},
            "turn_detection": {
                "type": "semantic_vad",
                "eagerness": "medium",
                "create_response": True,
                "interrupt_response": True,
            },
        },
        "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "marin", "speed": 1.0},
    },
}


def test_what_agent_frameworks_send_is_accepted_echoed_and_listed_as_unused() -> None:
    config = update(default_config(TTS, "joe"), FRAMEWORK_SESSION)
    wire = msgspec.to_builtins(session_object(config, "sess_1", TTS))
    assert wire["instructions"] == "You are a helpful assistant."
    assert wire["tools"][0]["name"] == "lookup" and wire["temperature"] == 0.8 and wire["tracing"] == "auto"
    assert wire["include"] == ["item.input_audio_transcription.logprobs"]
    assert wire["audio"]["input"]["transcription"] == {"model": "gpt-4o-mini-transcribe"}
    assert wire["audio"]["input"]["noise_reduction"] == {"type": "near_field"}
    # Semantic VAD is served by the server VAD, and a TTS engine creates no responses of its own: said, not hidden.
    assert wire["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert wire["audio"]["input"]["turn_detection"]["create_response"] is False
    assert wire["unused_fields"] == [
        "session.instructions",
        "session.tools",
        "session.temperature",
        "session.include",
        "session.audio.input.transcription",
        "session.tracing",
        "session.audio.input.noise_reduction",
        "session.audio.input.turn_detection.create_response",
        "session.audio.input.turn_detection.type",
        "session.audio.input.turn_detection.eagerness",
    ]
    cleared = update(
        config,
        {
            "instructions": "",
            "tools": [],
            "temperature": None,
            "include": None,
            "tracing": None,
            "audio": {
                "input": {"transcription": None, "noise_reduction": None, "turn_detection": {"type": "server_vad"}}
            },
        },
    )
    assert session_object(cleared, "sess_1", TTS).unused_fields == []
    # with an LLM writing the answers, the instructions, tools and temperature reach it
    agent = msgspec.structs.replace(TTS, create_response=True, instructions=True, tools=True, temperature=True)
    used = session_object(config, "sess_1", agent).unused_fields
    assert not {"session.instructions", "session.tools", "session.temperature"} & set(used)


def test_a_response_with_instructions_and_tools_is_accepted() -> None:
    params = msgspec.convert({"instructions": "Say hi", "tools": [{"type": "function", "name": "f"}]}, ResponseParams)
    assert response_settings(default_config(TTS, "joe"), params, TTS, resolve).voice == "joe"


def test_duplex_rules() -> None:
    base = default_config(DUPLEX, "preset:tiny")
    assert base.turn_detection is None  # the model takes its own turns
    vad = update(base, {"audio": {"input": {"turn_detection": {"type": "server_vad"}}}}, caps=DUPLEX)
    assert vad.turn_detection is not None and vad.turn_detection.create_response is True
    text_only = update(base, {"output_modalities": ["text"]}, caps=DUPLEX)
    assert text_only.output_modalities == ("text",)
    with pytest.raises(ConfigRefused) as refused:
        update(
            base,
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "create_response": False}}}},
            caps=DUPLEX,
        )
    assert refused.value.param == "session.audio.input.turn_detection.create_response"


def test_the_voice_locks_once_audio_was_sent() -> None:
    two_voices = msgspec.structs.replace(TTS, voices=("joe", "other"))
    base = RealtimeConfig(model="joe", voice="other", turn_detection=None)
    with pytest.raises(ConfigRefused) as refused:
        update(base, {"audio": {"output": {"voice": "joe"}}}, caps=two_voices, locked=True)
    assert refused.value.code == "voice_locked"
    assert update(base, {"audio": {"output": {"voice": "other"}}}, caps=two_voices, locked=True).voice == "other"


def test_response_overrides() -> None:
    base = default_config(TTS, "joe")
    settings = response_settings(
        base,
        msgspec.convert(
            {"metadata": {"client_event_id": "x"}, "conversation": "none", "max_output_tokens": 10}, ResponseParams
        ),
        TTS,
        resolve,
    )
    assert (
        settings.metadata == {"client_event_id": "x"}
        and not settings.in_conversation
        and settings.max_output_tokens == 10
    )
    with pytest.raises(ConfigRefused, match="metadata"):
        response_settings(base, ResponseParams(metadata={str(i): "v" for i in range(17)}), TTS, resolve)
    with pytest.raises(ConfigRefused) as refused:
        response_settings(
            base, msgspec.convert({"audio": {"output": {"voice": "nobody"}}}, ResponseParams), TTS, resolve
        )
    assert refused.value.param == "response.audio.output.voice"


def test_beta_names_are_served_as_their_ga_fields_and_unread_fields_are_unused() -> None:
    base = default_config(TTS, "joe")
    beta = {"voice": "alloy", "modalities": ["text", "audio"], "input_audio_format": "g711_alaw"}
    config = apply_update(
        base,
        patch({**beta, "output_audio_format": "g711_ulaw"}),
        TTS,
        served_models=SERVED,
        resolve_voice=resolve,
        voice_locked=False,
        unknown=("session.foo",),
    )
    assert (config.voice, config.output_modalities) == ("joe", ("audio",))
    assert (config.input_format, config.output_format) == ("audio/pcma", "audio/pcmu")
    assert session_object(config, "sess_1", TTS).unused_fields == ["session.foo"]
    # Beside its GA field a beta name is not used; unread fields stay named, each once, until the session ends.
    both = apply_update(
        config,
        patch({"voice": "marin", "audio": {"output": {"voice": "joe"}}, "input_audio_format": "pcm16"}),
        TTS,
        served_models=SERVED,
        resolve_voice=resolve,
        voice_locked=False,
        unknown=("session.foo", "session.bar"),
    )
    assert both.voice == "joe" and both.input_format == "audio/pcm"
    assert session_object(both, "sess_1", TTS).unused_fields == ["session.foo", "session.bar", "session.voice"]
    assert update(base, {"modalities": ["text"]}, caps=DUPLEX).output_modalities == ("text",)


@pytest.mark.parametrize(
    ("session", "code", "param"),
    [
        ({"voice": "bob"}, "unknown_voice", "session.voice"),
        ({"audio": {"output": {"voice": "bob"}}}, "unknown_voice", "session.audio.output.voice"),
        ({"input_audio_format": "opus"}, "unsupported_format", "session.input_audio_format"),
        ({"modalities": ["text"]}, "unsupported", "session.modalities"),
    ],
)
def test_what_the_session_cannot_honour_is_refused_where_the_client_put_it(
    session: dict[str, object], code: str, param: str
) -> None:
    with pytest.raises(ConfigRefused) as refused:
        update(default_config(TTS, "joe"), session)
    assert (refused.value.code, refused.value.param) == (code, param)
    if code == "unknown_voice":
        assert refused.value.message.startswith("voice 'bob' is not served; available: joe; aliases of these")


def test_a_duplex_model_refuses_a_voice_it_does_not_have() -> None:
    with pytest.raises(ConfigRefused) as refused:
        update(default_config(DUPLEX, "preset:tiny"), {"voice": "bob"}, caps=DUPLEX)
    assert refused.value.code == "unknown_voice"
