"""Qwen3-Omni served natively: thinker, talker and code predictor on slot caches, batched across sessions."""
