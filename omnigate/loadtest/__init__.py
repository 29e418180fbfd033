"""``omnigate-loadtest``: real clients against a running server, measuring TTFA, gaps, underruns and capacity.

A client-side package: it imports no torch and no gateway, engine or model code, so it installs on a load-generating
machine with the ``loadtest`` extra. ``omnigate.loadtest.cli`` is the entry point. The reliability tooling that drives a
live server from outside lives here too: abort and disconnect storms (``storm``), soaks (``soak``), resource
footprints read from ``/metrics`` (``footprint``), their drift verdicts (``trend``) and a server run as a subprocess
(``server_process``).
"""
