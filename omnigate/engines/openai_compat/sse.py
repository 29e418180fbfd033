"""Server-sent events as OpenAI-compatible chat servers send them (sans-I/O): bytes in, ``data`` payloads out.

Only ``data:`` fields matter to the chat API; comments (``:`` keep-alives), ``event:``, ``id:`` and ``retry:``
are skipped, and the lines of one event are joined with newlines as the SSE specification says. A line longer
than ``max_line_bytes`` is refused (a body that is not SSE would otherwise grow the buffer without end).
"""

from __future__ import annotations


class SseError(ValueError):
    """The byte stream is not server-sent events."""


class SseParser:
    """Feed bytes as they arrive; :meth:`feed` returns the ``data`` of every event completed by them."""

    def __init__(self, max_line_bytes: int = 1024 * 1024) -> None:
        self.max_line_bytes = max_line_bytes
        self._buffer = bytearray()
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            end = self._line_end()
            if end is None:
                break
            line_end, next_start = end
            line = bytes(self._buffer[:line_end])
            del self._buffer[:next_start]
            self._line(line, events)
        if len(self._buffer) > self.max_line_bytes:
            raise SseError(f"a line longer than {self.max_line_bytes} bytes")
        return events

    def close(self) -> list[str]:
        """The end of the stream: an event not yet ended by a blank line still counts."""
        events: list[str] = []
        if self._buffer:
            self._line(bytes(self._buffer), events)
            self._buffer.clear()
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line_end(self) -> tuple[int, int] | None:
        # Lines end with LF, CRLF or CR; a CR at the buffer's end may be half of a CRLF, so it waits for more.
        lf = self._buffer.find(b"\n")
        cr = self._buffer.find(b"\r", 0, lf if lf >= 0 else len(self._buffer))
        if cr < 0:
            return None if lf < 0 else (lf, lf + 1)
        if cr + 1 == len(self._buffer):
            return None
        return cr, cr + 2 if self._buffer[cr + 1] == 0x0A else cr + 1

    def _line(self, raw: bytes, events: list[str]) -> None:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SseError("a line that is not UTF-8") from exc
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
