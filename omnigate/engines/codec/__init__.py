"""Neural audio codec decoders used by the model engines."""
