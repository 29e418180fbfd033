"""Run inside the browser test's network namespace: the gateway as ``serve`` starts it by default (the hibari voice,
the embedded speech recognizer and the embedded LLM, no other process), and Chromium holding a conversation on the
page's talk mode.

Chromium's fake microphone plays a recorded question followed by silence (the test mutes it once the question is
heard); pocketsphinx hears it, SmolLM2-135M-Instruct answers, hibari speaks the answer.
Usage: python -m tests.browser.talk_embedded_session OUT_DIR
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from omnigate.engines.hibari import HibariEngine
from omnigate.gateway.settings import ResponderSettings, Settings
from tests.browser.talk_mode_session import SCRIPT, SERVER_ADDRESS, microphone_file
from tests.serving import serve

MODEL_LOAD_S = 600.0
# after the question: room for it to be heard (the test then mutes the microphone until the answer has played)
SILENCE_S = 45.0
PAGE_WAIT_MS = 150_000  # for each of the page's waits: the answer is spoken whole before the page is quiet
NODE_TIMEOUT_S = 420  # the embedded LLM loads in the background: 15 s on idle cores, a minute on busy ones
# The answers' sampling seeds, the first answer's (over WebRTC), then counting up. Unseeded, SmolLM2-135M at the
# default temperature talks until its 512-token cap (a response ended "incomplete") in 7 of 256 answers, 5 of 32 to
# one of the transcripts pocketsphinx heard of this question; seeded 0 to 10, no answer to any of them reached it
# (docs/benchmarks/embedded_llm_lengths.json).
LLM_SEED = 1


def main(out_dir: str) -> int:
    microphone = Path(out_dir) / "microphone.wav"
    microphone_file(microphone, SILENCE_S)
    settings = Settings(
        webrtc_host_addresses=(SERVER_ADDRESS,), responder=ResponderSettings(embedded_llm=True, llm_seed=LLM_SEED)
    )
    with serve(settings, engine=HibariEngine.load(None)) as server:
        responder = server.app.state.realtime.responder
        assert responder.recognizer is not None and responder.llm is not None, "the embedded agent is off"
        # the conversation starts once the model is loaded: a turn before that waits only a bounded while
        assert responder.llm.wait_loaded(MODEL_LOAD_S) and responder.llm.ready, "the embedded LLM did not load"
        node = ["node", str(SCRIPT), server.http_url + "/", out_dir, str(microphone)]
        env = {**os.environ, "TALK_TIMEOUT_MS": str(PAGE_WAIT_MS)}
        return subprocess.run(node, timeout=NODE_TIMEOUT_S, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
