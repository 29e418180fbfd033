"""Run inside the browser test's network namespace: serve the gateway with the chunk-causal tiny video preset and
drive the video page's live mode with Chromium (as :mod:`tests.browser.video_page_session` does for clips).

Usage: python -m tests.browser.video_live_page_session OUT_DIR
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from omnigate.gateway.settings import Settings
from tests.browser.page_session import NODE_TIMEOUT_S, SERVER_ADDRESS
from tests.serving import serve

SCRIPT = Path(__file__).with_name("video_live_page.mjs")


def main(out_dir: str) -> int:
    settings = Settings(
        engine="synthetic",
        video_model="preset:tiny-causal",
        video_options={"max_sessions": "1"},
        webrtc_host_addresses=(SERVER_ADDRESS,),
    )
    with serve(settings) as server:
        command = ["node", str(SCRIPT), server.http_url + "/static/video.html", out_dir]
        node = subprocess.run(command, timeout=NODE_TIMEOUT_S, check=False)
    return node.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
