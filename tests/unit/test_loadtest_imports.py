"""The load-test client installs without the server: it must not import torch or gateway, engine or model code."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import omnigate.loadtest.cli
import omnigate.loadtest.openai_standins
import omnigate.loadtest.targets.ws_speech
import omnigate.loadtest.targets.http_speech
import omnigate.loadtest.targets.realtime_webrtc
from omnigate.loadtest.targets import target_class
target_class("ws-speech"); target_class("http-speech"); target_class("realtime-webrtc")
forbidden = ("torch", "transformers", "onnxruntime", "omnigate.gateway", "omnigate.engines", "omnigate.sessions")
loaded = sorted(name for name in sys.modules if name.split(".")[0] in forbidden or name.startswith(forbidden))
print(",".join(loaded))
"""


def test_the_client_imports_no_server_or_model_code() -> None:
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == ""
