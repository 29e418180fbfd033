"""A Pipecat pipeline that speaks through omnigate (``pip install 'omnigate[pipecat]'``, server: ``scripts/serve``).

In a bot, ``OmnigateTTSService`` takes the place of any TTS service, between the LLM and the output transport::

    Pipeline([transport.input(), stt, user_aggregator, llm, OmnigateTTSService(...), transport.output(), ...])

Without a transport, ``python examples/pipecat_pipeline.py reply.wav`` runs the service in Pipecat's own test
harness (``pipecat.tests.utils.run_test``): the frames an LLM sends for one reply (response start, the text token by
token, response end) go in, and the ``TTSAudioRawFrame``s that come out are written to a WAV file. ``--base-url``
and ``--voice`` pick the server and its voice.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import wave

from pipecat.frames.frames import (
    ErrorFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
)
from pipecat.pipeline.worker import PipelineParams
from pipecat.tests.utils import SleepFrame, run_test

from omnigate.integrations.pipecat import OmnigateTTSService

REPLY = "Hello from omnigate. Each sentence starts speaking as soon as it is complete, while the rest streams in."
SAMPLE_RATE = 24000


async def main(path: str, base_url: str, voice: str) -> int:
    tokens = re.findall(r"\s*\S+", REPLY)
    frames = [LLMFullResponseStartFrame()]
    for token in tokens:
        frames += [LLMTextFrame(token), SleepFrame(sleep=1 / 50)]  # the pace of a streaming LLM
    frames.append(LLMFullResponseEndFrame())
    down, up = await run_test(
        OmnigateTTSService(base_url=base_url, voice=voice),
        frames_to_send=frames,
        pipeline_params=PipelineParams(audio_out_sample_rate=SAMPLE_RATE),
    )
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    if errors:  # refused (a voice the server does not have, no free slot): say why and stop
        print(f"error: {errors[0].error}", file=sys.stderr)
        return 1
    with wave.open(path, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        for frame in down:
            if isinstance(frame, TTSAudioRawFrame):
                out.writeframes(frame.audio)
    print(f"{path}: the reply, 16-bit mono at {SAMPLE_RATE} Hz")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("wav")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--voice", default="alloy")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.wav, args.base_url, args.voice)))
