"""The backends' own HTTP/1.1 client (``sfq.backends._http``) against loopback servers that
write exact bytes: bodies by length, chunked (split at awkward places) and to the close;
keep-alive and ``Connection: close``; a server that goes silent, resets, or closes an idle
connection; back-pressure on a reader that does not keep up."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from sfq.backends import OpenAIBackend
from sfq.backends._http import HIGH_WATER, ConnectFailed, HTTPPool
from sfq.errors import BackendRateLimited, BackendTimeout, BackendUnavailable, StreamInterrupted

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.AbstractServer, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _read_request(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":")[1])
    return head + await r.readexactly(n)


def _request(pool: HTTPPool, body: bytes = b"{}") -> bytes:
    return pool.head("POST", "/v1/completions", b"Content-Type: application/json\r\n", len(body)) + body


async def test_lengths_chunks_and_close_delimited_bodies() -> None:
    replies = [
        [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel", b"lo"],
        [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r", b"\nabc\r\n", b"2\r\nde\r\n0\r\n", b"\r\n"],
        [b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nto the ", b"end"],
    ]
    seen: list[int] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        seen.append(1)
        while replies:
            await _read_request(r)
            parts = replies.pop(0)
            for p in parts:
                w.write(p)
                await w.drain()
                await asyncio.sleep(0.01)
            if b"Connection: close" in parts[0]:
                w.close()
                return
        w.close()

    server, url = await _serve(handler)
    pool = HTTPPool(url, connect_timeout=5, keepalive_timeout=5)
    try:
        got = []
        for _ in range(3):
            reply = await pool.request(_request(pool))
            got.append(await reply.read())
            reply.release()
        assert got == [b"hello", b"abcde", b"to the end"]
        assert len(seen) == 1  # one kept-alive connection for the first two; the third ended it
        assert not pool.idle  # the server said close
    finally:
        pool.close()
        server.close()


async def test_a_connection_closed_while_idle_is_not_reused() -> None:
    conns = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        w.close()  # closes the kept-alive connection without saying so

    server, url = await _serve(handler)
    pool = HTTPPool(url, connect_timeout=5, keepalive_timeout=5)
    try:
        for _ in range(3):
            reply = await pool.request(_request(pool))
            assert await reply.read() == b"ok"
            reply.release()
            await asyncio.sleep(0.05)  # the close reaches the idle connection
        assert conns == 3
    finally:
        pool.close()
        server.close()


async def test_refused_silent_and_reset_servers() -> None:
    pool = HTTPPool("http://127.0.0.1:9", connect_timeout=5, keepalive_timeout=5)
    with pytest.raises(ConnectFailed):
        await pool.request(_request(pool))

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        await asyncio.sleep(5)

    server, url = await _serve(silent)
    pool = HTTPPool(url, connect_timeout=5, keepalive_timeout=5)
    try:
        with pytest.raises(asyncio.TimeoutError):
            await pool.request(_request(pool), head_within=0.2)
        with pytest.raises(asyncio.TimeoutError):
            await pool.request(_request(pool), read_timeout=0.2)
        assert not pool.idle and not pool.busy  # both connections aborted
    finally:
        pool.close()
        server.close()

    async def reset(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
        await w.drain()
        w.transport.abort()

    server, url = await _serve(reset)
    pool = HTTPPool(url, connect_timeout=5, keepalive_timeout=5)
    try:
        reply = await pool.request(_request(pool))
        with pytest.raises(ConnectionResetError):
            await reply.read()
        reply.close()
    finally:
        pool.close()
        server.close()


async def test_a_reader_that_does_not_keep_up_stops_the_connection_reading() -> None:
    sent = 0
    done = asyncio.Event()

    async def flood(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal sent
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"x" * 65536
        try:
            for _ in range(200):  # 12.5 MiB, far past what the client may hold
                w.write(b"10000\r\n" + piece + b"\r\n")
                await asyncio.wait_for(w.drain(), 0.5)
                sent += len(piece)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        done.set()

    server, url = await _serve(flood)
    pool = HTTPPool(url, connect_timeout=5, keepalive_timeout=5)
    try:
        reply = await pool.request(_request(pool))
        await asyncio.wait_for(done.wait(), 10)  # the server is blocked: nobody reads
        conn = reply._conn
        assert conn.paused and conn.buffered <= HIGH_WATER + 65536
        assert sent < 200 * 65536
        got = 0
        for _ in range(40):  # reading resumes the connection
            piece = await reply.next_piece()
            assert piece is not None
            got += len(piece)
        assert got > HIGH_WATER
        reply.close()
    finally:
        pool.close()
        server.close()


async def test_the_backend_maps_the_client_s_failures() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            try:
                req = await _read_request(r)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if b'"429"' in req:
                w.write(b"HTTP/1.1 429 Too Many\r\nRetry-After: 7\r\nContent-Length: 4\r\n\r\nslow")
            elif b'"cut"' in req:
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"1a\r\ndata: {\"choices\": []}\n\n\r\n")
                await w.drain()
                w.transport.abort()
                return
            else:
                body = b'{"choices":[{"text":"ok"}],"usage":{"completion_tokens":1}}'
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await w.drain()

    server, url = await _serve(handler)
    b = OpenAIBackend(url)
    try:
        assert (await b.complete("completions", {"prompt": "x"}))["usage"]["completion_tokens"] == 1
        with pytest.raises(BackendRateLimited) as e:
            await b.complete("completions", {"prompt": "429"})
        assert e.value.retry_after == 7.0 and e.value.headers["Retry-After"] == "7" and e.value.body == "slow"
        with pytest.raises(StreamInterrupted) as cut:
            async for _ in b.stream("completions", {"prompt": "cut"}):
                pass
        assert cut.value.unhealthy
        assert (await b.complete("completions", {"prompt": "x"}))["choices"][0]["text"] == "ok"
    finally:
        await b.close()
        server.close()
    with pytest.raises(BackendUnavailable) as down:
        await OpenAIBackend("http://127.0.0.1:9").complete("completions", {"prompt": "x"})
    assert down.value.never_sent
    server2, url2 = await _serve(lambda r, w: asyncio.sleep(5))
    slow = OpenAIBackend(url2, timeout=0.2)
    try:
        with pytest.raises(BackendTimeout):
            await slow.complete("completions", {"prompt": "x"})
    finally:
        await slow.close()
        server2.close()


def test_headers_that_would_break_the_head_are_refused() -> None:
    with pytest.raises(ValueError, match="X-Bad"):
        OpenAIBackend("http://127.0.0.1:9", headers={"X-Bad": "a\r\nInjected: 1"})
