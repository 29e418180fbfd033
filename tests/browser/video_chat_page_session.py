"""Run inside the browser test's network namespace: serve the gateway with the tiny omni preset and drive the video
chat page with Chromium, whose fake camera plays a Y4M file and whose fake microphone plays a WAV file (both made
here: a moving square, and a tone burst followed by silence, which the server VAD takes for a spoken question).

Usage: python -m tests.browser.video_chat_page_session OUT_DIR
"""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

import numpy as np

from omnigate.gateway.settings import Settings
from tests.browser.page_session import NODE_TIMEOUT_S, SERVER_ADDRESS
from tests.serving import serve

SCRIPT = Path(__file__).with_name("video_chat_page.mjs")
WIDTH, HEIGHT, FPS, SECONDS = 320, 240, 10, 4


def write_y4m(path: Path) -> None:
    """4 s of 320x240 I420 at 10 fps: a bright square moving over a grey ramp."""
    y_plane = np.tile(np.linspace(30, 200, WIDTH, dtype=np.uint8), (HEIGHT, 1))
    chroma = np.full((HEIGHT // 2, WIDTH // 2), 128, dtype=np.uint8)
    with path.open("wb") as out:
        out.write(f"YUV4MPEG2 W{WIDTH} H{HEIGHT} F{FPS}:1 Ip A1:1 C420jpeg\n".encode())
        for i in range(FPS * SECONDS):
            y = y_plane.copy()
            x = (i * 7) % (WIDTH - 60)
            y[90:150, x : x + 60] = 250
            out.write(b"FRAME\n" + y.tobytes() + chroma.tobytes() + chroma.tobytes())


def write_wav(path: Path) -> None:
    """48 kHz mono: 0.5 s silence, 1.2 s of a voiced, modulated tone, 30 s silence (Chromium loops the file; the
    run is over before the second burst)."""
    rate = 48_000
    t = np.arange(int(1.2 * rate)) / rate
    voiced = np.sin(2 * np.pi * 180 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    voiced += 0.3 * np.sin(2 * np.pi * 360 * t) + 0.2 * np.sin(2 * np.pi * 720 * t)
    signal = np.concatenate([np.zeros(rate // 2), voiced * 0.4, np.zeros(30 * rate)])
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes((signal * 32767).astype("<i2").tobytes())


def main(out_dir: str) -> int:
    out = Path(out_dir)
    camera, microphone = out / "camera.y4m", out / "microphone.wav"
    write_y4m(camera)
    write_wav(microphone)
    settings = Settings(engine="synthetic", omni_model="preset:tiny", webrtc_host_addresses=(SERVER_ADDRESS,))
    with serve(settings) as server:
        page = server.http_url + "/static/video-chat.html"
        command = ["node", str(SCRIPT), page, out_dir, str(camera), str(microphone)]
        node = subprocess.run(command, timeout=NODE_TIMEOUT_S, check=False)
    return node.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
