"""The chunked autoregressive talker: CSM-shaped codec-token TTS with continuous batching (DESIGN §4)."""
