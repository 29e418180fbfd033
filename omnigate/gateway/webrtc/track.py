"""The outbound audio track of a call: pre-encoded 20 ms Opus packets, paced by the track's own clock.

aiortc's sender loops on :meth:`SpeechTrack.recv` and sends what it returns at once, so the track sets the clock:
one 20 ms packet per 20 ms of the loop's monotonic clock, pts counting 960 samples a packet. It returns
``av.Packet``s (aiortc then only packetizes them), so Opus encoding happens where the packets are made, in a worker
thread, not in aiortc's per-frame executor hop. When nothing is queued it sends silence. Packets carry their
session epoch; a packet whose epoch has been cancelled is never sent.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

import av
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av.stream import Stream

from omnigate.codecs.rtc_audio import RTC_FRAME_SAMPLES, RTC_SAMPLE_RATE, RTC_TIME_BASE, silence_packet

# The writer keeps this many packets queued ahead of the clock, to absorb a worker-thread encode and loop latency.
# It costs no latency (the first packet goes out at the next tick, and cancel drops the queue at once); the session
# outbox is made smaller by as much, so generated audio waiting to be heard stays within the configured bound.
DEFAULT_LEAD_FRAMES = 5
# A clock more than this late (a stalled loop) is moved forward instead of sending the missed packets in a burst.
MAX_LATE_S = 0.1


class SpeechTrack(MediaStreamTrack):
    """An audio track fed with encoded packets by the call's writer and read by aiortc's RTP sender."""

    kind = "audio"

    def __init__(self, current_epoch: Callable[[], int], lead_frames: int = DEFAULT_LEAD_FRAMES) -> None:
        super().__init__()
        self._current_epoch = current_epoch
        self.lead_frames = lead_frames
        self._packets: deque[tuple[int, bytes]] = deque()
        self._played_marks: deque[tuple[int, Callable[[], None]]] = deque()
        self._room = asyncio.Event()
        self._room.set()
        self._woken = False
        self._speaking_epoch: int | None = None
        self._start: float | None = None
        self._pts = 0
        self.frames_sent = 0
        self.audio_frames_sent = 0
        self.underrun_frames = 0
        self.skipped_frames = 0

    @property
    def queued_frames(self) -> int:
        return len(self._packets)

    def push(self, epoch: int, packets: Sequence[bytes]) -> None:
        """Queue packets of ``epoch`` (dropped at once if the epoch is already cancelled)."""
        if epoch < self._current_epoch():
            return
        self._packets.extend((epoch, packet) for packet in packets)
        self._speaking_epoch = epoch
        self._update_room()

    def end_utterance(self) -> None:
        """The utterance's last packet is queued: silence after it is the end, not an underrun."""
        self._speaking_epoch = None

    def on_played(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every packet queued now has been sent or dropped (from the track's clock)."""
        self._played_marks.append((self.audio_frames_sent + len(self._packets), callback))

    def wake(self) -> None:
        """From now on, let the writer go on without room (its session ended while the track may not be playing)."""
        self._woken = True
        self._room.set()

    async def wait_for_room(self) -> None:
        """Return once no more than the lead is queued."""
        while not (self._room.is_set() or self._woken):
            await self._room.wait()

    async def recv(self) -> av.Packet[Stream]:
        if self.readyState != "live":
            raise MediaStreamError
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._start is None:
            self._start = now
        else:
            self._pts += RTC_FRAME_SAMPLES
            due = self._start + self._pts / RTC_SAMPLE_RATE
            if now - due > MAX_LATE_S:
                missed = int((now - due) * RTC_SAMPLE_RATE) // RTC_FRAME_SAMPLES
                self._pts += missed * RTC_FRAME_SAMPLES
                self.skipped_frames += missed
                due += missed * RTC_FRAME_SAMPLES / RTC_SAMPLE_RATE
            if due > now:
                await asyncio.sleep(due - now)
        packet = av.Packet(self._next_payload())
        packet.pts = self._pts
        packet.time_base = RTC_TIME_BASE
        self.frames_sent += 1
        return packet

    def _next_payload(self) -> bytes:
        epoch = self._current_epoch()
        while self._packets and self._packets[0][0] < epoch:
            self._packets.popleft()
        if self._packets:
            payload = self._packets.popleft()[1]
            self.audio_frames_sent += 1
        else:
            payload = silence_packet()
            if self._speaking_epoch is not None and self._speaking_epoch >= epoch:
                self.underrun_frames += 1
        while self._played_marks and (self._played_marks[0][0] <= self.audio_frames_sent or not self._packets):
            self._played_marks.popleft()[1]()
        self._update_room()
        return payload

    def _update_room(self) -> None:
        if len(self._packets) <= self.lead_frames:
            self._room.set()
        else:
            self._room.clear()

    def stop(self) -> None:
        self._packets.clear()
        self._played_marks.clear()
        self.wake()
        super().stop()
