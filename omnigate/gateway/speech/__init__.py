"""Speech out: ``WS /v1/audio/speech/stream`` (incremental text in, audio out) and ``POST /v1/audio/speech`` (OpenAI's
TTS API), the wire events they share, the voice names clients send and the encoding of PCM into the client's format."""
