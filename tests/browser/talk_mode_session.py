"""Run inside the browser test's network namespace: the LLM and transcription stand-ins, the gateway answering
through them (``--llm-url``/``--asr-url``), and Chromium holding a conversation on the page's talk mode.

Chromium's fake microphone plays a recorded user turn (the piper voice) followed by silence, in a loop; the
stand-ins answer with a short delay. Usage: python -m tests.browser.talk_mode_session OUT_DIR
"""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

import numpy as np

from omnigate.engines.piper import PiperEngine
from omnigate.gateway.settings import ResponderSettings, Settings
from omnigate.loadtest.targets.realtime import SPEECH_FILE, load_speech
from tests.serving import serve

SERVER_ADDRESS = "10.200.0.1"
SCRIPT = Path(__file__).with_name("talk_mode_page.mjs")
NODE_TIMEOUT_S = 120
TRANSCRIPT = "Could you book a table for two at eight tonight?"
REPLY = "Sure, a table for two at eight tonight."
SILENCE_S = 12.0  # after the turn: room for the reply before the recording loops


def microphone_file(path: Path, silence_s: float = SILENCE_S) -> None:
    """The recorded turn then ``silence_s`` of silence, as the 48 kHz 16-bit WAV Chromium's fake microphone plays."""
    speech = np.frombuffer(load_speech(SPEECH_FILE), dtype="<i2").astype(np.float64)
    upsampled = np.interp(np.arange(speech.size * 2) / 2.0, np.arange(speech.size), speech)
    pcm = np.concatenate([upsampled, np.zeros(int(48_000 * silence_s))]).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(48_000)
        out.writeframes(pcm.tobytes())


def main(out_dir: str) -> int:
    microphone = Path(out_dir) / "microphone.wav"
    microphone_file(microphone)
    command = [sys.executable, "-m", "omnigate.loadtest.cli", "standins", "--port", "0", "--asr-delay-ms", "50"]
    command += ["--llm-first-token-ms", "100", "--llm-tokens-per-s", "30"]
    for _ in range(8):
        command += ["--transcript", TRANSCRIPT, "--reply", REPLY]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as standins:
        assert standins.stdout is not None
        base = standins.stdout.readline().split()[2]
        try:
            responder = ResponderSettings(llm_url=base, asr_url=base)
            settings = Settings(webrtc_host_addresses=(SERVER_ADDRESS,), responder=responder)
            with serve(settings, engine=PiperEngine.load(None, workers=2)) as server:
                node = ["node", str(SCRIPT), server.http_url + "/", out_dir, str(microphone)]
                return subprocess.run(node, timeout=NODE_TIMEOUT_S, check=False).returncode
        finally:
            standins.terminate()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
