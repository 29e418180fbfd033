"""Skips, with the reason, the tests that need system packages when ``scripts/test --no-system`` did not install
them (it sets ``OMNIGATE_NO_SYSTEM_PACKAGES=1``). Servers the tests start, in-process or as ``omnigate serve``
subprocesses, run without the embedded LLM (``OMNIGATE_EMBEDDED_AGENT=0``) unless a test asks for it: loading it
in every test server would cost each ~15 s of CPU and a gigabyte."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMNIGATE_EMBEDDED_AGENT", "0")

# Marker -> the system packages its tests need (scripts/test installs them with apt-get and npm).
SYSTEM_PACKAGES = {"browser": "chromium and node/npm (playwright-core)", "haproxy": "haproxy"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("OMNIGATE_NO_SYSTEM_PACKAGES") != "1":
        return
    for item in items:
        needed = [packages for marker, packages in SYSTEM_PACKAGES.items() if item.get_closest_marker(marker)]
        if needed:
            reason = f"needs {' and '.join(needed)}, which scripts/test --no-system does not install"
            item.add_marker(pytest.mark.skip(reason=reason))
