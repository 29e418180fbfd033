"""The duplex engine: Moshi-family speech-to-speech models served in lockstep 80 ms ticks."""
