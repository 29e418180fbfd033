"""Voice-agent framework plugins that speak through omnigate's streaming WebSocket (``WS /v1/audio/speech/stream``).

``omnigate.integrations.livekit`` (extra ``livekit``) and ``omnigate.integrations.pipecat`` (extra ``pipecat``) import
their framework, so each imports only where it is installed; :mod:`omnigate.integrations.speech_client` is the
framework-free part both share.
"""
