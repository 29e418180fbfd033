"""``python -m omnigate.engines.remote``: operate the engine tier on a Ray cluster."""

import sys

from omnigate.engines.remote.admin import main

sys.exit(main())
