"""The pooled HTTP/1.1 client that ``OpenAIBackend`` sends its requests with (``_http.py``),
against real loopback servers written here that send exact bytes: framing (Content-Length,
chunked split at awkward places, until the connection closes, 1xx heads), keep-alive and
when a connection leaves the pool, the one resend that is safe, resets, silences and
deadlines, heads too large, 429s, back-pressure with a slow consumer, cancellation, TLS and
IPv6. Every test runs on asyncio's own loop and on uvloop (when installed)."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import socket
import ssl
import struct
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from dispatch_helpers import wait_until

from sfq.backends import JSONEvent, OpenAIBackend
from sfq.backends import _http
from sfq.backends._http import HIGH_WATER, MAX_HEAD, ConnectFailed, Disconnected, HTTPPool, NotWritten, Timeout
from sfq.errors import (
    BackendError,
    BackendRateLimited,
    BackendTimeout,
    BackendUnavailable,
    StreamInterrupted,
)

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None  # type: ignore[assignment]


# (pytest-asyncio 1.x would rather have a loop-factory hook, which applies to a whole directory;
# test_the_loop_is_the_one_asked_for fails should this override stop working)
pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture")


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    if request.param == "uvloop":
        if uvloop is None:
            pytest.skip("uvloop is not installed")
        return uvloop.EventLoopPolicy()
    return asyncio.DefaultEventLoopPolicy()


async def test_the_loop_is_the_one_asked_for(request: pytest.FixtureRequest):
    loop = asyncio.get_running_loop()
    assert (type(loop).__module__.startswith("uvloop")) == ("uvloop" in request.node.callspec.id)


# ------------------------------------------------------------------ the servers
class Peer:
    """One connection as the server sees it."""

    def __init__(self, srv: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.srv = srv
        self.reader = reader
        self.writer = writer

    async def request(self) -> tuple[bytes, bytes]:
        """The next request: its head and its body (by Content-Length)."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        n = 0
        for line in head.split(b"\r\n")[1:]:
            if line.lower().startswith(b"content-length:"):
                n = int(line.split(b":", 1)[1])
        body = await self.reader.readexactly(n) if n else b""
        self.srv.requests.append((head, body))
        return head, body

    async def send(self, *parts: bytes, gap: float = 0.0) -> None:
        """Write each part on its own (``gap`` seconds apart: separate reads, most likely)."""
        for p in parts:
            self.writer.write(p)
            await self.writer.drain()
            if gap:
                await asyncio.sleep(gap)

    async def until_closed(self) -> None:
        """Wait for the client to close or abort the connection."""
        try:
            while await self.reader.read(65536):
                pass
        except ConnectionError:
            pass
        self.srv.client_closed += 1

    def _sock(self) -> socket.socket:
        """The connection's socket (a duplicate of its descriptor: any loop's transport)."""
        fd = self.writer.get_extra_info("socket").fileno()
        return socket.socket(fileno=os.dup(fd))

    def reset(self) -> None:
        """Abort with a TCP reset (SO_LINGER 0)."""
        with self._sock() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    def shutdown(self) -> None:
        """Close at once, the end of file sent now (not at the loop's next turn)."""
        with self._sock() as sock:
            sock.shutdown(socket.SHUT_RDWR)


Script = Callable[[Peer], Awaitable[None]]


class RawServer:
    """An asyncio server on loopback that runs ``script`` for each connection."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.ended = 0  # connections whose script is over
        self.client_closed = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.peers: list[Peer] = []
        self.port = 0
        self.host = "127.0.0.1"
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str = "127.0.0.1", ssl_ctx: ssl.SSLContext | None = None) -> RawServer:
        self.host = host
        self._server = await asyncio.start_server(self._handle, host, 0, ssl=ssl_ctx)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        peer = Peer(self, reader, writer)
        self.peers.append(peer)
        try:
            await self.script(peer)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            self.ended += 1
            writer.transport.abort()

    async def stop(self) -> None:
        for p in self.peers:
            p.writer.transport.abort()
        if self._server is not None:
            self._server.close()
            await asyncio.wait_for(self._server.wait_closed(), 5)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[RawServer]]]:
    servers: list[RawServer] = []

    async def make(script: Script, **kw: Any) -> RawServer:
        srv = await RawServer(script).start(**kw)
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        await srv.stop()


def reply(body: bytes, status: str = "200 OK", headers: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{headers}Content-Length: {len(body)}\r\n\r\n"
            .encode() + body)


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
OK_JSON = json.dumps({"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
BODY = {"model": "m", "prompt": "p", "max_tokens": 1}


def events(n: int) -> list[bytes]:
    out = [b"data: " + json.dumps({"choices": [{"index": 0, "text": str(i)}]}).encode() + b"\n\n" for i in range(n)]
    return out + [b"data: [DONE]\n\n"]


async def keep_answering(peer: Peer) -> None:
    while True:
        await peer.request()
        await peer.send(reply(OK_JSON))


def pool_of(b: OpenAIBackend) -> HTTPPool:
    assert b._pool is not None
    return b._pool


async def pool(url: str, **kw: Any) -> HTTPPool:
    return HTTPPool(url, connect_timeout=kw.pop("connect_timeout", 5.0), keepalive_timeout=kw.pop("keepalive", 5.0),
                    **kw)


def request(path: str = "/x", body: bytes = b"{}", host: str = "h") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


# ------------------------------------------------------------------ framing and keep-alive
async def test_a_request_is_the_exact_bytes_and_the_connection_is_kept(serve):
    srv = await serve(keep_answering)
    b = OpenAIBackend(srv.url + "/base/v1", api_key="sk-1", headers={"X-Extra": "yes"})
    try:
        for _ in range(3):
            r = await b.complete("chat/completions", BODY)
            assert r["choices"][0]["text"] == "hi"
        assert srv.connections == 1 and pool_of(b).idle == 1 and pool_of(b).connects == 1
        head, body = srv.requests[0]
        data = json.dumps(BODY, separators=(",", ":")).encode()
        assert head == (f"POST /base/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n"
                        "User-Agent: sfq\r\nContent-Type: application/json\r\nAuthorization: Bearer sk-1\r\n"
                        f"X-Extra: yes\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        assert body == data
    finally:
        await b.close()
    await wait_until(lambda: srv.ended == 1, "the server to see the pooled connection closed")


async def test_chunked_replies_split_at_every_awkward_place(serve):
    """A chunked body cut inside a chunk's size, between CR and LF, inside the data, inside the
    terminator: the body comes out whole, the pieces de-chunked, and the connection is kept."""
    body = chunked(b'{"choices": [', b'{"text": "hi"}', b"], ", b'"usage": {"completion_tokens": 1}}')
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
    cuts = [1, 2, 3, 4, 5, 17, 18, 19, len(body) - 4, len(body) - 3, len(body) - 2, len(body) - 1]

    async def script(peer: Peer) -> None:
        while True:
            await peer.request()
            data = head + body
            parts, last = [], 0
            for c in sorted({len(head) - 2, len(head) - 1, *(len(head) + x for x in cuts)}):
                parts.append(data[last:c])
                last = c
            parts.append(data[last:])
            await peer.send(*parts, gap=0.002)

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    try:
        for _ in range(2):
            r = await b.complete("completions", BODY)
            assert r == {"choices": [{"text": "hi"}], "usage": {"completion_tokens": 1}}
        assert srv.connections == 1 and pool_of(b).idle == 1
    finally:
        await b.close()


class FakeTransport(asyncio.Transport):
    """What a connection writes to, for feeding its parser by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closing = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.closing = True

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def test_every_split_of_a_chunked_stream_gives_the_same_bytes():
    """Exhaustive: the reply fed to the connection in two reads cut at every byte, then in
    one-byte reads; what the reader takes is the de-chunked body every time."""
    data = STREAM_HEAD + chunked(*events(3))
    want = b"".join(events(3))
    p = await pool("http://127.0.0.1:1")
    for cuts in [[i] for i in range(1, len(data))] + [list(range(1, len(data)))]:
        conn = _http._Conn(p)
        t = FakeTransport()
        conn.connection_made(t)
        conn.begin(request(), float("inf"), "t", None, None, p.loop.time())
        reply_ = None
        got = b""
        last = 0
        for c in [*cuts, len(data)]:
            conn.data_received(data[last:c])
            last = c
            if reply_ is None and conn.head_done:
                reply_ = _http.Reply(conn)
            if reply_ is not None:
                piece = reply_.take()
                while piece:
                    got += piece
                    piece = reply_.take()
        assert reply_ is not None and reply_.status == 200 and got == want, cuts
        assert conn.complete and conn.state == _http._IDLE and not t.closing  # back in the pool
        p._idle.clear()
    p.close()


async def test_connection_close_and_bodies_to_the_close_leave_the_pool(serve):
    async def script(peer: Peer) -> None:
        await peer.request()
        if srv.connections == 1:
            await peer.send(reply(OK_JSON, headers="Connection: close\r\n"))
        else:  # no length: the body runs to the end of the connection (HTTP/1.0, then 1.1)
            version = b"1.0" if srv.connections == 2 else b"1.1"
            await peer.send(b"HTTP/%b 200 OK\r\nConnection: close\r\n\r\n" % version, OK_JSON[:9], OK_JSON[9:],
                            gap=0.002)
            peer.writer.close()

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    try:
        for i in range(3):
            assert (await b.complete("completions", BODY))["choices"][0]["text"] == "hi"
            assert pool_of(b).idle == 0 and srv.connections == i + 1
        await wait_until(lambda: pool_of(b).open == 0, "the connections to be gone")
    finally:
        await b.close()


async def test_an_interim_100_continue_head_is_skipped(serve):
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 100 Continue\r\n\r\n", reply(OK_JSON), gap=0.002)
        await peer.request()
        await peer.send(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + reply(OK_JSON))
        await peer.until_closed()

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    try:
        for _ in range(2):
            assert (await b.complete("completions", BODY))["choices"][0]["text"] == "hi"
        assert srv.connections == 1
    finally:
        await b.close()


async def test_an_idle_connection_expires_after_keepalive_timeout(serve):
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(reply(OK_JSON))
        await peer.until_closed()

    srv = await serve(script)
    b = OpenAIBackend(srv.url, keepalive_timeout=0.05)
    try:
        await b.complete("completions", BODY)
        await wait_until(lambda: srv.client_closed == 1, "the client to close the idle connection")
        assert pool_of(b).idle == 0 and pool_of(b).open == 0
        await b.complete("completions", BODY)  # a new connection
        assert srv.connections == 2
    finally:
        await b.close()


async def test_unasked_bytes_on_an_idle_connection_drop_it(serve):
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(reply(OK_JSON))
        if srv.connections == 1:
            await asyncio.sleep(0.01)
            await peer.send(b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
        await peer.until_closed()

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    try:
        await b.complete("completions", BODY)
        await wait_until(lambda: pool_of(b).open == 0, "the connection to be dropped")
        await b.complete("completions", BODY)
        assert srv.connections == 2 and len(srv.requests) == 2 and b.resent == 0
    finally:
        await b.close()


# ------------------------------------------------------------------ what is resent, what is not
async def test_an_idle_connection_the_server_closed_leaves_the_pool(serve):
    """The server closes a kept-alive connection while it is idle; the loop sees it: the pool
    forgets it and the next request takes a new connection (nothing to resend)."""
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(reply(OK_JSON))
        if srv.connections == 1:
            peer.shutdown()
        else:
            await peer.until_closed()

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    try:
        await b.complete("completions", BODY)
        await wait_until(lambda: pool_of(b).open == 0, "the pool to forget the closed connection")
        await b.complete("completions", BODY)
        assert b.resent == 0 and srv.connections == 2 and len(srv.requests) == 2
    finally:
        await b.close()


async def test_a_close_not_yet_seen_by_the_loop_is_caught_before_writing(serve):
    """The resend case: the server's end of file is already in the socket when the request is
    about to go on the pooled connection, the loop not having read it. Nothing is written
    there (NotWritten); the backend sends the request on a new connection, counted in
    ``resent``; the server sees it once."""
    srv = await serve(keep_answering)
    b = OpenAIBackend(srv.url)
    try:
        await b.complete("completions", BODY)
        p = pool_of(b)
        fd = p._idle[0].transport.get_extra_info("socket").fileno()
        srv.peers[0].shutdown()  # now, not at the loop's next turn
        assert select.select([fd], [], [], 5)[0]  # the server's end reached this socket
        # from here to the write, no await: the loop cannot read the end of file first
        with pytest.raises(NotWritten):
            await p.send(request())
        assert len(srv.requests) == 1 and p.open == 0
        # through the backend: the same, and the request goes out on a new connection
        await b.complete("completions", BODY)
        fd = p._idle[0].transport.get_extra_info("socket").fileno()
        srv.peers[1].shutdown()
        assert select.select([fd], [], [], 5)[0]
        r = await b.complete("completions", BODY)
        assert r["choices"][0]["text"] == "hi" and b.resent == 1
        assert len(srv.requests) == 3 and srv.connections == 3  # each request reached the server once
    finally:
        await b.close()


async def test_a_written_request_that_gets_no_reply_is_not_resent(serve):
    """The server reads the request, then closes without a byte of a reply, on a reused
    connection: it may have acted on it, so it is not sent again (unless idempotent)."""
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(reply(OK_JSON))
        await peer.request()
        if srv.connections <= 2:
            peer.shutdown()  # took it, then died
        else:
            await peer.send(reply(OK_JSON))
        await peer.until_closed()

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    try:
        await b.complete("completions", BODY)
        with pytest.raises(BackendUnavailable, match="before replying") as ei:
            await b.complete("completions", BODY)
        assert not ei.value.never_sent and b.resent == 0 and len(srv.requests) == 2
        # idempotent: the duplicate is harmless by the caller's word, so it goes out again
        await b.complete("completions", BODY)
        r = await b.complete("completions", BODY, idempotent=True)  # dropped, then resent on connection 3
        assert r["choices"][0]["text"] == "hi" and b.resent == 1
    finally:
        await b.close()


async def test_a_refused_connection_was_never_sent(unused_tcp_port: int):
    b = OpenAIBackend(f"http://127.0.0.1:{unused_tcp_port}")
    try:
        with pytest.raises(BackendUnavailable, match="cannot connect") as ei:
            await b.complete("completions", BODY)
        assert ei.value.never_sent and b.resent == 0
        with pytest.raises(ConnectFailed):
            await (await pool(f"http://127.0.0.1:{unused_tcp_port}")).send(request())
    finally:
        await b.close()


async def test_a_server_that_never_answers_the_connect_is_a_connect_timeout_never_sent():
    """A listener whose accept queue is full drops further connection attempts (Linux): the
    connect hangs until ``connect_timeout``, which is a ``Timeout`` of kind ``connect``
    (nothing was sent), and through the backend a ``BackendTimeout`` with ``never_sent``."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(0)
    port = lsock.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):  # fill the accept queue (nobody accepts)
            f = socket.socket()
            f.setblocking(False)
            f.connect_ex(("127.0.0.1", port))
            fillers.append(f)
        await asyncio.sleep(0.05)
        p = await pool(f"http://127.0.0.1:{port}", connect_timeout=0.3)
        with pytest.raises(Timeout) as ei:  # (a connection made would meet the 5 s bound instead)
            await p.send(request(), deadline=asyncio.get_running_loop().time() + 5.0, kind="request", seconds=5.0)
        assert ei.value.kind == "connect" and ei.value.never_sent and p.open == 0
        b = OpenAIBackend(f"http://127.0.0.1:{port}", connect_timeout=0.3, timeout=5.0)
        try:
            with pytest.raises(BackendTimeout, match="no connection within 0.3 s") as bi:
                await b.complete("completions", BODY)
            assert bi.value.never_sent and bi.value.unhealthy and b.resent == 0
        finally:
            await b.close()
    finally:
        for f in fillers:
            f.close()
        lsock.close()


# ------------------------------------------------------------------ failures mid-way
async def test_a_reset_mid_body(serve):
    async def script(peer: Peer) -> None:
        await peer.request()
        if b"stream" in srv.requests[-1][1]:
            await peer.send(STREAM_HEAD, chunked(*events(5))[:120], gap=0.01)
        else:
            await peer.send(reply(OK_JSON)[:-10])
        await asyncio.sleep(0.02)
        peer.reset()

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    try:
        with pytest.raises(BackendUnavailable, match="connection lost") as ei:
            await b.complete("completions", BODY)
        assert not ei.value.never_sent and b.resent == 0
        got = 0
        with pytest.raises(StreamInterrupted) as si:
            async for _ in b.stream("completions", BODY):
                got += 1
        assert si.value.unhealthy and si.value.chunks == got >= 1
        assert pool_of(b).open == 0
    finally:
        await b.close()


async def test_a_silent_server_times_out(serve):
    """``read_timeout``: silent before the head, and between two pieces of a stream; the
    connection is dropped (the server sees it)."""
    async def script(peer: Peer) -> None:
        await peer.request()
        if srv.connections == 2:
            await peer.send(STREAM_HEAD, chunked(*events(3))[:60])
        await peer.until_closed()

    srv = await serve(script)
    b = OpenAIBackend(srv.url, read_timeout=0.1)
    try:
        with pytest.raises(BackendTimeout, match="the server sent nothing for 0.1 s"):
            await b.complete("completions", BODY)
        await wait_until(lambda: srv.client_closed == 1, "the server to see the client leave")
        got = 0
        with pytest.raises(StreamInterrupted, match="sent nothing") as si:
            async for _ in b.stream("completions", BODY):
                got += 1
        assert si.value.unhealthy and got == 1
        await wait_until(lambda: srv.client_closed == 2, "the server to see the client leave")
    finally:
        await b.close()


async def test_a_dribbling_server_meets_the_whole_request_bound(serve):
    """A server that never goes quiet for long (a byte every few ms) still ends at ``timeout``
    (a plain request) and ``stream_timeout`` (a stream), not at ``read_timeout``."""
    async def script(peer: Peer) -> None:
        await peer.request()
        if b"stream" in srv.requests[-1][1]:
            await peer.send(STREAM_HEAD)
            while True:
                await peer.send(chunked(b": keep-alive\n\n")[:-5], gap=0.005)
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while True:
            await peer.send(b" ", gap=0.005)

    srv = await serve(script)
    b = OpenAIBackend(srv.url, read_timeout=0.2, timeout=0.15, stream_timeout=0.2)
    try:
        with pytest.raises(BackendTimeout, match="no complete reply within 0.15 s"):
            await b.complete("completions", BODY)
        with pytest.raises(BackendTimeout, match="total deadline of 0.2 s") as ei:
            async for _ in b.stream("completions", BODY):
                pass
        assert not ei.value.unhealthy
        assert pool_of(b).open == 0
    finally:
        await b.close()


async def test_heads_past_the_limit_are_refused_and_large_ones_pass(serve):
    async def script(peer: Peer) -> None:
        await peer.request()
        size = MAX_HEAD // 2 if srv.connections == 1 else MAX_HEAD + 10
        await peer.send(reply(OK_JSON, headers=f"X-Big: {'a' * size}\r\n"))
        await peer.until_closed()

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    try:
        assert (await b.complete("completions", BODY))["choices"][0]["text"] == "hi"
        await b.close()
        with pytest.raises(BackendError, match=f"head is over {MAX_HEAD} bytes") as ei:
            await b.complete("completions", BODY)
        assert ei.value.unhealthy and type(ei.value) is BackendError
    finally:
        await b.close()


async def test_garbage_is_not_http(serve):
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await peer.until_closed()

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    try:
        with pytest.raises(BackendError, match="not HTTP"):
            await b.complete("completions", BODY)
    finally:
        await b.close()


async def test_a_429_says_when_to_come_back_and_keeps_the_connection(serve):
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(reply(b'{"error": {"message": "slow down"}}', "429 Too Many Requests",
                              "Retry-After: 7\r\nX-Twice: 1\r\nX-Twice: 2\r\n"))
        await peer.request()
        await peer.send(reply(b"{}", "503 Service Unavailable"))
        await peer.until_closed()

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    try:
        with pytest.raises(BackendRateLimited) as ei:
            await b.complete("completions", BODY)
        e = ei.value
        assert e.status == 429 and e.retry_after == 7.0 and "slow down" in e.body and not e.unhealthy
        assert e.headers["Retry-After"] == "7" and e.headers["X-Twice"] == "2"  # the server's spelling; the last
        assert pool_of(b).idle == 1  # the error's body was read whole: the connection is kept
        with pytest.raises(BackendError) as e5:
            async for _ in b.stream("completions", BODY):
                pass
        assert e5.value.status == 503 and e5.value.unhealthy and srv.connections == 1
    finally:
        await b.close()


def test_headers_are_read_from_the_head_when_asked():
    raw = (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 429 Too Many\r\nRetry-After: 1\r\n"
           b"X-A:one\r\nretry-after:  2 \r\nX-Fold: a\r\n  b\r\n\r\nbody")
    fields, end = _http._head(raw)
    assert fields == [(b"Retry-After", b"1"), (b"X-A", b"one"), (b"retry-after", b"2"), (b"X-Fold", b"a b")]
    assert raw[end:] == b"body"
    assert _http._head(b"HTTP/1.1 200 OK\r\nX: y\r\n") == ([], 23)  # not all there


# ------------------------------------------------------------------ streams
async def test_a_stream_keeps_its_connection_when_the_terminator_comes_late(serve):
    """``data: [DONE]`` in one read, the chunked terminator in a later one: the stream ends at
    ``[DONE]`` and the connection goes back to the pool once the terminator comes."""
    async def script(peer: Peer) -> None:
        while True:
            await peer.request()
            body = chunked(*events(3))
            await peer.send(STREAM_HEAD + body[:-5], gap=0.03)
            await peer.send(body[-5:])

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    try:
        for _ in range(2):
            got = [e async for e in b.stream("completions", BODY)]
            assert [e["choices"][0]["text"] for e in got] == ["0", "1", "2"]
            await wait_until(lambda: pool_of(b).idle == 1, "the connection back in the pool")
        assert srv.connections == 1
        assert b"include_usage" in srv.requests[0][1]
    finally:
        await b.close()


async def test_an_event_keeps_its_bytes_only_when_they_are_one_data_line(serve):
    """``JSONEvent.raw`` is the event's ``data: `` line as the server sent it, so that a proxy can
    write it on unchanged; an event in two data lines (or ``data:`` without the space) has the
    same dict and no ``raw`` (one line made of it would be another event)."""
    one = b'{"choices": [{"index": 0, "text": "a"}],   "n": 1}'

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(STREAM_HEAD + chunked(b"data: " + one + b"\n\n",
                                              b'data: {"choices": [{"index": 0,\ndata:  "text": "b"}]}\n\n',
                                              b'data:{"choices": [{"index": 0, "text": "c"}]}\n\n',
                                              b"data: " + one + b"\n\ndata: " + one + b"\n\n",
                                              b"data: [DONE]\n\n"))
        await peer.until_closed()

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    try:
        got = [ev async for ev in b.stream("completions", BODY)]
        assert [ev["choices"][0]["text"] for ev in got] == ["a", "b", "c", "a", "a"]
        assert [getattr(ev, "raw", None) for ev in got] == [one, None, None, one, one]
        assert all(type(ev) is JSONEvent and isinstance(ev, dict) for ev in got)
    finally:
        await b.close()


async def test_a_slow_consumer_holds_bounded_memory(serve):
    """The server writes 32 MiB as fast as the connection takes it; the reader takes one piece
    and waits. The connection stops reading past HIGH_WATER (what is held stays bounded and the
    server is held back), then the reader takes the rest and it is all there."""
    total = 32 << 20
    chunk = b"x" * (64 << 10)
    sent = [0]

    async def script(peer: Peer) -> None:
        await peer.request()
        with peer._sock() as sock:  # little held on the sending side: the client's holding is what counts
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 128 << 10)
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while sent[0] < total:
            peer.writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            await peer.writer.drain()
            sent[0] += len(chunk)
        await peer.send(b"0\r\n\r\n")
        await peer.until_closed()

    srv = await serve(script)
    p = await pool(srv.url)
    try:
        r = await p.send(request())
        conn = r._c
        await wait_until(lambda: conn.paused, "the connection to stop reading")
        held = conn.buffered
        bound = HIGH_WATER + (1 << 20)  # one read past the mark at most (a read is 256 KiB or less)
        assert held <= bound
        seen = [-1]

        def server_stopped() -> bool:  # two looks in a row at the same progress
            stopped, seen[0] = sent[0] == seen[0], sent[0]
            return stopped

        await wait_until(server_stopped, "the server to be held back")
        assert conn.buffered == held and sent[0] < total  # nothing more read; the server stopped short
        got = 0
        most = 0
        while True:
            most = max(most, conn.buffered)
            piece = r.take()
            if piece is None:
                break
            if not piece:
                await r.more()
                continue
            got += len(piece)
        assert got == total and most <= bound
        assert p.idle == 1
    finally:
        p.close()


async def test_cancelling_the_caller_aborts_the_connection(serve):
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(STREAM_HEAD, *[b"%x\r\n%b\r\n" % (len(e), e) for e in events(1000)], gap=0.005)

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    got = []

    async def consume() -> None:
        async for e in b.stream("completions", BODY):
            got.append(e)

    try:
        t = asyncio.create_task(consume())
        await wait_until(lambda: len(got) >= 2, "two events")
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert pool_of(b).open == 0 and pool_of(b).idle == 0
        # a plain request cancelled while waiting for its head: aborted too
        srv.script = lambda peer: peer.until_closed()
        t2 = asyncio.create_task(b.complete("completions", BODY))
        await wait_until(lambda: srv.connections == 2, "the second connection")
        await asyncio.sleep(0.01)
        t2.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t2
        await wait_until(lambda: srv.client_closed == 1, "the server to see the client leave")
        assert pool_of(b).open == 0
    finally:
        await b.close()


async def test_a_reply_closed_before_its_end_aborts_and_one_read_whole_is_kept(serve):
    async def script(peer: Peer) -> None:
        while True:
            await peer.request()
            await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
            await asyncio.sleep(0.02)
            await peer.send(b"67890")

    srv = await serve(script)
    p = await pool(srv.url)
    try:
        r = await p.send(request())
        assert r.status == 200 and r.header("content-LENGTH") == "10"
        r.close()
        assert p.open == 0
        await wait_until(lambda: srv.ended == 1, "the first connection to end")
        r = await p.send(request())
        assert await r.read() == b"1234567890" and p.idle == 1
        r = await p.send(request())  # the same connection again
        assert await r.read() == b"1234567890" and srv.connections == 2
    finally:
        p.close()


async def test_close_aborts_everything_and_a_closed_backend_starts_again(serve):
    async def script(peer: Peer) -> None:
        while True:
            _, body = await peer.request()
            if b"hold" in body:
                await peer.until_closed()
                return
            await peer.send(reply(OK_JSON))

    srv = await serve(script)
    b = OpenAIBackend(srv.url)
    await asyncio.gather(b.complete("completions", BODY), b.complete("completions", BODY))
    assert pool_of(b).idle == 2
    held = asyncio.create_task(b.complete("completions", {**BODY, "prompt": "hold"}))
    await wait_until(lambda: len(srv.requests) == 3, "the held request")
    assert pool_of(b).open == 2 and pool_of(b).idle == 1
    await b.close()
    with pytest.raises(BackendUnavailable, match="closed by the client"):
        await held
    assert b._pool is None
    await wait_until(lambda: srv.ended == 2, "the server to see both connections end")
    r = await b.complete("completions", BODY)  # starts again
    assert r["choices"][0]["text"] == "hi" and srv.connections == 3
    await b.close()


# ------------------------------------------------------------------ TLS, IPv6, headers
@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate with")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


async def test_https(serve, tls_files):
    cert, key = tls_files
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    srv = await serve(keep_answering, ssl_ctx=server_ctx)
    url = f"https://127.0.0.1:{srv.port}"
    p = await pool(url, ssl_context=ssl.create_default_context(cafile=str(cert)))
    try:
        for _ in range(2):
            r = await p.send(request(host=p.authority))
            assert r.status == 200 and json.loads(await r.read())["choices"][0]["text"] == "hi"
        assert srv.connections == 1
    finally:
        p.close()
    # the backend checks certificates against the system's authorities: this one is refused
    b = OpenAIBackend(url)
    try:
        with pytest.raises(BackendUnavailable, match="cannot connect") as ei:
            await b.complete("completions", BODY)
        assert ei.value.never_sent
        assert pool_of(b).ssl is not None and pool_of(b).ssl.check_hostname
    finally:
        await b.close()


async def test_an_ipv6_literal(serve):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        srv = await serve(keep_answering, host="::1")
    except OSError:
        pytest.skip("no IPv6 loopback")
    b = OpenAIBackend(srv.url)
    try:
        assert (await b.complete("completions", BODY))["choices"][0]["text"] == "hi"
        assert f"Host: [::1]:{srv.port}\r\n".encode() in srv.requests[0][0]
    finally:
        await b.close()


def test_headers_that_would_break_a_request_are_refused():
    for bad, what in (({"X-A": "a\r\nInjected: 1"}, "line break"), ({"Bad Name": "x"}, "not an HTTP token"),
                      ({"Content-Length": "5"}, "framing"), ({"transfer-encoding": "chunked"}, "framing"),
                      ({"X-A": "\u2603"}, "Latin-1")):
        with pytest.raises(ValueError, match=what):
            OpenAIBackend("http://127.0.0.1:1", headers=bad)
    with pytest.raises(ValueError, match="url"):
        OpenAIBackend("http://:80")
    b = OpenAIBackend("http://127.0.0.1:1", headers={"host": "api.example", "User-Agent": "me",
                                                     "content-type": "application/json; charset=utf-8"})
    head = b._heads["completions"]
    assert b"host: api.example\r\n" in head and b"User-Agent: me\r\n" in head
    assert head.lower().count(b"host:") == 1 and head.lower().count(b"content-type:") == 1
    assert b"content-type: application/json; charset=utf-8\r\n" in head
    # credentials in the URL: basic authentication (an api_key's bearer token wins); a path as given
    b = OpenAIBackend("http://us%40er:p%3Ass@127.0.0.1:1/a b/v1")
    assert b"Authorization: Basic dXNAZXI6cDpzcw==\r\n" in b._heads["completions"]  # "us@er:p:ss"
    assert b._heads["completions"].startswith(b"POST /a%20b/v1/completions HTTP/1.1\r\nHost: 127.0.0.1:1\r\n")
    b = OpenAIBackend("http://u:p@127.0.0.1:1", api_key="sk")
    assert b"Authorization: Bearer sk\r\n" in b._heads["completions"] and b"Basic" not in b._heads["completions"]


async def test_a_timeout_is_not_the_callers_timeout_error(serve):
    assert not issubclass(Timeout, TimeoutError) and issubclass(Disconnected, ConnectionError)
