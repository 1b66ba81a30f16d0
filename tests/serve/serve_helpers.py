"""Helpers of the ``sfq serve`` tests: a loopback OpenAI-shaped upstream in a thread, and the
gateway as a real process (``python -m sfq serve``) on loopback.

The upstream's behaviour is chosen per request by its prompt (or last message): ``hold``
waits until the test releases it, ``err500``/``err400``/``err503``/``err429`` answer that
status (``err429-N``: with ``Retry-After: N``), ``echo401`` answers 401 with the request's
headers in its body (as some providers do), ``cut`` sends two stream events then drops the
connection, ``drip`` streams one event per 50 ms, ``partN`` streams N events and then holds
(until released; ``tokens`` counts the events of text written, one token each), ``big`` streams
64 KiB events (``sent`` counts the bytes written), ``huge`` streams one event and then a 200 MiB line; anything else
answers (``max_tokens`` tokens of ``x``). It records every request's body and headers, which
held requests were abandoned by the gateway (``aborted``), and which finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from support.processes import stop_process

UPSTREAM_KEY = "sk-upstream-secret"
LIMIT = 15.0  # seconds: the safety net of every wait in these tests (never a timing check)


def wait_until(cond: Callable[[], Any], what: str, limit: float = LIMIT) -> Any:
    """Poll ``cond`` every 10 ms until truthy; fail naming ``what`` after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _text_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        m = body["messages"]
        return str(m[-1].get("content", "")) if m else ""
    return str(body.get("prompt", ""))


class Upstream:
    """The fake upstream (see the module docstring), on its own event loop in a thread."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any], dict[str, str]]] = []  # (path, body, headers)
        self.arrivals: list[tuple[float, str]] = []  # (time.monotonic() on arrival, text): for counts per window
        self.aborted: list[str] = []  # texts of held requests whose connection the gateway dropped
        self.finished: list[str] = []
        self.holding: list[str] = []
        self.sent: dict[str, int] = {}  # bytes of stream events written so far, by text
        self.tokens: dict[str, int] = {}  # stream events of text (one token each) written so far, by text
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._gate: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="upstream", daemon=True)

    def start(self) -> Upstream:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(LIMIT)
        return self

    async def _start(self) -> None:
        self._gate = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        async def _stop() -> None:
            assert self._runner is not None
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(LIMIT)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(LIMIT)

    def release(self) -> None:
        """Let every held request (now and from now on) answer."""
        def _open() -> None:
            assert self._gate is not None
            self._gate.set()

        self._loop.call_soon_threadsafe(_open)

    def rearm(self) -> None:
        """Hold ``hold`` requests again from now on."""
        def _close() -> None:
            self._gate = asyncio.Event()

        self._loop.call_soon_threadsafe(_close)

    def texts(self) -> list[str]:
        return [_text_of(b) for _, b, _ in list(self.requests)]

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text = _text_of(body)
        self.requests.append((request.path, body, dict(request.headers)))
        self.arrivals.append((time.monotonic(), text))
        chat = request.path.endswith("chat/completions")
        n = int(body.get("max_tokens") or 3)
        usage = {"prompt_tokens": len(text), "completion_tokens": n, "total_tokens": len(text) + n}
        try:
            if text.startswith("echo401"):
                return web.json_response({"error": {"message": f"invalid key; you sent {dict(request.headers)!r}",
                                                    "url": str(request.url)}}, status=401)
            if text.startswith("err"):
                status = int(text[3:6])
                ra = text[7:] if text[6:7] == "-" else "1"
                headers = {"Retry-After": ra} if status == 429 else {}
                return web.json_response({"error": {"message": f"injected {status}"}}, status=status,
                                         headers=headers)
            if text.startswith("hold"):
                self.holding.append(text)
                assert self._gate is not None
                await self._gate.wait()
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                if text.startswith("huge"):  # one event, then a line with no end in 1 MiB pieces
                    await resp.write(b'data: {"id":"up","object":"text_completion","choices":[{"index":0,'
                                     b'"text":"x","finish_reason":null}]}\n\n')
                    piece = b"data: " + b"z" * ((1 << 20) - 6)
                    for _ in range(200):
                        await resp.write(piece)
                        self.sent[text] = self.sent.get(text, 0) + len(piece)
                        piece = b"z" * (1 << 20)
                    await resp.write(b"\n\ndata: [DONE]\n\n")
                    self.finished.append(text)
                    return resp
                part = int(text[4:].split("-", 1)[0]) if text.startswith("part") else None
                for i in range(n):
                    if i == part:
                        self.holding.append(text)
                        assert self._gate is not None
                        await self._gate.wait()
                    if text.startswith("drip"):
                        await asyncio.sleep(0.05)
                    if text.startswith("cut") and i == 2:
                        await asyncio.sleep(0.05)
                        request.transport.close()  # type: ignore[union-attr]
                        return resp
                    piece = "y" * 65536 if text.startswith("big") else "x"
                    delta = {"delta": {"content": piece}} if chat else {"text": piece}
                    ev = {"id": "up", "object": "chat.completion.chunk" if chat else "text_completion",
                          "created": 0, "model": body.get("model"),
                          "choices": [{"index": 0, **delta, "finish_reason": None}]}
                    data = b"data: " + json.dumps(ev).encode() + b"\n\n"
                    await resp.write(data)
                    self.sent[text] = self.sent.get(text, 0) + len(data)
                    self.tokens[text] = self.tokens.get(text, 0) + 1
                if (body.get("stream_options") or {}).get("include_usage"):
                    ev = {"id": "up", "object": "chat.completion.chunk", "created": 0, "model": body.get("model"),
                          "choices": [], "usage": usage}
                    await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
                self.finished.append(text)
                return resp
            if chat:
                choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "x" * n},
                                          "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": "x" * n, "finish_reason": "length"}
            self.finished.append(text)
            return web.json_response({"id": "up", "object": "chat.completion" if chat else "text_completion",
                                      "created": 0, "model": body.get("model"), "choices": [choice],
                                      "usage": usage})
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted.append(text)
            raise


def policy_yaml(upstream_url: str, refused_url: str, *, extra_org: str = "", interactive_weight: int = 4) -> str:
    """The tests' policy: pool ``main`` (model ``m``, the upstream, one request at a time),
    pool ``down`` (model ``gone``, nobody listening)."""
    return f"""\
pools:
  main:
    models: [m]
    backends:
      - {{url: "{upstream_url}", max_in_flight: 1, api_key_env: SFQ_TEST_UPSTREAM_KEY}}
  down:
    models: [gone]
    backends:
      - {{url: "{refused_url}", max_in_flight: 1}}
classes:
  system: {{strict: true, max_in_flight: 1, max_queue_length: 1}}
  interactive: {{weight: {interactive_weight}, max_queue_length: 8}}
  batch: {{weight: 1, max_queue_age_seconds: 30}}
orgs:
  team-a:
    keys: ["sk-a"]
    classes: [interactive, batch, system]
  team-b:
    keys: ["sk-b"]
    classes: [batch]
  limited:
    keys: ["sk-limited"]
    classes: [batch]
    requests_per_minute: 1
{extra_org}retry: {{max_attempts: 2, base_seconds: 0.01, max_seconds: 0.05}}
"""


def make_client(gw: GatewayProcess, key: str = "sk-a") -> Any:
    """The official client against the gateway; ``max_retries=0``: its own retries would hide
    the statuses under test."""
    import openai

    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=LIMIT)


class GatewayProcess:
    """``python -m sfq serve`` on a free loopback port; its stdout (the access log) and stderr
    are collected by reader threads."""

    def __init__(self, config: Path, *, grace: float = 5.0, env: dict[str, str] | None = None,
                 nofile: int | None = None) -> None:
        cmd = [sys.executable, "-m", "sfq", "serve", "--config", str(config), "--port", "0", "--grace", str(grace)]
        full_env = {**os.environ, "SFQ_TEST_UPSTREAM_KEY": UPSTREAM_KEY, **(env or {})}

        def limit() -> None:  # the process's file-descriptor limit (soft and hard), as `ulimit -n` sets it
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env,
                                     preexec_fn=limit if nofile is not None else None)
        self.out: list[str] = []
        self.err: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True).start()
        line = wait_until(lambda: next((x for x in self.err if "listening on http://" in x), None)
                          or (self.proc.poll() is not None and "exited"), "the gateway to listen")
        if line == "exited":
            raise RuntimeError(f"sfq serve exited with {self.proc.returncode}:\n{''.join(self.err)}")
        self.url = line.split("listening on ")[1].split()[0]

    @staticmethod
    def _read(pipe: Any, into: list[str]) -> None:
        for raw in iter(pipe.readline, b""):
            into.append(raw.decode("utf-8", "replace"))

    def access(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in list(self.out) if x.startswith("{")]

    def log_has(self, text: str) -> bool:
        return any(text in x for x in list(self.err))

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def rss(self) -> int:
        """The gateway's resident memory, bytes (from /proc)."""
        with open(f"/proc/{self.proc.pid}/status") as fh:
            return next(int(line.split()[1]) << 10 for line in fh if line.startswith("VmRSS:"))

    def get(self, path: str, key: str | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=LIMIT) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a /metrics sample over the series matching ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families

        _, text = self.get("/metrics")
        total = 0.0
        for fam in text_string_to_metric_families(text.decode()):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def stop(self) -> int:
        return int(stop_process(self.proc) or 0)


def raw_exchange(gw: GatewayProcess, data: bytes, *, limit: float = LIMIT) -> bytes:
    """Send ``data`` on a new connection and read until the gateway closes it (or ``limit``)."""
    import socket

    with socket.create_connection(("127.0.0.1", gw.port), timeout=limit) as s:
        with contextlib.suppress(OSError):
            s.sendall(data)
        return read_until_closed(s, limit)


def read_until_closed(s: Any, limit: float = LIMIT) -> bytes:
    """What the peer sends until it closes (a reset counts as closed), within ``limit`` seconds."""
    got = b""
    s.settimeout(limit)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            piece = s.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            raise AssertionError(f"the gateway kept the connection open past {limit} s; got {got[:300]!r}") from None
        if not piece:
            break
        got += piece
    return got


def parse_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """``(status, headers (lower-case names), body)`` of the first HTTP response in ``data``."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    n = headers.get("content-length")
    return status, headers, body[:int(n)] if n is not None else body


def read_response(s: Any, limit: float = LIMIT) -> bytes:
    """One whole response with a ``Content-Length`` (the connection may stay open)."""
    got = b""
    s.settimeout(limit)
    while True:
        head, sep, body = got.partition(b"\r\n\r\n")
        if sep:
            n = parse_response(got)[1].get("content-length")
            if n is not None and len(body) >= int(n):
                return got
        piece = s.recv(65536)
        if not piece:
            return got
        got += piece


class DemoProcess:
    """``python -m sfq demo-backend`` on a free loopback port (``slots`` requests generate at
    once, ``tokens_per_second`` each): the engine the docs' quick start runs."""

    def __init__(self, *, slots: int = 4, tokens_per_second: float = 50.0) -> None:
        cmd = [sys.executable, "-m", "sfq", "demo-backend", "--port", "0", "--slots", str(slots),
               "--tokens-per-second", str(tokens_per_second)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.err: list[str] = []
        threading.Thread(target=GatewayProcess._read, args=(self.proc.stderr, self.err), daemon=True).start()
        line = wait_until(lambda: next((x for x in self.err if "listening on http://" in x), None)
                          or (self.proc.poll() is not None and "exited"), "the demo engine to listen")
        if line == "exited":
            raise RuntimeError(f"sfq demo-backend exited with {self.proc.returncode}:\n{''.join(self.err)}")
        self.url = line.split("listening on ")[1].split()[0].rstrip(":")

    def stop(self) -> None:
        stop_process(self.proc)
