"""OpenAI's Realtime API: ``WS /v1/realtime``, its client and server events, the connection that runs a conversation
over a speech or a duplex engine, and the audio formats it speaks."""
