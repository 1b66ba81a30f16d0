"""The access log's writer (``sfq.serve.accesslog``): one line per request under a burst, the
same line the logging path writes, nothing lost at shutdown or exit, a reader that stops
reading never blocks the event loop (the buffer is capped, its losses counted and reported),
and an embedder's own handlers still get ordinary records."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from serve_helpers import LIMIT, GatewayProcess, Upstream, policy_yaml, wait_until

from sfq.serve import ACCESS_LOGGER, Gateway, configure_logging
from sfq.serve import accesslog
from sfq.serve.accesslog import AccessLog, AccessLogHandler, direct
from sfq.serve.edge import EdgeSite


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """``configure_logging`` changes the process's loggers: put them back afterwards."""
    saved = {}
    for name in ("sfq", ACCESS_LOGGER):
        lg = logging.getLogger(name)
        saved[name] = (list(lg.handlers), lg.level, lg.propagate)
    try:
        yield
    finally:
        for name, (handlers, level, propagate) in saved.items():
            lg = logging.getLogger(name)
            for h in lg.handlers:
                if h not in handlers:
                    h.close()
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate = propagate


def _access_writer() -> AccessLog:
    w = direct(logging.getLogger(ACCESS_LOGGER))
    assert w is not None
    return w


async def _post(s: aiohttp.ClientSession, url: str, key: str, prompt: str) -> tuple[int, str]:
    async with s.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1},
                      headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        return r.status, r.headers["x-request-id"]


async def test_a_burst_gets_one_line_per_request(upstream: Upstream, refused_url: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch, logging_restored: None):
    """400 requests at once (completed, queued, refused, unauthenticated): the file holds
    exactly one line per request, each naming its request id and the status its client got,
    more than ``FLUSH_BYTES`` of them written within single event-loop iterations."""
    monkeypatch.setenv("SFQ_TEST_UPSTREAM_KEY", "sk-upstream-secret")
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(upstream.url, refused_url))
    log_path = tmp_path / "access.log"
    configure_logging(str(log_path), stream=sys.stderr)
    gw = Gateway(cfg)
    from aiohttp import web

    runner = web.AppRunner(gw.app, handler_cancellation=True, access_log=None, lingering_time=0)
    await runner.setup()
    site = EdgeSite(runner, gw.edge, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=LIMIT * 4)) as s:
            keys = ["sk-a", "sk-b", "sk-nobody", "sk-limited"]
            got = await asyncio.gather(*(_post(s, url, keys[i % 4], f"burst-{i}") for i in range(400)))
        await asyncio.sleep(0)  # the iteration's flush
        await asyncio.sleep(0)
        lines = [json.loads(x) for x in log_path.read_text().splitlines()]
        assert len(lines) == 400
        assert sorted((x["request_id"], x["status"]) for x in lines) == sorted((rid, st) for st, rid in got)
        statuses = {st for st, _ in got}
        assert 200 in statuses and 401 in statuses and 429 in statuses  # every kind of line is in there
        assert log_path.stat().st_size > accesslog.FLUSH_BYTES
        assert _access_writer().dropped == 0
    finally:
        await runner.cleanup()
        await gw.pd.close()


def _entry() -> Any:
    from types import SimpleNamespace

    from sfq.serve.app import _Entry

    e = _Entry(100.0, "/v1/chat/completions", "rid-1")
    e.flow = ("acme", "interactive", "main")
    e.model, e.status, e.stream, e.events, e.error_status = "m", 200, True, 7, 502
    e.usage = {"prompt_tokens": 3, "completion_tokens": 2 ** 70}  # over 64 bits: orjson's fallback
    e.r = SimpleNamespace(flow=e.flow, outcome="completed", reason=None, tries=2, cost=1.5, charged_total=3.0,
                          backend="b", started_at=100.25, arrival=100.0)
    return e


async def test_the_line_is_the_logging_paths_line(tmp_path: Path, logging_restored: None):
    """The buffered line and the record an embedder's handler gets say the same, key for key
    and in the same order."""
    from sfq.policy import parse_policy

    gw = Gateway(parse_policy('pools: {main: {models: [m], backends: [{url: "http://127.0.0.1:9"}]}}\n'
                              'classes: {interactive: {}}\norgs: {acme: {keys: [k], classes: [interactive]}}\n'))
    log_path = tmp_path / "access.log"
    configure_logging(str(log_path), stream=sys.stderr)
    e = _entry()
    writer = _access_writer()
    gw._log(e, 100.5)
    writer.flush()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    acc = logging.getLogger(ACCESS_LOGGER)
    acc.addHandler(Keep())  # an embedder's handler next to ours: records again, for both
    assert direct(acc) is None
    gw._log(e, 100.5)
    writer.flush()
    buffered, through_logging = log_path.read_text().splitlines()
    assert [json.loads(r.getMessage()) for r in records] == [json.loads(through_logging)]
    a, b = json.loads(buffered, object_pairs_hook=list), json.loads(through_logging, object_pairs_hook=list)
    assert [k for k, _ in a] == [k for k, _ in b] == [
        "ts", "request_id", "path", "status", "org", "class", "pool", "model", "stream", "outcome", "reason", "wait",
        "queue_wait", "tries", "backend", "cost_charged", "prompt_tokens", "completion_tokens", "duration", "events",
        "error_status"]
    assert [kv for kv in a if kv[0] != "ts"] == [kv for kv in b if kv[0] != "ts"]
    assert dict(a)["completion_tokens"] == 2 ** 70 and dict(a)["wait"] == 0.25 and dict(a)["cost_charged"] == 3.0
    assert dict(a)["queue_wait"] == 0.25  # (from admission to the start: the same as its answer's header said)


async def test_off_builds_no_line(logging_restored: None, monkeypatch: pytest.MonkeyPatch):
    from sfq.policy import parse_policy
    from sfq.serve import app

    gw = Gateway(parse_policy('pools: {main: {models: [m], backends: [{url: "http://127.0.0.1:9"}]}}\n'
                              'classes: {interactive: {}}\norgs: {acme: {keys: [k], classes: [interactive]}}\n'))
    configure_logging("off", stream=sys.stderr)

    def no_clock() -> float:
        raise AssertionError("a line was built with the access log off")

    monkeypatch.setattr(app.time, "time", no_clock)
    gw._log(_entry(), 100.5)
    assert logging.getLogger(ACCESS_LOGGER).handlers == []


def _pipe(size: int = 4096) -> tuple[int, int]:
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, size)
    return r, w


def _run_on(kind: str, coro: Any) -> None:
    """``coro`` on asyncio's own loop or on uvloop's (what ``sfq serve`` runs on when installed)."""
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(coro)
    else:
        asyncio.run(coro)


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_reader_that_stops_reading_never_blocks_the_loop(loop_kind: str, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture):
    """The pipe fills; the loop goes on (it is the loop that later drains the pipe); past the
    cap new lines are dropped and counted, one warning while it lasts and one tally when the
    buffer is written; every line that was kept arrives whole and in order."""
    monkeypatch.setattr(accesslog, "WARN_EVERY", 1e9)  # one warning per episode, however slow the machine
    _run_on(loop_kind, _stalled_reader(caplog))


async def _stalled_reader(caplog: pytest.LogCaptureFixture) -> None:
    r, w = _pipe()
    sink = accesslog._sink_of_fd(w, "test-pipe", owned=False)
    assert sink.fd != w and os.get_blocking(w) and not os.get_blocking(sink.fd)  # its own description only
    writer = AccessLog(sink, max_buffer=16384, flush_bytes=1024)
    # a safety net: a writer that blocked the loop would never let this test read; closing the
    # read end then fails its writes instead of hanging
    watchdog = threading.Timer(LIMIT, os.close, (r,))
    watchdog.start()
    try:
        with caplog.at_level(logging.WARNING, logger="sfq.serve"):
            for i in range(1000):
                writer.write(b"%04d %s\n" % (i, b"x" * 94))  # 100 bytes a line
                if i % 10 == 9:
                    await asyncio.sleep(0)
            held = writer.buffered
            assert 16384 <= held < 16384 + 100
            dropped = writer.dropped
            assert dropped > 700
            warnings = [x for x in caplog.records if "dropped" in x.getMessage()]
            assert len(warnings) == 1 and "not keeping up" in warnings[0].getMessage()
            # now read: the loop's wait for writability drains the buffer
            data = bytearray()
            loop = asyncio.get_running_loop()
            done = asyncio.Event()

            def readable() -> None:
                data.extend(os.read(r, 65536))
                if writer.buffered == 0 and data.endswith(b"\n") and len(data) % 100 == 0:
                    done.set()

            loop.add_reader(r, readable)
            try:
                await asyncio.wait_for(done.wait(), LIMIT)
            finally:
                loop.remove_reader(r)
        lines = bytes(data).splitlines(keepends=True)
        assert all(len(x) == 100 for x in lines)
        assert [int(x[:4]) for x in lines] == list(range(len(lines)))  # the first ones, whole, in order
        assert len(lines) + dropped == 1000 and writer.dropped == dropped
        tally = [x for x in caplog.records if "dropped" in x.getMessage()][1:]
        assert len(tally) == 1 and f"({dropped} in all)" in tally[0].getMessage()
    finally:
        watchdog.cancel()
        writer.close()
        os.close(w)
        os.close(r)


async def test_a_reader_that_goes_away_is_reported_once(caplog: pytest.LogCaptureFixture):
    r, w = _pipe()
    writer = AccessLog(accesslog._sink_of_fd(w, "test-pipe", owned=True))
    writer.write(b"first\n")
    await asyncio.sleep(0)
    assert os.read(r, 100) == b"first\n"
    os.close(r)
    with caplog.at_level(logging.WARNING, logger="sfq.serve"):
        for _ in range(50):
            writer.write(b"later\n")
            await asyncio.sleep(0)
    errors = [x for x in caplog.records if x.levelno == logging.ERROR and "test-pipe" in x.getMessage()]
    assert len(errors) == 1
    assert writer.dropped == 50 and writer.buffered == 0
    writer.close()


async def test_a_stream_socket_is_written_without_blocking():
    a, b = socket.socketpair()
    try:
        writer = AccessLog(accesslog._sink_of_fd(a.fileno(), "test-socket", owned=False))
        assert isinstance(writer._sink, accesslog._SocketSink) and a.getblocking()
        for i in range(3):
            writer.write(b"line %d\n" % i)
        await asyncio.sleep(0)
        assert b.recv(100) == b"line 0\nline 1\nline 2\n"
        writer.close()
    finally:
        a.close()
        b.close()


_EXIT_SCRIPT = """
import asyncio, logging, sys
from sfq.serve import configure_logging
from sfq.serve.accesslog import direct
configure_logging(sys.argv[1])
w = direct(logging.getLogger("sfq.serve.access"))

def burst(first, n):
    for i in range(first, first + n):
        w.write(b'{"n": %d}\\n' % i)

def last_iteration(first, n):
    # lines written in a loop's last iteration: the flush they schedule never runs
    loop = asyncio.new_event_loop()
    loop.call_soon(burst, first, n)
    loop.call_soon(loop.stop)
    loop.run_forever()
    loop.close()

last_iteration(0, 3000)
print(sum(1 for _ in open(sys.argv[1])), flush=True)  # (not written yet)

async def more():
    burst(3000, 2)  # a new loop: the writer schedules its flush on this one
    await asyncio.sleep(0)

asyncio.run(more())
print(sum(1 for _ in open(sys.argv[1])), flush=True)
last_iteration(3002, 1000)  # and the process exits with these in the buffer
"""


def test_lines_left_in_the_buffer_are_written_at_exit(tmp_path: Path):
    path = tmp_path / "access.log"
    p = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(path)], capture_output=True, text=True,
                       timeout=LIMIT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0", "3002"]
    assert [json.loads(x)["n"] for x in path.read_text().splitlines()] == list(range(4002))


_STDOUT_SCRIPT = """
import logging, os, sys
from sfq.serve import configure_logging
from sfq.serve.accesslog import direct
configure_logging("-")
w = direct(logging.getLogger("sfq.serve.access"))
fd = w._sink.fd
print(os.get_blocking(1), fd == 1, os.get_blocking(fd), file=sys.stderr)
w.write(b"one line\\n")
"""


@pytest.mark.parametrize("to", ["pipe", "file"])
def test_stdout_keeps_its_flags(to: str, tmp_path: Path):
    """A pipe gets a non-blocking description of the writer's own (the process's stdout, which
    a shell may share, stays blocking); a regular file is written as it is."""
    out = tmp_path / "out.log"
    with open(out, "wb") as fh:
        p = subprocess.run([sys.executable, "-c", _STDOUT_SCRIPT], stdout=subprocess.PIPE if to == "pipe" else fh,
                           stderr=subprocess.PIPE, timeout=LIMIT)
    assert p.returncode == 0, p.stderr
    stdout = p.stdout if to == "pipe" else out.read_bytes()
    assert stdout == b"one line\n"
    assert p.stderr.split() == ([b"True", b"False", b"False"] if to == "pipe" else [b"True", b"True", b"True"])


def test_sigterm_keeps_every_line(gate: Upstream, refused_url: str, tmp_path: Path):
    """A real ``sfq serve`` with a burst behind it: 30 requests waiting, one running, when
    SIGTERM comes (the waiting ones answered 503 while it drains, the running one finishing):
    every request, and the ones before, has its line on stdout when the process has exited."""
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(gate.url, refused_url))
    gw = GatewayProcess(cfg, grace=LIMIT)
    try:
        async def run() -> list[tuple[int, str]]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=LIMIT * 2)) as s:
                before = await asyncio.gather(*(_post(s, gw.url, "sk-b", f"early-{i}") for i in range(100)))
                held = asyncio.ensure_future(_post(s, gw.url, "sk-b", "hold-s"))
                await asyncio.to_thread(wait_until, lambda: "hold-s" in gate.holding, "the held request to run")
                waiting = [asyncio.ensure_future(_post(s, gw.url, "sk-b", f"wait-{i}")) for i in range(30)]
                await asyncio.to_thread(wait_until, lambda: gw.metric("sfq_queue_length", org="team-b") == 30,
                                        "30 requests to wait")
                gw.signal(signal.SIGTERM)
                refused = await asyncio.gather(*waiting)
                gate.release()
                return [*before, await held, *refused]

        got = asyncio.run(run())
        assert gw.proc.wait(LIMIT) == 0
        statuses = [st for st, _ in got]
        assert statuses == [200] * 101 + [503] * 30
        wait_until(lambda: len(gw.access()) >= len(got), "every line to be read")
        lines = gw.access()
        assert sorted((x["request_id"], x["status"]) for x in lines) == sorted((rid, st) for st, rid in got)
    finally:
        gw.stop()


def test_reconfiguring_flushes_and_closes_the_writer_before(tmp_path: Path, logging_restored: None):
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    configure_logging(str(first), stream=sys.stderr)
    w = _access_writer()
    w.write(b"kept\n")  # no loop: written at once
    w._buf += b"buffered\n"  # as a loop's iteration leaves it before its flush
    configure_logging(str(second), stream=sys.stderr)
    assert first.read_text() == "kept\nbuffered\n"
    assert w._sink.fd is None  # closed
    w.write(b"late\n")
    assert w.dropped == 1 and first.read_text() == "kept\nbuffered\n"
    handlers = logging.getLogger(ACCESS_LOGGER).handlers
    assert len(handlers) == 1 and isinstance(handlers[0], AccessLogHandler) and handlers[0].writer is not w
    logging.getLogger(ACCESS_LOGGER).info("through logging")
    configure_logging("off", stream=sys.stderr)
    assert second.read_text() == "through logging\n"


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="max_buffer"):
        accesslog.open_access_log("-", max_buffer=0)
    with pytest.raises(ValueError, match="flush_bytes"):
        accesslog.open_access_log("-", flush_bytes=True)


async def test_a_shared_pipe_is_written_in_whole_lines_of_at_most_pipe_buf(tmp_path: Path):
    """``shared=True`` (``sfq serve --workers``): each write to a pipe holds whole lines and at
    most ``PIPE_BUF`` bytes, so that POSIX writes it whole, never split by another process's
    write; a line longer than that is written alone. A regular file is written as before."""
    fifo = tmp_path / "access.fifo"
    os.mkfifo(fifo)
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        writer = accesslog.open_access_log(str(fifo), shared=True)
        assert writer.chunk == accesslog.PIPE_BUF
        writes: list[bytes] = []
        sink = writer._sink
        real = sink.write

        def record(data: bytes | bytearray) -> int:
            n = real(data)
            writes.append(bytes(data[:n]))
            return n

        sink.write = record  # type: ignore[method-assign]
        lines = [b'{"n":%d,"pad":"%s"}\n' % (i, b"x" * (i * 37 % 900)) for i in range(300)]
        lines.insert(150, b'{"long":"%s"}\n' % (b"y" * (accesslog.PIPE_BUF + 100)))
        for x in lines:
            writer.write(x)
        got = bytearray()
        want = sum(map(len, lines))
        for _ in range(10_000):  # the pipe holds 64 KiB: read as the writer waits for room
            await asyncio.sleep(0)
            try:
                got += os.read(r, 1 << 16)
            except BlockingIOError:
                pass
            if len(got) == want:
                break
        assert bytes(got) == b"".join(lines)
        assert len(writes) > 1
        for w in writes:
            assert w.endswith(b"\n") and (len(w) <= accesslog.PIPE_BUF or w.count(b"\n") == 1), len(w)
        writer.close()
    finally:
        os.close(r)
    with open(tmp_path / "file.log", "wb"):
        pass
    assert accesslog.open_access_log(str(tmp_path / "file.log"), shared=True).chunk is None  # (one write a batch)
    r2, w2 = _pipe()
    try:
        assert AccessLog(accesslog._sink_of_fd(w2, "p", owned=False)).chunk is None  # not shared: as before
    finally:
        os.close(r2)
        os.close(w2)


_SHARED_SCRIPT = """
import asyncio, logging, sys
from sfq.serve import configure_logging
from sfq.serve.accesslog import direct
configure_logging("-", shared=True)
w = direct(logging.getLogger("sfq.serve.access"))
tag = sys.argv[1].encode()

async def main():
    for burst in range(30):
        for i in range(300):
            w.write(b'{"p":"%s","n":%d,"pad":"%s"}\\n' % (tag, burst * 300 + i, tag * (50 + i % 400)))
        await asyncio.sleep(0)

asyncio.run(main())
"""


def test_two_processes_on_one_pipe_never_split_each_others_lines():
    """Two writers with ``shared=True`` on the same stdout pipe, in bursts of ~75 KB (more than
    the pipe holds, so writes wait for room and resume): every line arrives whole."""
    r, w = os.pipe()
    try:
        procs = [subprocess.Popen([sys.executable, "-c", _SHARED_SCRIPT, tag], stdout=w, stderr=subprocess.PIPE)
                 for tag in ("a", "b")]
    finally:
        os.close(w)
    out = bytearray()
    with os.fdopen(r, "rb") as fh:
        for chunk in iter(lambda: fh.read1(1 << 12), b""):  # a slow reader: the pipe stays nearly full
            out += chunk
            time.sleep(0.0002)
    for p in procs:
        assert p.wait(LIMIT) == 0, p.stderr.read() if p.stderr else ""
        if p.stderr:
            p.stderr.close()
    lines = bytes(out).split(b"\n")
    assert lines[-1] == b""
    seen = {"a": [], "b": []}  # type: dict[str, list[int]]
    for x in lines[:-1]:
        d = json.loads(x)
        assert d["pad"] == d["p"] * len(d["pad"]), x[:80]
        seen[d["p"]].append(d["n"])
    assert seen == {"a": list(range(9000)), "b": list(range(9000))}
