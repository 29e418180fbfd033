"""``python -m omnigate.gateway.cli``: the ``omnigate`` command."""

import sys

from omnigate.gateway.cli.serve import main

sys.exit(main())
