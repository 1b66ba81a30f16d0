"""Helpers of the shared-state tests: a real ``redis-server`` on a free loopback port, a
loopback upstream (in a thread) that counts how many requests it holds at once, and
``sfq serve`` as real processes.

Every wait is bounded (:func:`wait_until`); nothing here measures time to pass or fail a test.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

LIMIT = 20.0  # seconds: the safety net of every wait (never a timing check)
REDIS = shutil.which("redis-server") or (
    "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(cond: Callable[[], Any], what: str, limit: float = LIMIT) -> Any:
    deadline = time.monotonic() + limit
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class RedisServer:
    """``redis-server --port N --save "" --appendonly no`` (nothing persists: a restart is empty)."""

    def __init__(self, port: int | None = None) -> None:
        assert REDIS is not None
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen([REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.ping, "redis-server to answer")
        return self

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(LIMIT)
        self.proc = None


class Upstream:
    """An OpenAI-shaped upstream on loopback, in its own thread. Each request waits
    ``delay`` seconds (or until :meth:`release` when ``hold`` is set) and answers; it records
    how many it holds at once (``peak``) and how many each key's flow got (``served``, by the
    prompt's first word)."""

    def __init__(self, delay: float = 0.02) -> None:
        self.delay = delay
        self.now = 0
        self.peak = 0
        self.total = 0
        self.served: Counter[str] = Counter()
        self.order: list[str] = []
        self.url = ""
        self._gate: asyncio.Event | None = None
        self.hold = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None

    def start(self) -> Upstream:
        ready = threading.Event()

        def main() -> None:
            loop = self._loop = asyncio.new_event_loop()
            loop.run_until_complete(self._start())
            ready.set()
            loop.run_forever()

        threading.Thread(target=main, daemon=True).start()
        ready.wait(LIMIT)
        return self

    async def _start(self) -> None:
        self._gate = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    def release(self) -> None:
        assert self._loop is not None and self._gate is not None
        self.hold = False
        self._loop.call_soon_threadsafe(self._gate.set)

    def stop(self) -> None:
        if self._loop is not None:
            async def _stop() -> None:
                assert self._runner is not None
                await self._runner.cleanup()
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(LIMIT)
            self._loop.call_soon_threadsafe(self._loop.stop)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = str(body.get("prompt", ""))
        self.now += 1
        self.total += 1
        self.peak = max(self.peak, self.now)
        try:
            if self.hold:
                assert self._gate is not None
                await self._gate.wait()
            elif self.delay:
                await asyncio.sleep(self.delay)
        finally:
            self.now -= 1
        who = text.split(" ")[0]
        self.served[who] += 1
        self.order.append(who)
        n = int(body.get("max_tokens") or 1)
        return web.json_response({"id": "up", "object": "text_completion", "created": 0, "model": body.get("model"),
                                  "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": 1 + n}})


def policy_yaml(upstream_url: str, redis_url: str | None, *, pool_limit: int = 4, lease: float = 2.0,
                prefix: str = "sfq-test:", pool_extra: str = "", orgs_extra: str = "",
                backend_limit: int = 64, a_rpm: str = "") -> str:
    state = "" if redis_url is None else (
        f'state: {{redis: "{redis_url}", prefix: "{prefix}", lease_seconds: {lease}}}\n')
    return f"""\
pools:
  main:
    models: [m]
    backends:
      - {{url: "{upstream_url}", max_in_flight: {backend_limit}}}
    limits: {{max_in_flight: {pool_limit}{pool_extra}}}
classes:
  batch: {{weight: 1, max_queue_age_seconds: 60}}
orgs:
  team-a:
    keys: ["sk-a"]
    classes: [batch]
{a_rpm}  team-b:
    keys: ["sk-b"]
    classes: [batch]
{orgs_extra}{state}"""


class Gateway:
    """``python -m sfq serve`` on a free loopback port (its stderr collected)."""

    def __init__(self, config: Path, *, wait: bool = True) -> None:
        cmd = [sys.executable, "-m", "sfq", "serve", "--config", str(config), "--port", "0", "--grace", "2",
               "--access-log", "off"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = ""
        if wait:
            line = wait_until(lambda: next((x for x in self.err if "listening on http://" in x), None)
                              or (self.proc.poll() is not None and "exited"), "the gateway to listen")
            if line == "exited":
                time.sleep(0.2)
                raise RuntimeError(f"sfq serve exited with {self.proc.returncode}:\n{''.join(self.err)}")
            self.url = line.split("listening on ")[1].split()[0]

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            self.err.append(raw.decode("utf-8", "replace"))

    def post(self, key: str, prompt: str, timeout: float = LIMIT) -> tuple[int, dict[str, Any]]:
        data = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=data, method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def health(self) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=LIMIT) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(LIMIT)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(LIMIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(LIMIT)
        return self.proc.returncode
