"""omnigate: a self-hosted realtime streaming media gateway."""

__version__ = "0.1.0"
