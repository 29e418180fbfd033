"""Run inside the browser test's network namespace: serve the gateway and drive the talk page with Chromium.

The server runs as the tests run it (uvicorn on uvloop, the piper voice) on 127.0.0.1, with its ICE host candidate
on the namespace's veth address, since Chromium offers no candidates on loopback.

Usage: python -m tests.browser.page_session OUT_DIR
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from omnigate.engines.piper import PiperEngine
from omnigate.gateway.settings import Settings
from tests.serving import serve

SERVER_ADDRESS = "10.200.0.1"
SCRIPT = Path(__file__).with_name("talk_page.mjs")
NODE_TIMEOUT_S = 120


def main(out_dir: str) -> int:
    engine = PiperEngine.load(None, workers=2)
    with serve(Settings(webrtc_host_addresses=(SERVER_ADDRESS,)), engine=engine) as server:
        command = ["node", str(SCRIPT), server.http_url + "/", out_dir]
        node = subprocess.run(command, timeout=NODE_TIMEOUT_S, check=False)
    return node.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
