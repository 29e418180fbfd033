"""OpenAI's Realtime API: ``WS /v1/realtime``, the decoding of its client messages, the connection that runs the
session core (:mod:`omnigate.sessions.realtime`) over a speech or a duplex engine, and those engines' backends."""
