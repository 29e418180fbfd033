"""Thin async clients for OpenAI-compatible services a realtime session answers with.

:mod:`.chat` streams ``POST {base}/chat/completions`` (server-sent events) as typed deltas; :mod:`.transcription`
sends a turn's audio to ``POST {base}/audio/transcriptions`` as a WAV. Both run on the event loop over httpx,
bound every wait (connect, first byte, the gap between chunks, the whole request) and the response size, close the
HTTP stream as soon as the caller stops reading, and raise :class:`.errors.ServiceError` with a stable code.
``base`` is the URL an OpenAI SDK takes as ``base_url`` (for example ``http://127.0.0.1:8080/v1``).
"""
