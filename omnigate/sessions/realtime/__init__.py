"""The OpenAI Realtime protocol's session core (sans-I/O): conversation, turns, responses and what goes out."""
