"""The access log's writer: lines appended to a buffer in memory, written off the request's path.

``sfq serve`` writes one line per model request (``Gateway._log``). Going through
:mod:`logging` for each (a ``LogRecord``, the handler's lock, a flushed write) costs a request
more than its line is worth; :class:`AccessLog` takes the line's bytes instead and:

* appends them to a buffer; the first line of an event-loop iteration schedules one write
  (``loop.call_soon``), so every line of that iteration goes out in one system call, and the
  buffer is also written as soon as it passes ``FLUSH_BYTES``;
* never blocks the event loop on a reader that stops reading. When stdout (or the log file)
  is a pipe, a FIFO or a terminal, the writer opens its own non-blocking description of it
  (``/proc/self/fd/N``: the process's stdout keeps its flags, so a shell sharing the terminal
  is not affected); a stream socket (journald's stdout) is written with ``MSG_DONTWAIT``. A
  write that would block waits for the file to be writable (``loop.add_writer``) while lines go
  on accumulating; past ``MAX_BUFFER_BYTES`` new lines are dropped, counted, and reported on
  the diagnostics logger (``sfq.serve``) at most once per second, so memory stays bounded.
  A regular file is written directly (its writes do not wait on anyone). Where no
  non-blocking description can be had (no ``/proc``), the writes are blocking, as a
  ``logging.StreamHandler``'s are;
* is flushed, waiting for the reader, when ``sfq serve`` shuts down and at process exit
  (``logging.shutdown`` flushes every handler): a graceful shutdown loses no line unless the
  reader makes no progress for ``CLOSE_TIMEOUT`` seconds (then the rest is dropped, and said
  so on stderr).

Several processes writing one log (``sfq serve --workers N``: each worker has its own writer
on the same stdout or the same file): every write holds whole lines, so no line is split by
another process's, as long as the system writes each ``write()`` whole and in one place:

* a regular file (``--access-log FILE``, opened ``O_APPEND`` by each worker, or stdout
  redirected to a file, whose offset the workers share): one ``write()`` per batch. Linux
  puts each ``write()`` to a local file at the end as one piece (the file's lock is held for
  the whole write; a shared offset moves under its own lock since Linux 3.14). A short write
  happens only when the disk is full (the rest of the line may then land after another
  process's lines); NFS gives no such promise.
* a pipe, a FIFO, a terminal or a stream socket (``shared=True``): each ``write()`` is at
  most ``PIPE_BUF`` bytes (4096 on Linux) and ends at a line's end. POSIX makes a write of at
  most ``PIPE_BUF`` bytes to a pipe atomic, and non-blocking it is written whole or not at all
  (``EAGAIN``); a Unix stream socket (journald's stdout) queues such a write as one buffer.
  A single line longer than ``PIPE_BUF`` is written alone and could be split; the gateway's
  lines are far shorter (the one field a client sets freely, ``model``, is cut to 256
  characters in the log).

Lines written from a thread that runs no event loop (another library logging on
``sfq.serve.access``) are handed to the loop that owns the writer, or written at once when
there is none.

:class:`AccessLogHandler` is the ``logging.Handler`` that ``configure_logging`` installs on the
access logger: records logged there the ordinary way go through the same buffer. The gateway
skips :mod:`logging` only while that handler is the logger's one handler (:func:`direct`); a
logger an embedder configured with handlers of its own gets ordinary records, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import select
import socket
import stat
import sys
import threading
import time
from typing import TextIO

__all__ = ["AccessLog", "AccessLogHandler", "direct", "open_access_log", "FLUSH_BYTES", "MAX_BUFFER_BYTES",
           "CLOSE_TIMEOUT", "PIPE_BUF"]

#: bytes: the buffer is written as soon as it holds this much, without waiting for the loop
FLUSH_BYTES = 64 << 10
#: bytes: past this much unwritten, new lines are dropped (and counted) instead of buffered
MAX_BUFFER_BYTES = 8 << 20
#: seconds without progress after which the final flush gives up on a reader that does not read
CLOSE_TIMEOUT = 10.0
#: seconds between two warnings about dropped lines
WARN_EVERY = 1.0
#: bytes: the most one write of a shared pipe, terminal or socket holds (what POSIX writes atomically to a pipe)
PIPE_BUF: int = getattr(select, "PIPE_BUF", 512)

log = logging.getLogger("sfq.serve")
_get_running_loop = asyncio._get_running_loop


class _Sink:
    """Where the bytes go: ``write(data)`` returns how many were taken, raises
    ``BlockingIOError`` when none can be now (a non-blocking sink), ``OSError`` when the file
    is gone. ``fd``: what to wait on for writability (``None``: nothing to wait on)."""

    fd: int | None = None
    name = "?"
    #: a regular file (or a block device): no write of it waits on a reader
    regular = False

    # (the buffer itself is passed: only the loop's thread appends to it without the writer's
    # lock, and that thread is the one writing; other threads append under the lock)
    def write(self, data: bytes | bytearray) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        pass


class _FdSink(_Sink):
    def __init__(self, fd: int, name: str, *, owned: bool, regular: bool = False) -> None:
        self.fd = fd
        self.name = name
        self.owned = owned
        self.regular = regular

    def write(self, data: bytes | bytearray) -> int:
        assert self.fd is not None
        return os.write(self.fd, data)

    def close(self) -> None:
        if self.owned and self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


class _SocketSink(_Sink):
    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.name = name

    def write(self, data: bytes | bytearray) -> int:
        return self.sock.send(data, socket.MSG_DONTWAIT)

    def close(self) -> None:
        self.sock.close()
        self.fd = None


class _StreamSink(_Sink):
    """A text stream without a file descriptor (a ``StringIO``, a test's capture): written and
    flushed as ``logging.StreamHandler`` does."""

    def __init__(self, stream: TextIO, name: str) -> None:
        self.stream = stream
        self.name = name

    def write(self, data: bytes | bytearray) -> int:
        self.stream.write(data.decode("utf-8", "replace"))
        self.stream.flush()
        return len(data)


def _sink_of_fd(fd: int, name: str, *, owned: bool) -> _Sink:
    """A sink for an open descriptor: as it is for a regular file; a descriptor of its own,
    non-blocking, for a pipe, FIFO or terminal; ``MSG_DONTWAIT`` sends for a stream socket."""
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode) or stat.S_ISBLK(mode):
        return _FdSink(fd, name, owned=owned, regular=True)
    if stat.S_ISSOCK(mode):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return _FdSink(fd, name, owned=owned)
        if sock.type != socket.SOCK_STREAM:  # a datagram socket: one write per line would be needed
            os.close(sock.detach())
            return _FdSink(fd, name, owned=owned)
        if owned:
            os.close(fd)
        return _SocketSink(sock, name)
    try:  # a new open file description of the same pipe or device: its O_NONBLOCK is ours alone
        own = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:  # no /proc: blocking writes (a reader that stops reading stops the loop)
        return _FdSink(fd, name, owned=owned)
    if owned:
        os.close(fd)
    return _FdSink(own, name, owned=True)


def _check_sizes(max_buffer: int, flush_bytes: int) -> None:
    for name, v in (("max_buffer", max_buffer), ("flush_bytes", flush_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1 (bytes), got {v!r}")


def open_access_log(target: str, *, max_buffer: int = MAX_BUFFER_BYTES, flush_bytes: int = FLUSH_BYTES,
                    shared: bool = False) -> AccessLog:
    """The writer for ``target``: ``-`` (stdout) or a file's path (appended to, created with
    mode 0666 less the umask, as ``logging.FileHandler`` does). Raises ``OSError`` when the
    file cannot be opened. ``max_buffer``, ``flush_bytes``: :class:`AccessLog`'s. ``shared``:
    other processes write lines to the same pipe, terminal or socket (``sfq serve --workers``):
    each write is then at most ``PIPE_BUF`` bytes of whole lines (see the module's docstring)."""
    _check_sizes(max_buffer, flush_bytes)
    if target == "-":
        stream = sys.stdout if sys.stdout is not None else sys.stderr
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return AccessLog(_StreamSink(stream, "<stdout>"), max_buffer=max_buffer, flush_bytes=flush_bytes)
        with contextlib.suppress(OSError, ValueError):
            stream.flush()  # what it holds goes first
        sink = _sink_of_fd(fd, "<stdout>", owned=False)
    else:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)
        try:
            sink = _sink_of_fd(fd, target, owned=True)
        except BaseException:
            os.close(fd)
            raise
    return AccessLog(sink, max_buffer=max_buffer, flush_bytes=flush_bytes,
                     chunk=PIPE_BUF if shared and not sink.regular else None)


class AccessLog:
    """A buffer of lines (bytes, each ending in a newline) and the sink they are written to.

    :meth:`write` is for the thread of the event loop that runs the gateway (or a thread with
    no loop, which then writes at once); records of other threads come through
    :class:`AccessLogHandler`. ``dropped``: lines dropped so far (the buffer was full, or the
    file could no longer be written). ``chunk``: the most bytes one write holds, each write
    ending at a line's end (a longer line is written alone); ``None``: the whole buffer."""

    def __init__(self, sink: _Sink, *, max_buffer: int = MAX_BUFFER_BYTES, flush_bytes: int = FLUSH_BYTES,
                 chunk: int | None = None) -> None:
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be an integer >= 1 (bytes) or None, got {chunk!r}")
        self.chunk = chunk
        self._sink = sink
        self._buf = bytearray()
        _check_sizes(max_buffer, flush_bytes)
        self.max_buffer = max_buffer
        self._cap = max_buffer  # 0 once the file is closed or broken: every line is then dropped (and counted)
        self.flush_bytes = flush_bytes
        self.dropped = 0
        self._unreported = 0
        self._warned_at = -WARN_EVERY
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the pending flush (or wait)
        self._scheduled = False  # a flush is scheduled on _loop, or _loop waits for the sink to be writable
        self._waiting = False  # _loop waits for writability (add_writer)
        self._broken = False
        self._closed = False
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._sink.name

    @property
    def buffered(self) -> int:
        """Bytes not yet written."""
        return len(self._buf)

    # ------------------------------------------------------------ the request's path
    def write(self, line: bytes) -> None:
        """Append ``line`` (its newline included); it is written within this event-loop
        iteration's flush (or at once, outside a loop)."""
        buf = self._buf
        if len(buf) >= self._cap:
            self._drop(1)
            return
        buf += line
        if self._scheduled:
            loop = self._loop
            assert loop is not None
            if loop.is_closed():  # the loop went away with the flush: schedule on this one
                self._scheduled = self._waiting = False
            else:
                if len(buf) >= self.flush_bytes and not self._waiting:
                    self._flush()
                return
        self._schedule()

    def _schedule(self) -> None:
        loop = _get_running_loop()
        if loop is None:  # no event loop in this thread: write now
            self.flush()
            return
        self._loop = loop
        self._scheduled = True
        loop.call_soon(self._flush)

    def write_threadsafe(self, line: bytes) -> None:
        """``write`` from any thread: handed to the writer's loop, or written at once."""
        running = _get_running_loop()
        if running is not None and (running is self._loop or self._loop is None or self._loop.is_closed()):
            self.write(line)
            return
        with self._lock:
            if len(self._buf) >= self._cap:
                self._drop(1)
                return
            self._buf += line
            loop = self._loop
        if loop is not None and not loop.is_closed() and loop.is_running():
            try:
                loop.call_soon_threadsafe(self._flush_soon)
                return
            except RuntimeError:  # closed meanwhile
                pass
        self.flush()

    def _flush_soon(self) -> None:
        if not self._scheduled:
            self._schedule()

    # ------------------------------------------------------------ writing
    def _flush(self) -> None:
        """Write what can be written without blocking (in the loop); wait for the sink to be
        writable for the rest."""
        if self._waiting:
            return
        self._scheduled = False
        with self._lock:
            if self._write_out(copy=False):
                self._wait_writable()
            if self._unreported:
                self._report(force=not self._buf)

    def _write_out(self, copy: bool) -> bool:
        """Write the buffer to the sink until it is empty or the sink broken (``False``) or
        full (``True``: it would block). ``copy``: write a copy of the buffer (a caller outside
        the loop: the loop may add to it meanwhile). Under the lock."""
        buf = self._buf
        chunk = self.chunk
        while buf and not self._broken:
            try:
                if chunk is not None and len(buf) > chunk:
                    n = self._sink.write(bytes(buf[:_lines_within(buf, chunk)]))
                else:
                    n = self._sink.write(bytes(buf) if copy else buf)
            except BlockingIOError:
                return True
            except InterruptedError:
                continue
            except OSError as exc:
                self._broke(exc)
                return False
            del buf[:n]
        return False

    def _wait_writable(self) -> None:
        fd = self._sink.fd
        loop = _get_running_loop()
        if fd is None or loop is None:
            return  # a stream that said "later": the next write tries again
        try:
            loop.add_writer(fd, self._writable)
        except (OSError, ValueError, NotImplementedError, RuntimeError):
            return
        self._loop = loop
        self._scheduled = self._waiting = True

    def _writable(self) -> None:
        loop = self._loop
        if loop is not None and self._sink.fd is not None:
            loop.remove_writer(self._sink.fd)
        self._waiting = False
        self._flush()

    def flush(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Write everything buffered now, waiting for the reader as long as it makes progress
        within ``timeout`` seconds; what is left after that is dropped (and said on stderr).
        For shutdown and for callers outside the loop; the loop's own flushes never wait."""
        with self._lock:
            if self._waiting:
                loop = self._loop
                if loop is not None and not loop.is_closed() and self._sink.fd is not None:
                    with contextlib.suppress(Exception):
                        loop.remove_writer(self._sink.fd)
                self._waiting = False
            buf = self._buf
            deadline = time.monotonic() + timeout
            held = len(buf)
            while self._write_out(copy=True):  # (a copy: any thread may be here)
                now = time.monotonic()
                if len(buf) < held:  # the reader took some: it has another timeout to take the rest
                    held = len(buf)
                    deadline = now + timeout
                left = deadline - now
                fd = self._sink.fd
                if left <= 0 or fd is None:
                    lines = buf.count(b"\n")
                    self.dropped += lines
                    del buf[:]
                    _stderr(f"sfq serve: the access log's reader ({self.name}) took nothing for {timeout:g} s: "
                            f"{lines} lines dropped at shutdown")
                    break
                _poll_writable(fd, left)
            if self._unreported:
                self._report(force=True)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Flush (``flush``), then close the file if the writer opened it."""
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        self._broken = True  # nothing more goes out
        self._cap = 0
        self._sink.close()

    # ------------------------------------------------------------ losses
    def _drop(self, lines: int) -> None:
        self.dropped += lines
        self._unreported += lines
        self._report(force=False)

    def _broke(self, exc: OSError) -> None:
        """The sink can no longer be written (the reader closed its end, the disk failed)."""
        lines = self._buf.count(b"\n")
        del self._buf[:]
        self._broken = True
        self._cap = 0
        self.dropped += lines
        self._unreported += lines
        with contextlib.suppress(Exception):
            log.error("access log %s: %s; access-log lines are dropped from now on", self.name, exc)
        self._report(force=True)

    def _report(self, *, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._warned_at < WARN_EVERY:
            return
        n, self._unreported = self._unreported, 0
        self._warned_at = now
        with contextlib.suppress(Exception):
            log.warning("access log %s: %d lines dropped (%d in all): %s", self.name, n, self.dropped,
                        "it can no longer be written" if self._broken else
                        f"its reader is not keeping up (over {self.max_buffer} bytes unwritten)")


def _lines_within(buf: bytearray, most: int) -> int:
    """How many bytes of ``buf`` (whole lines) one write of at most ``most`` bytes takes: up
    to the last line's end within ``most``, or the first line whole when it is longer."""
    i = buf.rfind(b"\n", 0, most)
    if i >= 0:
        return i + 1
    j = buf.find(b"\n", most)
    return j + 1 if j >= 0 else len(buf)


def _poll_writable(fd: int, seconds: float) -> None:
    """Block until ``fd`` is writable, at most ``seconds`` (``poll``: no limit on the fd's number)."""
    try:
        p = select.poll()
        p.register(fd, select.POLLOUT)
        p.poll(max(1, int(seconds * 1000)))
    except (InterruptedError, OSError, ValueError):
        time.sleep(min(seconds, 0.01))  # never a busy loop


def _stderr(text: str) -> None:
    with contextlib.suppress(Exception):
        print(text, file=sys.stderr, flush=True)


class AccessLogHandler(logging.Handler):
    """The ``logging.Handler`` of the access logger that ``configure_logging`` installs: its
    records (formatted, a newline added) go through :class:`AccessLog`'s buffer; ``flush``
    and ``close`` (``logging.shutdown`` calls both at exit) write what is buffered."""

    def __init__(self, writer: AccessLog) -> None:
        super().__init__()
        self.writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode("utf-8", "backslashreplace")
            self.writer.write_threadsafe(line)
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        try:
            self.writer.close()
        finally:
            super().close()


def direct(logger: logging.Logger) -> AccessLog | None:
    """``logger``'s writer when a request's line may skip :mod:`logging`: its one handler is an
    :class:`AccessLogHandler` with no filter, and nothing else sees its records (no filter on
    the logger, no propagation to its parents)."""
    hs = logger.handlers
    if len(hs) == 1 and not logger.propagate and not logger.filters:
        h = hs[0]
        if type(h) is AccessLogHandler and not h.filters and h.level <= logging.INFO:
            return h.writer
    return None

