"""Helpers of the shared-state tests: a real ``redis-server`` on a free loopback port, a
loopback upstream (in a thread) that counts how many requests it holds at once, and
``sfq serve`` as real processes (the processes: ``tests/support/processes.py``, re-exported).

Every wait is bounded (:func:`wait_until`); nothing here measures time to pass or fail a test.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aiohttp import web

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

# the processes live in the shared support package (tests/support/processes.py); re-exported here
from support.processes import LIMIT, REDIS, Gateway, RedisServer, free_port, wait_until  # noqa: E402,F401


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
        self.arrivals: list[tuple[float, str]] = []  # (time.monotonic() on arrival, prompt): for counts per window
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

    def rearm(self) -> None:
        """Hold every request from now on, until the next :meth:`release` (after one already)."""
        assert self._loop is not None

        async def _close() -> None:
            self._gate = asyncio.Event()
            self.hold = True
        asyncio.run_coroutine_threadsafe(_close(), self._loop).result(LIMIT)

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
        self.arrivals.append((time.monotonic(), text))
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
                backend_limit: int = 64, a_rpm: str = "", on_loss: str = "local") -> str:
    state = "" if redis_url is None else (
        f'state: {{redis: "{redis_url}", prefix: "{prefix}", lease_seconds: {lease}, on_loss: {on_loss}}}\n')
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
