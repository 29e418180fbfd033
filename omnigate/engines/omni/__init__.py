"""The omni engine: a vision (and audio) encoder and a language-model thinker whose answer streams as text."""
