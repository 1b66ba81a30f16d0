"""A pooled HTTP/1.1 client for one upstream origin, on asyncio transports, with ``httptools``
(llhttp) parsing the replies: what :class:`~sfq.backends.OpenAIBackend` sends its requests
with. (Its health checks and metrics fetches still use aiohttp: they are not on the path of
every request.)

Why not aiohttp's ``ClientSession`` here: per request it makes timeout handles, header
multidicts, request and response objects and a new response parser. This client writes a
request with one ``transport.write`` (a head made once per backend and endpoint, then
``Content-Length`` and the body), keeps one parser per connection, and its timers belong to the
connection, armed rarely (below).

**Connections.** Kept alive and reused last-in first-out (the warmest first); there is no
limit of its own (the dispatcher bounds what is in flight). A connection leaves the pool when
the server closes it (the protocol sees the end and forgets it), when a reply says
``Connection: close`` (or is HTTP/1.0, or ends with the connection), when it has been idle
``keepalive_timeout`` seconds (one sweep timer per pool, at the oldest idle connection's
expiry), or when something arrives on it while idle (a server says nothing on an idle
connection except before closing it).

**Replies.** Status and headers, then the body (``Content-Length``, chunked or until the
connection closes), read whole (:meth:`Reply.read`) or as it arrives (:meth:`Reply.take`,
pieces de-chunked). Back-pressure: past :data:`HIGH_WATER` bytes received and not taken, the
connection stops reading until the consumer takes what is held, so a slow consumer costs
bounded memory (the mark and one read). A reply read to its end with keep-alive gives its connection back; one
given up early (:meth:`Reply.close`, a cancelled caller, an error) aborts the connection, which
llama.cpp, vLLM and SGLang take as "stop generating". :meth:`Reply.release` says the caller has
what it wanted (a stream's ``data: [DONE]``): the connection returns to the pool once the
reply's last bytes (the chunked terminator) come, within :data:`DRAIN_SECONDS`, else it is
aborted.

**Timeouts** (every figure in seconds, ``None`` = no bound). One timer per connection does all
of them: armed at the earliest time anything can expire, and when it fires it looks at the
connection's current deadline and the time data last came, and either fails the request or
arms itself for the next possible expiry. So a request costs no timer handle of its own unless
its bound is shorter than the one already armed.

* ``connect_timeout``: to establish a connection (TCP, and TLS for ``https://``);
* ``silence`` (the backend's ``read_timeout``): the server quiet for that long while the client
  waits for it (before the head, and between two pieces of the body); time with reading paused
  by back-pressure does not count;
* a deadline per request (:meth:`HTTPPool.send`): absolute, on the loop's clock, and movable
  (:meth:`Reply.set_deadline`): a plain request's whole exchange, or a stream's head and then
  its whole length.

**When a request is written again** (:exc:`NotWritten`): only when it provably never left.
A connection taken from the pool is checked the moment before the request would be written:
closed or closing as the event loop knows it, or readable (``poll`` with no wait: an end of
file, a reset, or bytes the server sent unasked are waiting, which the loop has not handled
yet, on a connection where nothing was asked). Such a connection is aborted unwritten and the
caller gets :exc:`NotWritten`: the request can go out again on another connection with no
risk of a duplicate. A connection that closes *after* the request was written is never resent
by this module, even with no byte of a reply: a server that closed an idle connection just as
the request crossed it cannot be told from one that took the request and died (only the
caller's ``idempotent`` promise makes that resend safe; the caller decides).

Failures: :exc:`ConnectFailed` (refused, unreachable, TLS refused: nothing was sent),
:exc:`NotWritten`, :exc:`Disconnected` (the connection ended before the reply did),
:exc:`Timeout` (``kind`` says which bound), :exc:`ProtocolError` (not an HTTP/1.1 reply this
client reads, or a head over :data:`MAX_HEAD` bytes).
"""

from __future__ import annotations

import asyncio
import collections
import math
import select
import ssl as _ssl
from typing import Any, cast
from urllib.parse import quote, unquote, urlsplit

import httptools

__all__ = ["ConnectFailed", "Disconnected", "DRAIN_SECONDS", "HIGH_WATER", "HTTPPool", "MAX_HEAD", "NotWritten",
           "Origin", "ProtocolError", "Reply", "Timeout", "header_lines"]

#: bytes of a reply received and not yet taken past which the connection stops reading
HIGH_WATER = 256 << 10
#: the largest reply head (status line and headers) accepted, bytes
MAX_HEAD = 64 << 10
#: bytes that came with a reply's head past which only the head's own are kept (for its headers)
_HEAD_KEPT = 8 << 10
#: how long a released reply may take to send its last bytes before its connection is aborted
DRAIN_SECONDS = 1.0
#: the most body bytes a released reply may still send (more: the connection is aborted)
_DRAIN_BYTES = 64 << 10
_INF = math.inf
_POLL = getattr(select, "poll", None)
_POLLIN = getattr(select, "POLLIN", 1)

# connection states
_IDLE, _BUSY, _DRAINING, _DEAD = 0, 1, 2, 3


class ConnectFailed(OSError):
    """No connection could be made (refused, unreachable, TLS handshake refused): nothing was sent."""


class NotWritten(ConnectionResetError):
    """The pooled connection picked for the request was found closed before a byte of the
    request was written: the request provably never left, and may be written again."""


class Disconnected(ConnectionError):
    """The connection ended before the reply did (``got_reply``: whether any byte of a reply
    had come)."""

    def __init__(self, message: str, got_reply: bool = False) -> None:
        super().__init__(message)
        self.got_reply = got_reply


class Timeout(Exception):
    """A bound ran out: ``kind`` is ``"connect"``, ``"silence"`` or the deadline's own kind (the
    caller's word, given to :meth:`HTTPPool.send`); ``seconds`` the bound; ``never_sent``: it
    ran out before a connection was made. Not a ``TimeoutError``, so that a caller's own
    ``asyncio.timeout`` never mistakes it for its own."""

    def __init__(self, kind: str, seconds: float | None, message: str, never_sent: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.seconds = seconds
        self.never_sent = never_sent


class ProtocolError(Exception):
    """The server's reply is not HTTP/1.1 this client reads."""


def header_lines(headers: dict[str, str]) -> bytes:
    """``Name: value\\r\\n`` lines; ``ValueError`` naming a header that would break the head (a
    name that is not a token, a line break or NUL in a value, a value not in Latin-1)."""
    out = []
    for k, v in headers.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"header names and values must be strings, got {k!r}: {v!r}")
        if not k or any(ch in k for ch in ':\r\n \t"(),/;<=>?@[\\]{}') or not k.isascii() or not k.isprintable():
            raise ValueError(f"header name {k!r} is not an HTTP token")
        if any(ch in v for ch in "\r\n\0"):
            raise ValueError(f"the value of header {k!r} has a line break or NUL in it")
        try:
            v.encode("latin-1")
        except UnicodeEncodeError:
            raise ValueError(f"the value of header {k!r} is not Latin-1 text: {v!r}") from None
        out.append(f"{k}: {v.strip()}\r\n")
    return "".join(out).encode("latin-1")


def _head(raw: bytes) -> tuple[list[tuple[bytes, bytes]], int]:
    """The header fields of the reply head at the start of ``raw`` (after any 1xx heads), and
    where that head ends. The parser has already accepted these bytes (so the lines end in
    CRLF and the fields are well formed); a line folded onto the one before it is joined."""
    pos = 0
    while True:
        end = raw.find(b"\r\n\r\n", pos)
        if end < 0:
            return [], len(raw)
        lines = raw[pos:end].split(b"\r\n")
        status = lines[0].split(None, 2)
        pos = end + 4
        if len(status) > 1 and status[1][:1] == b"1" and status[1] != b"101":
            continue  # an interim head
        fields: list[tuple[bytes, bytes]] = []
        for line in lines[1:]:
            if line[:1] in (b" ", b"\t") and fields:
                n, v = fields[-1]
                fields[-1] = (n, (v + b" " + line.strip()).strip())
                continue
            name, _, value = line.partition(b":")
            fields.append((name.strip(), value.strip()))
        return fields, pos


class _Conn(asyncio.Protocol):
    """One connection, its reply parser and its timer; one request at a time.

    A reply costs two Python calls from the parser (the head's end and the reply's end), not
    one per header and per piece: headers are not handed over one by one (the bytes the head
    came in are kept, ``head_raw``, and read only when asked: an error's headers, a
    ``Retry-After``), and two callbacks are C methods of the connection's own containers:
    ``on_body`` appends to ``pieces``, ``on_message_begin`` empties ``ended`` (a list that the
    end of a reply fills: emptied again, another reply began after it)."""

    __slots__ = ("pool", "loop", "transport", "parser", "poller", "state", "pooled", "exc", "waiter", "head_raw",
                 "head_bytes", "head_done", "interim", "complete", "ended", "extra", "got_reply", "pieces",
                 "buffered", "paused", "keep", "idle_since", "deadline", "deadline_kind", "deadline_s", "silence",
                 "last", "timer", "timer_at", "drained", "on_body", "on_message_begin")

    def __init__(self, pool: HTTPPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.head_raw: list[bytes] = []  # what came until the head was complete (the head, and maybe more)
        self.pieces: collections.deque[bytes] = collections.deque()
        self.ended: list[None] = []
        self.on_body = self.pieces.append
        self.on_message_begin = self.ended.clear
        self.parser = httptools.HttpResponseParser(self)
        self.poller: Any = None
        self.state = _BUSY  # made for a request
        self.pooled = False  # in the pool's idle list
        self.exc: BaseException | None = None  # why the reply failed
        self.waiter: asyncio.Future[None] | None = None
        self.head_bytes = 0  # bytes received until the head was complete (a bound on what is held for it)
        self.head_done = False
        self.interim = False  # the head being parsed is a 1xx
        self.complete = False
        self.extra = False  # bytes after the reply's end: the connection cannot be reused
        self.got_reply = False
        self.buffered = 0  # bytes received and not taken (framing included: a bound, not a count)
        self.paused = False
        self.keep = False
        self.idle_since = 0.0
        self.deadline = _INF
        self.deadline_kind = ""
        self.deadline_s: float | None = None
        self.silence: float | None = None
        self.last = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = _INF
        self.drained = 0

    # ------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's are not asyncio.Transport subclasses)
        self.pool._conns.add(self)
        if _POLL is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    p = _POLL()
                    p.register(sock.fileno(), _POLLIN)
                    self.poller = p
                except (OSError, ValueError):
                    self.poller = None

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state != _BUSY and state != _DRAINING or self.complete:
            # bytes nobody asked for (on an idle connection, or after the reply's end): the
            # connection is finished
            self.extra = True
            self.abort()
            return
        self.got_reply = True
        if self.silence is not None:
            self.last = self.loop.time()
        n = len(data)
        if not self.head_done:
            self.head_raw.append(data)
            self.head_bytes += n
        self.buffered += n
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ProtocolError("the server switched protocols (an HTTP upgrade)"))
            return
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, ProtocolError) else
                       ProtocolError(f"the reply is not HTTP/1.1: {exc}"))
            return
        if self.complete and not self.ended:  # another reply began after this one
            self.extra = True
        if not self.head_done and self.head_bytes > MAX_HEAD:  # no head yet, and more than one may be
            self._fail(ProtocolError(f"the reply's head is over {MAX_HEAD} bytes"))
            return
        if state == _DRAINING:
            self.pieces.clear()  # a released reply's rest is not wanted
            self.drained += n
            if self.drained > _DRAIN_BYTES:
                self.abort()
            elif self.complete:
                self.release()
            return
        if self.buffered > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def eof_received(self) -> bool | None:
        self._ended(None)
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(exc)

    # ------------------------------------------------------------ httptools callbacks
    # (on_message_begin, on_body: the C methods set in __init__)
    def on_headers_complete(self) -> None:
        if self.complete:
            raise ProtocolError("the server sent more than one reply")
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue, 103 Early Hints: not the reply
            if status == 101:
                raise ProtocolError("the server switched protocols (101)")
            self.interim = True
            return
        if self.head_bytes > _HEAD_KEPT:  # much came with the head: keep the head's bytes alone
            raw = b"".join(self.head_raw)
            end = _head(raw)[1]
            if end > MAX_HEAD:
                raise ProtocolError(f"the reply's head is over {MAX_HEAD} bytes")
            self.head_raw = [raw[:end]]
        self.head_done = True

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self.keep = self.parser.should_keep_alive()
        self.ended.append(None)

    # ------------------------------------------------------------ ending
    def _ended(self, exc: Exception | None) -> None:
        """The server ended the connection (end of file, reset): a reply being read either ends
        here (a body delimited by the connection's end) or fails."""
        if self.state == _DEAD:
            return
        if self.state == _BUSY and not self.complete and self.exc is None:
            if self.head_done and exc is None and self._until_close():
                self.complete = True  # the body ran to the connection's end
                self.keep = False
            else:
                where = ("before replying" if not self.got_reply else
                         "in the middle of the reply's head" if not self.head_done else "before the reply's end")
                why = f" ({exc})" if exc is not None else ""
                self.exc = Disconnected(f"the server closed the connection {where}{why}", self.got_reply)
        self._gone()

    def _gone(self) -> None:
        """Out of the pool, the timer stopped, the reader woken."""
        pool = self.pool
        if self.pooled:
            self.pooled = False
            try:
                pool._idle.remove(self)
            except ValueError:
                pass
        pool._conns.discard(self)
        self.state = _DEAD
        t = self.timer
        if t is not None:
            t.cancel()
            self.timer = None
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def _until_close(self) -> bool:
        """Whether the reply's body is delimited by the end of the connection (neither a length
        nor chunked)."""
        for n, v in self.fields():
            ln = n.lower()
            if ln == b"content-length" or (ln == b"transfer-encoding" and b"chunked" in v.lower()):
                return False
        return True

    def fields(self) -> list[tuple[bytes, bytes]]:
        """The reply's header fields (read from the bytes of its head: only when asked)."""
        return _head(b"".join(self.head_raw))[0] if self.head_done else []

    def _fail(self, exc: BaseException) -> None:
        """The reply cannot go on: ``exc`` for its reader (a reply already complete keeps its
        body), the connection aborted."""
        if not self.complete and self.exc is None:
            self.exc = exc
            if isinstance(exc, Timeout):
                self.pieces.clear()  # a bound that ran out ends the reply now
                self.buffered = 0
        self.abort()

    def abort(self) -> None:
        """Drop the connection at once (a reset: the server stops what it was doing for it)."""
        if self.state == _DEAD:
            return
        if self.state == _BUSY and not self.complete and self.exc is None:
            self.exc = Disconnected("the connection was closed by the client", self.got_reply)
        self._gone()
        t = self.transport
        if t is not None:
            t.abort()

    # ------------------------------------------------------------ timers
    def arm(self, due: float) -> None:
        """Make sure the timer fires no later than ``due`` (a timer due earlier stays)."""
        t = self.timer
        if t is not None:
            if self.timer_at <= due:
                return
            t.cancel()
        self.timer_at = due
        self.timer = self.loop.call_at(due, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        self.timer_at = _INF
        state = self.state
        if state != _BUSY and state != _DRAINING:
            return
        now = self.loop.time()
        if now + 0.001 >= self.deadline:  # (timers may run up to a clock tick early)
            if state == _DRAINING:
                self.abort()
                return
            s = self.deadline_s
            self._fail(Timeout(self.deadline_kind, s, f"the {self.deadline_kind} bound"
                               + (f" of {s:g} s" if s is not None else "") + " ran out"))
            return
        due = self.deadline
        silence = self.silence
        if silence is not None and state == _BUSY and not self.complete:
            if self.paused:
                self.last = now  # time spent paused by back-pressure is not the server's silence
            quiet = self.last + silence
            if now + 0.001 >= quiet:
                self._fail(Timeout("silence", silence, f"the server sent nothing for {silence:g} s"))
                return
            if quiet < due:
                due = quiet
        if due < _INF:
            self.arm(due)

    # ------------------------------------------------------------ requests
    def begin(self, data: bytes, deadline: float, kind: str, seconds: float | None, silence: float | None,
              now: float) -> None:
        """Write a request (the connection fresh, or back from the pool: ready for another reply;
        the parser carries over, llhttp reads one reply after another)."""
        if self.complete:  # reused
            self.head_raw = []
            self.head_bytes = 0
            self.head_done = False
            self.complete = False
            self.got_reply = False
            self.keep = False
            self.drained = 0
            self.buffered = 0
        self.state = _BUSY
        self.deadline = deadline
        self.deadline_kind = kind
        self.deadline_s = seconds
        self.silence = silence
        self.last = now
        due = deadline if silence is None or now + silence > deadline else now + silence
        if due < _INF:
            self.arm(due)
        self.transport.write(data)  # type: ignore[union-attr]

    async def wait(self) -> None:
        fut = self.waiter = self.loop.create_future()
        await fut

    def keep_possible(self) -> bool:
        """Whether the reply being read can still end with the connection kept."""
        return not self.extra and bool(self.parser.should_keep_alive())

    def release(self) -> None:
        """The reply is done with: to the pool when it ended with keep-alive, else closed."""
        if self.state == _DEAD:
            return
        if self.complete and self.exc is None and not self.pieces and not self.extra:
            if self.keep and not self.pool.closed:
                self.pool._give_back(self)
                return
            self._gone()
            self.transport.close()  # type: ignore[union-attr]  # the reply ended: a clean close
            return
        self.abort()


class Reply:
    """One reply: ``status``, its headers (:meth:`header`, :meth:`header_items`) once its head
    has come, its body by :meth:`read` or :meth:`take`."""

    __slots__ = ("status", "_c", "_done")

    def __init__(self, conn: _Conn) -> None:
        self._c = conn
        self.status: int = conn.parser.get_status_code()
        self._done = False

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (any case; the last one of a repeated name), or ``None``."""
        want = name.lower().encode("latin-1")
        found = None
        for n, v in self._c.fields():
            if n.lower() == want:
                found = v
        return None if found is None else found.decode("latin-1")

    def header_items(self) -> list[tuple[str, str]]:
        """The headers as received (names as the server spelled them, repeated ones each)."""
        return [(n.decode("latin-1"), v.decode("latin-1")) for n, v in self._c.fields()]

    def take(self) -> bytes | None:
        """What has come of the body and not been taken yet, in one piece: ``b""`` when nothing
        is waiting (then :meth:`more`), ``None`` at its end (the connection then goes back to
        the pool, or is closed). Raises the reply's failure (:exc:`Disconnected`,
        :exc:`Timeout`, :exc:`ProtocolError`) once what came before it has been taken."""
        c = self._c
        pieces = c.pieces
        if pieces:
            if len(pieces) == 1:
                out = pieces.popleft()
            else:
                out = b"".join(pieces)
                pieces.clear()
            c.buffered = 0
            if c.paused:
                c.paused = False
                if c.state == _BUSY:
                    c.last = c.loop.time()
                    c.transport.resume_reading()  # type: ignore[union-attr]
            return out
        if c.complete:
            if not self._done:
                self._done = True
                c.release()
            return None
        if c.exc is not None:
            self._done = True
            raise c.exc
        if c.state == _DEAD:  # aborted from outside (the pool closed)
            self._done = True
            raise Disconnected("the connection was closed by the client", c.got_reply)
        return b""

    async def more(self) -> None:
        """Wait until :meth:`take` has something to say."""
        c = self._c
        if not c.pieces and not c.complete and c.exc is None and c.state != _DEAD:
            try:
                fut = c.waiter = c.loop.create_future()  # (c.wait(), without its frame)
                await fut
            except BaseException:
                self.close()
                raise

    def body(self) -> bytes | None:
        """The whole body when it has all come (then the connection goes back to the pool, or
        is closed), else ``None`` (then :meth:`read`)."""
        c = self._c
        if c.complete and not self._done:
            pieces = c.pieces
            n = len(pieces)
            out = pieces.popleft() if n == 1 else b"".join(pieces)
            if n > 1:
                pieces.clear()
            c.buffered = 0
            self._done = True
            c.release()
            return out
        return None

    async def read(self) -> bytes:
        """The whole body (then the connection goes back to the pool, or is closed); any failure
        (or the caller's cancellation) aborts the connection."""
        c = self._c
        if c.complete and len(c.pieces) <= 1:  # the common case: it all came with the head
            out = c.pieces.popleft() if c.pieces else b""
            c.buffered = 0
            self._done = True
            c.release()
            return out
        parts = []
        try:
            while True:
                piece = self.take()
                if piece is None:
                    break
                if piece:
                    parts.append(piece)
                else:
                    await c.wait()
        except BaseException:
            self.close()
            raise
        return b"".join(parts)

    async def read_some(self, limit: int) -> bytes:
        """The body's first ``limit`` bytes or more (all of it when shorter); the connection is
        released when the body ended within them, aborted otherwise."""
        parts = []
        got = 0
        try:
            while got < limit:
                piece = self.take()
                if piece is None:
                    break
                if piece:
                    parts.append(piece)
                    got += len(piece)
                else:
                    await self._c.wait()
        finally:
            if not self._done:
                self.close()
        return b"".join(parts)

    def set_deadline(self, deadline: float, kind: str, seconds: float | None) -> None:
        """Bound the rest of the reply by ``deadline`` (the loop's clock), named ``kind``."""
        c = self._c
        c.deadline = deadline
        c.deadline_kind = kind
        c.deadline_s = seconds
        if deadline < _INF and c.state == _BUSY:
            c.arm(deadline)

    def release(self) -> None:
        """The caller has what it wanted of the reply: its connection goes back to the pool
        once the reply's last bytes come (within :data:`DRAIN_SECONDS`; aborted otherwise), and
        is aborted when the body had more than framing left in it."""
        if self._done:
            return
        self._done = True
        c = self._c
        if c.state != _BUSY:
            return
        if c.complete or c.exc is not None:
            c.release()
            return
        if c.pieces or not c.keep_possible():
            c.abort()
            return
        c.state = _DRAINING
        c.deadline = c.loop.time() + DRAIN_SECONDS
        if c.paused:
            c.paused = False
            c.transport.resume_reading()  # type: ignore[union-attr]
        c.arm(c.deadline)

    def close(self) -> None:
        """Done with the reply whatever is left of it: when it had not ended, the connection is
        aborted (the server sees the client leave)."""
        if self._done:
            return
        self._done = True
        c = self._c
        if c.complete and c.exc is None and not c.pieces:
            c.release()
        else:
            c.abort()


class Origin:
    """Where requests go, from a URL: ``scheme``, ``host`` (an IPv6 literal without brackets),
    ``port``, ``authority`` (what a ``Host`` header says), ``path`` (the URL's path, no
    trailing slash, percent-encoded where it was not) and ``credentials`` (``(user, password)``
    from ``http://user:password@host``, or ``None``). ``ValueError`` for a URL that is not
    ``http://`` or ``https://`` with a host."""

    __slots__ = ("scheme", "host", "port", "authority", "path", "credentials")

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"url must be an http:// or https:// URL with a host, got {url!r}")
        try:
            port = u.port
        except ValueError:
            raise ValueError(f"url {url!r} has an invalid port") from None
        self.scheme: str = u.scheme
        self.host: str = u.hostname
        self.port: int = port or (443 if u.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.authority: str = host if self.port == (443 if u.scheme == "https" else 80) else f"{host}:{self.port}"
        self.path: str = quote(u.path.rstrip("/"), safe="/%:@!$&'()*+,;=-._~")
        self.credentials: tuple[str, str] | None = None
        if u.username is not None:
            self.credentials = (unquote(u.username), unquote(u.password or ""))


class HTTPPool:
    """Kept-alive connections to one origin (:class:`Origin`, or its URL: ``http://host[:port]``,
    ``https://...``, an IPv6 literal in brackets). ``ssl_context``: for ``https://`` (default
    ``ssl.create_default_context()``: the system's CAs, the host name checked). Bound to the
    running event loop it is made on (make it in a coroutine)."""

    def __init__(self, origin: Origin | str, *, connect_timeout: float | None, keepalive_timeout: float,
                 ssl_context: _ssl.SSLContext | None = None) -> None:
        o = origin if isinstance(origin, Origin) else Origin(origin)
        self.host = o.host
        self.port = o.port
        self.authority = o.authority
        self.ssl: _ssl.SSLContext | None = None
        if o.scheme == "https":
            self.ssl = ssl_context if ssl_context is not None else _ssl.create_default_context()
        self.connect_timeout = connect_timeout
        self.keepalive_timeout = float(keepalive_timeout)
        self.loop = asyncio.get_running_loop()
        self._idle: list[_Conn] = []  # oldest first; taken from the end
        self._conns: set[_Conn] = set()  # every open connection, idle or not
        self._sweeper: asyncio.TimerHandle | None = None
        self.closed = False
        self.connects = 0  # connections made

    # ------------------------------------------------------------ requests
    async def send(self, data: bytes, *, deadline: float = _INF, kind: str = "request", seconds: float | None = None,
                   silence: float | None = None) -> Reply:
        """Write ``data`` (a whole request: head and body) on a pooled connection (or a new one)
        and wait for the reply's head. ``deadline`` (the loop's clock) bounds the exchange
        until the reply is read (``kind``, ``seconds``: how a :exc:`Timeout` names it);
        ``silence``: the longest the server may stay quiet. Raises :exc:`NotWritten` when the
        pooled connection taken was found closed before anything was written."""
        if self.closed:
            raise Disconnected("the client is closed")
        loop = self.loop
        now = loop.time()
        conn: _Conn | None = None
        idle = self._idle
        if idle:
            conn = idle.pop()
            conn.pooled = False
            if conn.state != _IDLE or now - conn.idle_since >= self.keepalive_timeout:  # expired: so is every other
                conn.abort()
                self._close_idle()
                conn = None
            else:
                t = conn.transport
                stale = t is None or t.is_closing()
                if not stale and conn.poller is not None:
                    try:
                        stale = bool(conn.poller.poll(0))
                    except (OSError, ValueError):
                        stale = True
                if stale:
                    conn.abort()
                    raise NotWritten(f"the kept-alive connection to {self.authority} was closed by the server "
                                     "before the request was written")
        if conn is None:
            conn = await self._connect(deadline, kind, seconds)
            now = loop.time()
        try:
            conn.begin(data, deadline, kind, seconds, silence, now)
            while not conn.head_done:
                exc = conn.exc
                if exc is not None:
                    raise exc
                if conn.state == _DEAD:
                    raise Disconnected("the connection was closed by the client", conn.got_reply)
                fut = conn.waiter = loop.create_future()
                await fut
        except BaseException:
            conn.abort()
            raise
        return Reply(conn)

    async def _connect(self, deadline: float, kind: str, seconds: float | None) -> _Conn:
        loop = self.loop
        limit = self.connect_timeout
        by_deadline = False
        if deadline < _INF:
            left = deadline - loop.time()
            if limit is None or left < limit:
                limit, by_deadline = max(left, 0.0), True
        coro = loop.create_connection(lambda: _Conn(self), self.host, self.port, ssl=self.ssl,
                                      server_hostname=self.host if self.ssl is not None else None)
        try:
            if limit is None:
                _, proto = await coro
            else:
                _, proto = await asyncio.wait_for(coro, limit)
        except asyncio.TimeoutError:
            if by_deadline:
                raise Timeout(kind, seconds, f"no connection to {self.authority} before the {kind} bound"
                              + (f" of {seconds:g} s" if seconds is not None else "") + " ran out", True) from None
            raise Timeout("connect", self.connect_timeout,
                          f"no connection to {self.authority} within {self.connect_timeout:g} s", True) from None
        except (OSError, UnicodeError) as exc:  # refused, unreachable, no such host, TLS refused
            raise ConnectFailed(f"cannot connect to {self.authority}: {exc}") from exc
        assert isinstance(proto, _Conn)
        self.connects += 1
        if self.closed:
            proto.abort()
            raise Disconnected("the client is closed")
        return proto

    # ------------------------------------------------------------ the pool
    def _give_back(self, c: _Conn) -> None:
        c.state = _IDLE
        c.pooled = True
        c.idle_since = self.loop.time()
        self._idle.append(c)
        if self._sweeper is None:
            self._sweeper = self.loop.call_at(c.idle_since + self.keepalive_timeout, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for ``keepalive_timeout``; again at the next one's expiry."""
        self._sweeper = None
        idle = self._idle
        cutoff = self.loop.time() + 0.001 - self.keepalive_timeout
        n = 0
        while n < len(idle) and idle[n].idle_since <= cutoff:
            n += 1
        if n:
            old = idle[:n]
            del idle[:n]
            for c in old:
                c.pooled = False
                c.abort()
        if idle:
            self._sweeper = self.loop.call_at(idle[0].idle_since + self.keepalive_timeout, self._sweep)

    def _close_idle(self) -> None:
        idle = self._idle[:]
        self._idle.clear()
        for c in idle:
            c.pooled = False
            c.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    @property
    def idle(self) -> int:
        """Connections waiting in the pool."""
        return len(self._idle)

    @property
    def open(self) -> int:
        """Connections open, idle or busy."""
        return len(self._conns)

    def close(self) -> None:
        """Abort every connection, idle or busy (a request on one fails with :exc:`Disconnected`)."""
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._close_idle()
        for c in list(self._conns):
            c.abort()
        self._conns.clear()
