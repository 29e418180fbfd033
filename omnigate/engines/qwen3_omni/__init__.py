"""Qwen3-Omni served natively: thinker, talker and the streaming Code2Wav decoder."""
