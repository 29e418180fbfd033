"""The engine-core process: one engine pool in its own process, served to gateway processes over a Unix socket."""
