"""Run inside the browser test's network namespace: serve the gateway with the tiny video preset and drive the video
page with Chromium.

The server runs as the tests run it (uvicorn on uvloop, the synthetic speech engine, the random-weight ``tiny``
video preset on the CPU) on 127.0.0.1, with its ICE host candidate on the namespace's veth address, since Chromium
offers no candidates on loopback.

Usage: python -m tests.browser.video_page_session OUT_DIR
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from omnigate.gateway.settings import Settings
from tests.browser.page_session import NODE_TIMEOUT_S, SERVER_ADDRESS
from tests.serving import serve

SCRIPT = Path(__file__).with_name("video_page.mjs")
VIDEO_OPTIONS = {"max_sessions": "1", "max_frames_in_flight": "5", "max_video_pixels": str(96 * 64 * 17)}


def main(out_dir: str) -> int:
    settings = Settings(
        engine="synthetic",
        video_model="preset:tiny",
        video_options=VIDEO_OPTIONS,
        webrtc_host_addresses=(SERVER_ADDRESS,),
    )
    with serve(settings) as server:
        command = ["node", str(SCRIPT), server.http_url + "/static/video.html", out_dir]
        node = subprocess.run(command, timeout=NODE_TIMEOUT_S, check=False)
    return node.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
