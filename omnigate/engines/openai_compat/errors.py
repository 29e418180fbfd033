"""The typed failures of an OpenAI-compatible service call, with codes that stay stable for clients."""

from __future__ import annotations

from typing import Literal

Service = Literal["llm", "asr"]
# <service>_unavailable: connection refused, DNS, reset before a response; <service>_timeout: a wait ran out;
# <service>_error: the service answered with an HTTP error; <service>_bad_response: what came back is not the API.
# An embedded service's own limits: <service>_busy: all its workers are taken; <service>_audio_limit: a turn longer
# than it decodes.
Failure = Literal["unavailable", "timeout", "error", "bad_response", "busy", "audio_limit"]


class ServiceError(Exception):
    """A call to the LLM or transcription service failed; ``code`` is ``llm_timeout``, ``asr_error`` and so on."""

    def __init__(self, service: Service, failure: Failure, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.service = service
        self.failure = failure
        self.code = f"{service}_{failure}"
        self.message = message
        self.status = status  # the HTTP status of an ``*_error``

    def __repr__(self) -> str:
        return f"ServiceError({self.code!r}, {self.message!r}, status={self.status!r})"
