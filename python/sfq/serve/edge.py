"""The gateway's edge: connections before they become requests, and clients that stall.

aiohttp bounds a request head's line and field sizes (``max_line_size``, ``max_field_size``,
``max_headers``) and closes a connection still without a complete head ``keepalive_timeout``
after it opened or after its last response (3630 s by default). It has no deadline measured
from a head's first byte, no cap on a head's total size short of ``max_headers *
max_field_size`` (1 MiB), no deadline for a body (that is the handler's), no cap on open
connections, no bound on how long a client may leave a response unread, it leaves a handler
waiting for a body whose encoding broke mid-way, and its own protocol errors are plain-text
pages with a version banner. :class:`EdgeHandler` (the connection's protocol) and
:class:`Edge` (one per server) add those, with no timer per request:

* **idle**: a connection with no request in progress is closed ``idle_timeout`` seconds
  after it opened or after its last response (aiohttp's keep-alive timer).
* **head**: a request's line and headers must be complete ``header_timeout`` seconds after
  their first byte (408) and within ``max_header_bytes`` (431).
* **send**: a connection whose client has not taken what it was sent for ``send_timeout``
  seconds (the transport stays over its high-water mark) is aborted, which cancels its
  request and frees its slot.
* **connections**: past ``max_connections`` open connections a new one first closes the
  connections that have been waiting longest with no request in progress (idle keep-alive
  ones, or heads still trickling in); a connection whose request is being served is never
  closed for it. Only when every connection is serving a request is the new one answered
  503 and closed.
* **errors**: the protocol's own errors (a bad request line, a header too long, a malformed
  body encoding) are answered in OpenAI's error shape with ``x-should-retry: false``, and no
  response carries a ``Server`` banner with versions. A body encoding that breaks while the
  handler reads the body is handed to that handler (a 400) instead of leaving it waiting.

The body's limits (size, read deadline) are the request handler's (:mod:`sfq.serve.app`):
they depend on the pool, which only the body names. One sweep a second checks the head and
send deadlines over every connection.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import math
import os
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.http_parser import RawRequestMessage
from aiohttp.web_protocol import RequestHandler, _ErrInfo
from aiohttp.web_server import Server

from ..policy.config import Policy, ServerSpec

try:
    import resource
except ImportError:  # pragma: no cover - not on Windows
    resource = None  # type: ignore[assignment]

__all__ = ["Edge", "EdgeHandler", "EdgeSite", "SERVER", "new_request_id", "fd_budget", "raise_fd_limit"]

log = logging.getLogger("sfq.serve")

#: the ``Server`` header of every response (no versions)
SERVER = "sfq"
#: seconds between two sweeps over the open connections
TICK = 1.0

_IDLE, _HEAD, _BUSY = 0, 1, 2

_prefix = "req_" + os.urandom(6).hex()
_counter = itertools.count(1)


def _new_prefix() -> None:
    """A forked process (``sfq serve --workers``) draws its own prefix: its request ids never
    repeat its parent's or a sibling's."""
    global _prefix, _counter
    _prefix = "req_" + os.urandom(6).hex()
    _counter = itertools.count(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_prefix)


def new_request_id() -> str:
    """A request id, unique over processes (a random prefix) and within one (a counter)."""
    return f"{_prefix}{next(_counter):08x}"


def canned(status: int, reason: str, code: str, message: str, *, retry: bool,
           extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A whole ``Connection: close`` response in OpenAI's error shape, as bytes: what the edge
    writes to a connection it is about to close, outside any request handler."""
    rid = new_request_id()
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "server_error", "code": code, "param": None, "request_id": rid}},
                      separators=(",", ":")).encode()
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}",
            "Connection: close", f"Server: {SERVER}", f"x-request-id: {rid}",
            f"x-should-retry: {'true' if retry else 'false'}", *(f"{k}: {v}" for k, v in extra)]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def raise_fd_limit() -> None:
    """Raise the process's soft file-descriptor limit to its hard limit (what a server does
    first: each connection is one)."""
    if resource is None:  # pragma: no cover
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass


def fd_budget(policy: Policy) -> int:
    """Connections the process can hold: its soft file-descriptor limit less the backends'
    connections (each backend's ``max_in_flight``, and two for its probes) and a margin of 64
    for everything else (logs, the event loop, a shared-state client)."""
    soft = 1 << 16
    if resource is not None:
        lim = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if lim != resource.RLIM_INFINITY:
            soft = int(lim)
    backends = sum(b.max_in_flight + 2 for p in policy.pools.values() for b in p.backends)
    return max(8, soft - backends - 64)


class Edge:
    """The edge's settings and its sweep, for one server: the limits in force (``apply`` puts
    a reloaded policy's ``server:`` section in force for new heads, bodies and sweeps) and the
    connection cap."""

    def __init__(self, spec: ServerSpec, *, max_connections: int,
                 on_close: Callable[[str], None] | None = None) -> None:
        self.server: Server | None = None
        self._on_close = on_close
        self._warned = -math.inf
        self.header_timeout = self.idle_timeout = self.send_timeout = 0.0
        self.max_header_bytes = 0
        self.max_connections = max_connections
        self._fd_cap = max_connections
        self.apply(spec)
        self._timer: asyncio.TimerHandle | None = None
        #: what the edge closed, by cause (also ``sfq_gateway_connections_closed_total`` on ``/metrics``)
        self.closed: dict[str, int] = {"head_timeout": 0, "head_too_large": 0, "send_timeout": 0, "evicted": 0,
                                       "refused_full": 0}

    def apply(self, spec: ServerSpec) -> None:
        self.header_timeout = spec.header_timeout_seconds
        self.idle_timeout = spec.idle_timeout_seconds
        self.send_timeout = spec.send_timeout_seconds
        self.max_header_bytes = spec.max_header_bytes
        cap = spec.max_connections
        if cap is not None and cap > self._fd_cap:
            log.warning("server.max_connections %d is more than the file-descriptor limit leaves (%d): using %d",
                        cap, self._fd_cap, self._fd_cap)
            cap = self._fd_cap
        self.max_connections = cap if cap is not None else self._fd_cap

    # ------------------------------------------------------------ the protocol factory
    def factory(self, server: Server) -> Callable[[], EdgeHandler]:
        """What ``loop.create_server`` calls for each connection."""
        self.server = server
        loop = asyncio.get_running_loop()
        kwargs = dict(server._kwargs)

        def make() -> EdgeHandler:
            return EdgeHandler(server, edge=self, loop=loop, **{**kwargs, "keepalive_timeout": self.idle_timeout})

        return make

    def start(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(TICK, self._sweep)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _closed(self, why: str) -> None:
        self.closed[why] += 1
        if self._on_close is not None:
            self._on_close(why)

    def open_connections(self) -> int:
        return 0 if self.server is None else len(self.server._connections)

    # ------------------------------------------------------------ the cap
    def admit(self, h: EdgeHandler) -> None:
        """A connection was made: over the cap, close the connections that have waited
        longest with no request in progress (several at once, so a flood costs one scan per
        batch), or, when every connection is serving a request, refuse this one."""
        srv = self.server
        if srv is None:
            return
        conns = srv._connections
        if len(conns) <= self.max_connections:
            return
        # (closed connections stay listed until their handler ends: count the open ones)
        over = sum(1 for c in conns if c.transport is not None) - self.max_connections
        if over <= 0:
            return
        now = h._since
        if now - self._warned > 10.0:  # at most one line per 10 s however long the flood lasts
            self._warned = now
            log.warning("%d connections are open, the cap is %d (server.max_connections): closing the longest "
                        "idle ones", len(conns), self.max_connections)
        batch = over + self.max_connections // 64
        idle = [c for c in conns if c is not h and isinstance(c, EdgeHandler) and c._st != _BUSY
                and c.transport is not None]
        if not idle:
            self._closed("refused_full")
            h._refuse(FULL)
            return
        for c in heapq.nsmallest(batch, idle, key=_since):
            self._closed("evicted")
            c.force_close()

    # ------------------------------------------------------------ the sweep
    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(TICK, self._sweep)
        srv = self.server
        if srv is None:
            return
        now = loop.time()
        head, send = self.header_timeout, self.send_timeout
        for c in list(srv._connections):
            if not isinstance(c, EdgeHandler) or c.transport is None:
                continue
            if c._st == _HEAD and now - c._since > head:
                self._closed("head_timeout")
                c._refuse(HEAD_TIMEOUT)
            elif c._paused_at and now - c._paused_at > send:
                self._closed("send_timeout")
                log.debug("dropping a connection whose client has not read what it was sent for %g s", send)
                c.transport.abort()


def _since(c: EdgeHandler) -> float:
    return c._since


#: what the edge answers before it closes a connection on its own: (status, reason, code, message, retry, headers)
_Canned = tuple[int, str, str, str, bool, tuple[tuple[str, str], ...]]
HEAD_TIMEOUT: _Canned = (408, "Request Timeout", "request_timeout",
                         "the request's line and headers did not arrive in time", True, ())
HEAD_TOO_LARGE: _Canned = (431, "Request Header Fields Too Large", "request_header_too_large",
                           "the request's line and headers are too large", False, ())
FULL: _Canned = (503, "Service Unavailable", "too_many_connections",
                 "the gateway has no room for another connection; try again shortly", True, (("Retry-After", "1"),))

#: aiohttp's protocol errors -> (status, code, message)
_PROTOCOL_ERRORS: tuple[tuple[type[BaseException], int, str, str], ...] = (
    (LineTooLong, 431, "request_header_too_large", "a line or header of the request is too long"),
)


class EdgeHandler(RequestHandler):
    """aiohttp's HTTP/1.1 protocol with the edge's limits (see the module's docstring). Its
    state: ``_IDLE`` (no request in progress: keep-alive, or a fresh connection), ``_HEAD``
    (a request's head is arriving, since ``_since``), ``_BUSY`` (a request is being served)."""

    __slots__ = ("_edge", "_st", "_since", "_head_bytes", "_paused_at")

    def __init__(self, manager: Server, *, edge: Edge, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._edge = edge
        self._st = _IDLE
        self._since = 0.0
        self._head_bytes = 0
        self._paused_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._since = self._loop.time()
        super().connection_made(transport)
        self._edge.admit(self)

    def data_received(self, data: bytes) -> None:
        st = self._st
        n = self._request_count
        super().data_received(data)
        if st == _BUSY:  # a body, or the next pipelined head: the request handler's business
            if self._request_count != n:
                self._body_broken()
            return
        if self._request_count != n:  # a head is complete
            self._st = _BUSY
            held = self._head_bytes
            self._head_bytes = 0
            if held + len(data) > self._edge.max_header_bytes and self._head_too_large():
                self._edge._closed("head_too_large")
                self._refuse(HEAD_TOO_LARGE)
            return
        if not data or self.transport is None:
            return
        if st == _IDLE:
            self._st = _HEAD
            self._since = self._loop.time()
            self._head_bytes = len(data)
        else:
            self._head_bytes += len(data)
        if self._head_bytes > self._edge.max_header_bytes:
            self._edge._closed("head_too_large")
            self._refuse(HEAD_TOO_LARGE)

    def _body_broken(self) -> None:
        """aiohttp reports a malformed body (a bad chunk) as a new, failed message and leaves the
        request reading its body waiting: hand that request the error instead."""
        req = self._current_request
        if req is None:
            return
        for msg, _ in self._messages:
            if isinstance(msg, _ErrInfo):
                req.content.set_exception(msg.exc if isinstance(msg.exc, Exception) else
                                          RuntimeError(msg.message))
                return

    def _head_too_large(self) -> bool:
        """Whether a head just parsed (it came with more than ``max_header_bytes`` in one
        read) is itself over the limit: its line and fields, counted as sent."""
        most = self._edge.max_header_bytes
        for msg, _ in self._messages:
            if isinstance(msg, RawRequestMessage) and \
                    len(msg.path) + 14 + sum(len(k) + len(v) + 4 for k, v in msg.raw_headers) > most:
                return True
        return False

    async def finish_response(self, request: Any, resp: Any, start_time: float | None) -> tuple[Any, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            if not self._messages:
                self._st = _IDLE
                self._since = self._loop.time()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._paused_at = self._loop.time()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._paused_at = 0.0

    def _refuse(self, answer: _Canned) -> None:
        """Answer ``answer`` and close, whatever the connection was doing."""
        t = self.transport
        if t is not None:
            status, reason, code, message, retry, extra = answer
            try:
                t.write(canned(status, reason, code, message, retry=retry, extra=extra))
            except Exception:  # pragma: no cover - a transport closing under us
                pass
        self.force_close()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to its own errors (a malformed request, a handler that raised), in
        OpenAI's shape. Malformed requests are the client's and logged at debug level (a
        scanner must not fill the log); anything else is logged with its traceback."""
        if request.writer.output_size > 0:  # a response had started: nothing else can be sent
            raise ConnectionError("a response was already being sent; cannot send an error response")
        code, text = "bad_request", "the request is malformed"
        for cls, st, c, t in _PROTOCOL_ERRORS:
            if isinstance(exc, cls):
                status, code, text = st, c, t
                break
        rid = new_request_id()
        if status >= 500:
            code, text = "internal_error", "the gateway failed to serve this request"
            self.log_exception("request %s: error handling a request", rid, exc_info=exc)
        else:
            log.debug("request %s: malformed request: %s", rid, exc)
        body = {"error": {"message": text, "type": "invalid_request_error" if status < 500 else "server_error",
                          "code": code, "param": None, "request_id": rid}}
        resp = web.Response(status=status, body=json.dumps(body, separators=(",", ":")).encode(),
                            content_type="application/json",
                            headers={"Server": SERVER, "x-request-id": rid,
                                     "x-should-retry": "true" if status >= 500 else "false"})
        resp.force_close()
        return resp


class EdgeSite(web.BaseSite):
    """A TCP site whose connections run :class:`EdgeHandler` (``web.TCPSite`` otherwise): it
    binds ``host`` and ``port``, or serves ``sock``, a listening socket bound already (``sfq
    serve --workers``: every worker serves the socket its parent bound)."""

    __slots__ = ("_edge", "_host", "_port", "_sock")

    def __init__(self, runner: web.BaseRunner, edge: Edge, host: str = "127.0.0.1", port: int = 0, *,
                 backlog: int = 1024, sock: socket.socket | None = None) -> None:
        super().__init__(runner, backlog=backlog)
        self._edge = edge
        self._sock = sock
        if sock is not None:
            host, port = sock.getsockname()[:2]
        self._host = host
        self._port = port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        if self._sock is not None:
            self._server = await loop.create_server(self._edge.factory(server), sock=self._sock,
                                                    backlog=self._backlog)
        else:
            self._server = await loop.create_server(self._edge.factory(server), self._host, self._port,
                                                    backlog=self._backlog, reuse_address=True)
        self._edge.start()

    async def stop(self) -> None:
        self._edge.stop()
        await super().stop()
