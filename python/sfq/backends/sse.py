"""A server-sent-events parser that is linear in the stream's size.

Bytes are appended to one ``bytearray``; the newline search resumes where the last one
stopped, so a line that arrives in many pieces is scanned once and copied once (a 32 MB
line in 64 KB pieces costs 32 MB of work, not 16 GB). Consumed bytes are dropped from the
front once per ``feed``. Only ``data:`` fields matter to an OpenAI stream; comments
(``:``), ``event:``, ``id:`` and ``retry:`` are skipped; lines may end in LF or CRLF; an
event's ``data`` lines are joined with ``\\n``; a blank line ends an event.
"""

from __future__ import annotations

__all__ = ["SSEParser", "DONE"]

#: the payload of OpenAI's end-of-stream event
DONE = b"[DONE]"


class SSEParser:
    """Feed bytes with ``feed``; it returns the payloads of the events completed so far."""

    __slots__ = ("_buf", "_scan", "_data", "bytes_seen")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._scan = 0  # the newline search resumes here (bytes before it hold no newline)
        self._data: list[bytes] = []  # data lines of the event being read
        self.bytes_seen = 0

    def feed(self, piece: bytes) -> list[bytes]:
        self.bytes_seen += len(piece)
        buf = self._buf
        buf += piece
        out: list[bytes] = []
        start = 0
        find = buf.find
        while True:
            nl = find(b"\n", self._scan)
            if nl < 0:
                self._scan = len(buf)
                break
            end = nl - 1 if nl > start and buf[nl - 1] == 0x0D else nl  # CRLF
            self._scan = nl + 1
            if end > start:
                if buf.startswith(b"data:", start):
                    skip = 6 if buf.startswith(b"data: ", start) else 5
                    self._data.append(bytes(buf[start + skip:end]))
                # comments, event:, id:, retry: carry nothing an OpenAI stream needs
            elif self._data:
                data = self._data
                out.append(data[0] if len(data) == 1 else b"\n".join(data))
                self._data = []
            start = nl + 1
        if start:
            del buf[:start]
            self._scan -= start
        return out

    @property
    def pending(self) -> int:
        """Bytes received but not yet part of a complete line."""
        return len(self._buf)
