"""A server-sent-events parser that is linear in the stream's size.

Each piece of the stream is scanned once for newlines. A line that arrives in many pieces is
kept as the list of its pieces (no buffer that grows by copying: a 32 MB line in 64 KB pieces
costs 32 MB of work, not gigabytes); the pieces are joined once, when the line is complete,
and a large event (``Payload.size`` above a threshold the caller picks) can be joined and
decoded off the event loop (``Payload.join``). Only ``data:`` fields matter to an OpenAI
stream; comments (``:``), ``event:``, ``id:`` and ``retry:`` are skipped; lines may end in LF
or CRLF; an event's ``data`` lines are joined with ``\\n``; a blank line ends an event.

An event (or a line: a comment counts too) over ``max_event_bytes`` is not buffered to its
end: ``feed`` raises :class:`EventTooLarge` as soon as the bytes held for it pass the limit,
so a server that sends an endless line costs at most the limit and one piece.
"""

from __future__ import annotations

from ..errors import StreamInterrupted

__all__ = ["SSEParser", "Payload", "DONE", "EventTooLarge", "MAX_EVENT_BYTES", "payload_bytes"]

#: the payload of OpenAI's end-of-stream event
DONE = b"[DONE]"
#: the default largest event (or line), bytes
MAX_EVENT_BYTES = 64 << 20


class EventTooLarge(StreamInterrupted):
    """A server-sent event (or one line of the stream) is larger than the parser's
    ``max_event_bytes``: the stream is unusable (a ``StreamInterrupted`` that counts against
    the backend)."""


class Payload:
    """One event's data, still in pieces: ``join()`` makes the bytes (one copy)."""

    __slots__ = ("lines", "size")

    def __init__(self, lines: list[list[bytes]], size: int) -> None:
        self.lines = lines  # each data line as its pieces, the "data:" prefix and CR already cut
        self.size = size  # bytes of the joined payload

    def join(self) -> bytes:
        if len(self.lines) == 1:
            parts = self.lines[0]
            return parts[0] if len(parts) == 1 else b"".join(parts)
        return b"\n".join(b"".join(parts) for parts in self.lines)


def payload_bytes(p: bytes | Payload) -> bytes:
    """What :meth:`SSEParser.feed` returned for one event, as its bytes."""
    return p if isinstance(p, bytes) else p.join()


def _cut_prefix(parts: list[bytes]) -> tuple[list[bytes], int] | None:
    """The pieces of a ``data:`` line without its field name (and one space); ``None`` when the
    line is not a data line. Looks at the first bytes only. Also returns the bytes cut."""
    head = parts[0]
    i = 1
    while len(head) < 6 and i < len(parts):
        head += parts[i]
        i += 1
    if not head.startswith(b"data:"):
        return None
    skip = cut = 6 if head.startswith(b"data: ") else 5
    out: list[bytes] = []
    for p in parts:
        if skip >= len(p):
            skip -= len(p)
            continue
        out.append(p[skip:] if skip else p)
        skip = 0
    return (out or [b""]), cut


class SSEParser:
    """Feed bytes with ``feed``; it returns the payloads of the events completed so far.
    ``max_event_bytes``: the largest event (or line) held, bytes (``None``: no limit)."""

    __slots__ = ("_line", "_line_len", "_data", "_data_len", "bytes_seen", "max_event_bytes")

    def __init__(self, max_event_bytes: int | None = MAX_EVENT_BYTES) -> None:
        if max_event_bytes is not None and (isinstance(max_event_bytes, bool) or not isinstance(max_event_bytes, int)
                                            or max_event_bytes < 1):
            raise ValueError(f"max_event_bytes must be an integer >= 1 or None, got {max_event_bytes!r}")
        self.max_event_bytes = max_event_bytes
        self._line: list[bytes] = []  # pieces of the incomplete line
        self._line_len = 0
        self._data: list[list[bytes]] = []  # data lines of the event being read
        self._data_len = 0
        self.bytes_seen = 0

    def feed(self, piece: bytes) -> list[bytes | Payload]:
        """The events completed by ``piece``, in order: an event that came whole in it as one
        ``data:`` line as its payload's ``bytes`` (the common shape, with nothing to join), any
        other as a :class:`Payload`."""
        n = len(piece)
        self.bytes_seen += n
        if (n > 8 and piece.startswith(b"data: ") and piece.find(b"\n", 6) == n - 2 and piece[n - 1] == 10
                and piece[n - 3] != 13 and not self._line and not self._data
                and (self.max_event_bytes is None or n - 8 <= self.max_event_bytes)):
            return [piece[6:-2]]  # the piece is one whole event (a token's, most often)
        out: list[bytes | Payload] = []
        pos = 0
        find = piece.find
        limit = self.max_event_bytes
        while pos < n:
            if not self._line and not self._data and piece.startswith(b"data: ", pos):
                # the common shape, one event whole in this piece: "data: <payload>\n\n" (no CR,
                # one data line); anything else takes the general path below
                nl = find(b"\n", pos + 6)
                if nl > 0 and piece[nl + 1:nl + 2] == b"\n" and piece[nl - 1] != 13:
                    size = nl - pos - 6
                    if size and (limit is None or size <= limit):
                        out.append(piece[pos + 6:nl])
                        pos = nl + 2
                        continue
            nl = find(b"\n", pos)
            if nl < 0:
                self._line.append(piece[pos:] if pos else piece)
                self._line_len += n - pos
                if self.max_event_bytes is not None and self._line_len + self._data_len > self.max_event_bytes:
                    self._too_large()
                break
            if self._line:
                parts = self._line
                if nl > pos:
                    parts.append(piece[pos:nl])
                length = self._line_len + nl - pos
                self._line = []
                self._line_len = 0
            else:
                parts = [piece[pos:nl]]
                length = nl - pos
            pos = nl + 1
            if length and parts[-1].endswith(b"\r"):
                last = parts[-1][:-1]
                length -= 1
                if last:
                    parts[-1] = last
                else:
                    parts.pop()
            if length:
                data = _cut_prefix(parts)
                if data is not None:
                    self._data.append(data[0])
                    self._data_len += length - data[1] + (1 if len(self._data) > 1 else 0)
                    if self.max_event_bytes is not None and self._data_len > self.max_event_bytes:
                        self._too_large()
                # comments, event:, id:, retry: carry nothing an OpenAI stream needs
            elif self._data:
                out.append(Payload(self._data, self._data_len))
                self._data = []
                self._data_len = 0
        return out

    def _too_large(self) -> None:
        held = self._line_len + self._data_len
        self._line, self._data = [], []  # nothing more is held for it
        self._line_len = self._data_len = 0
        raise EventTooLarge(f"a server-sent event (or line) of the stream is over {self.max_event_bytes} bytes "
                            f"({held} bytes held when it was cut)", unhealthy=True)

    @property
    def pending(self) -> int:
        """Bytes of the incomplete line received so far."""
        return self._line_len
