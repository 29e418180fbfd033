"""A LiveKit agent that speaks through omnigate (``pip install 'omnigate[livekit]'``, server: ``scripts/serve``).

In a LiveKit deployment the agent is ``entrypoint`` below: an ``AgentSession`` whose TTS is omnigate's streaming
WebSocket (your STT, LLM and VAD plugins beside it), started by LiveKit's worker CLI::

    python examples/livekit_agent.py start        # needs LIVEKIT_URL, LIVEKIT_API_KEY, LIVEKIT_API_SECRET

Without a LiveKit room, ``python examples/livekit_agent.py --offline reply.wav`` speaks a reply the way the
framework's ``Agent.tts_node`` would: tokens pushed into ``tts.stream()`` as an LLM streams them (50 tokens/s here),
frames read as they arrive, written to a WAV file. ``--base-url`` and ``--voice`` pick the server and its voice.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import wave

from livekit import agents
from livekit.agents import AgentSession, APIError

from omnigate.integrations.livekit import TTS

REPLY = "Hello from omnigate. Each sentence starts speaking as soon as it is complete, while the rest streams in."


async def entrypoint(ctx: agents.JobContext) -> None:
    """The agent of a LiveKit room: add your STT, LLM and VAD (for example ``livekit-plugins-openai``)."""
    await ctx.connect()
    session: AgentSession = AgentSession(tts=TTS(base_url="http://127.0.0.1:8000", voice="alloy"))
    await session.start(room=ctx.room, agent=agents.Agent(instructions="You are a helpful voice assistant."))
    await session.say(REPLY)


async def offline(path: str, base_url: str, voice: str) -> int:
    async with TTS(base_url=base_url, voice=voice) as tts, tts.stream() as stream:

        async def llm() -> None:
            for token in re.findall(r"\s*\S+", REPLY):
                stream.push_text(token)
                await asyncio.sleep(1 / 50)  # the pace of a streaming LLM
            stream.end_input()

        streaming = asyncio.create_task(llm())
        with wave.open(path, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(tts.sample_rate)
            try:
                async for event in stream:
                    out.writeframes(event.frame.data.tobytes())
            except APIError as exc:  # refused (a voice the server does not have, no free slot): say why and stop
                print(f"error: {exc}", file=sys.stderr)
                return 1
            finally:
                await streaming
    print(f"{path}: the reply, 16-bit mono at {tts.sample_rate} Hz")
    return 0


if __name__ == "__main__":
    if "--offline" in sys.argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("--offline", metavar="WAV", required=True)
        parser.add_argument("--base-url", default="http://127.0.0.1:8000")
        parser.add_argument("--voice", default="alloy")
        args = parser.parse_args()
        sys.exit(asyncio.run(offline(args.offline, args.base_url, args.voice)))
    agents.cli.run_app(agents.WorkerOptions(entrypoint_fnc=entrypoint))
