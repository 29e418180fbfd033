"""Sending on a call's data channel without letting a peer that does not read hold events without bound."""

from __future__ import annotations

import asyncio
from typing import Literal

from aiortc import RTCDataChannel

# Control events are small; a peer with this much unacknowledged on the data channel is not reading.
CHANNEL_HIGH_WATER_BYTES = 256 * 1024
CHANNEL_LOW_WATER_BYTES = 64 * 1024
_CLOSE_FLUSH_S = 1.0

SendResult = Literal["sent", "closed", "stalled"]


class ChannelWriter:
    """Sends text on one data channel; waits (up to the stall timeout) while the peer is far behind."""

    def __init__(self, channel: RTCDataChannel, stall_timeout_s: float) -> None:
        self.channel = channel
        self.stall_timeout_s = stall_timeout_s
        self._drained = asyncio.Event()
        channel.bufferedAmountLowThreshold = CHANNEL_LOW_WATER_BYTES
        channel.on("bufferedamountlow", self._drained.set)

    async def send(self, text: str) -> SendResult:
        """Send ``text``: ``closed`` when the channel is gone, ``stalled`` when the peer stopped reading."""
        channel = self.channel
        if channel.readyState != "open":
            return "closed"
        if channel.bufferedAmount > CHANNEL_HIGH_WATER_BYTES:
            self._drained.clear()
            try:
                async with asyncio.timeout(self.stall_timeout_s):
                    await self._drained.wait()
            except TimeoutError:
                return "stalled"
            if channel.readyState != "open":
                return "closed"
        channel.send(text)
        return "sent"

    async def flush(self) -> None:
        """Give the last events a moment to leave before the connection closes."""
        channel = self.channel
        if channel.readyState != "open" or channel.bufferedAmount == 0:
            return
        channel.bufferedAmountLowThreshold = 0
        self._drained.clear()
        try:
            async with asyncio.timeout(_CLOSE_FLUSH_S):
                await self._drained.wait()
        except TimeoutError:
            pass
