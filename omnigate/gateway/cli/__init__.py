"""``omnigate serve``: the command line (its options, the settings they make, the startup safety check) and the
supervisor that runs an engine core with several gateway workers. ``python -m omnigate.gateway.cli`` runs it too."""

from omnigate.gateway.cli.serve import main

__all__ = ["main"]
