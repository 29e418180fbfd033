"""What a realtime session asks its adapter for: work that waits (scoring, transcription, the LLM) and reports.

The session hands each request to the adapter's callback as it decides; the adapter answers through the session's
methods named here, on the session's thread, in any order and after any delay. Requests never re-enter the session
synchronously.
"""

from __future__ import annotations

import msgspec

from omnigate.engines.openai_compat.messages import ChatRequest
from omnigate.sessions.realtime.responder import TurnTimings


class ScoreSpeech(msgspec.Struct, frozen=True):
    """Score ``pcm`` (24 kHz s16le) for speech, window by window; answer with :meth:`RealtimeSession.speech_scored`
    (or :meth:`RealtimeSession.scoring_failed`)."""

    pcm: bytes


class Transcribe(msgspec.Struct, frozen=True):
    """Transcribe the audio of user item ``item_id``; answer with :meth:`RealtimeSession.transcribed` (or
    :meth:`RealtimeSession.transcription_failed`)."""

    item_id: str
    pcm: bytes  # 24 kHz mono s16le (streaming: the turn's audio not yet sent as HearAudio)


class HearAudio(msgspec.Struct, frozen=True):
    """More audio of the user's turn in progress (24 kHz mono s16le, in order), for a streaming recognizer (the
    policy's ``streaming_transcription``): decode it as it comes. The turn's :class:`Transcribe` carries the rest
    of its audio and ends it; a :class:`ForgetAudio` drops it."""

    pcm: bytes


class ForgetAudio(msgspec.Struct, frozen=True):
    """The turn :class:`HearAudio` was feeding is no turn (the buffer was cleared, turn detection restarted, the
    turn was not transcribed): drop what was heard of it."""


class StartChat(msgspec.Struct, frozen=True):
    """Send ``request`` to the LLM, streamed, for response ``response_id``; hand each delta to
    :meth:`RealtimeSession.chat_delta` (or a failure to :meth:`RealtimeSession.chat_failed`). The session asks for
    one at a time; the adapter opens it once the session's earlier request (cancelled) has closed its stream."""

    response_id: str
    request: ChatRequest


class CancelChat(msgspec.Struct, frozen=True):
    """Stop the LLM request of ``response_id`` now (close its HTTP stream); nothing more of it is wanted."""

    response_id: str


class TurnMeasured(msgspec.Struct, frozen=True):
    """An answered turn's latencies, for the metrics."""

    timings: TurnTimings


class ServiceFailed(msgspec.Struct, frozen=True):
    """The LLM or the transcription service failed a turn with ``code``, for the metrics."""

    code: str


SessionRequest = (
    ScoreSpeech | HearAudio | ForgetAudio | Transcribe | StartChat | CancelChat | TurnMeasured | ServiceFailed
)
