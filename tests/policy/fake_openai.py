"""A small OpenAI-shaped loopback server for the policy's asyncio tests (aiohttp).

``mode`` is the default behaviour, ``modes`` (a deque) overrides it for the next requests:
``ok`` (after ``delay`` seconds), ``429`` (``Retry-After: retry_after``), ``503``, ``500``,
``400``, ``hang`` (never answers until the client goes away), ``stall`` (a stream sends one
chunk, then nothing until the client goes away). ``release`` (an asyncio.Event), when set,
holds every ``ok`` reply until it is set. Streams send ``max_tokens`` chunks (one per
``event_delay`` seconds) then usage. ``headers`` records each request's headers.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Any

from aiohttp import web


class FakeOpenAI:
    def __init__(self) -> None:
        self.mode = "ok"
        self.modes: deque[str] = deque()
        self.delay = 0.0
        self.retry_after = "1"
        self.release: asyncio.Event | None = None
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.event_delay = 0.0
        self.times: list[float] = []  # loop time each request arrived
        self.running = 0
        self.max_running = 0
        self.disconnects = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "data": []})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        self.times.append(asyncio.get_running_loop().time())
        mode = self.modes.popleft() if self.modes else self.mode
        if mode == "429":
            return web.json_response({"error": {"message": "slow down"}}, status=429,
                                     headers={"Retry-After": self.retry_after})
        if mode in ("503", "500", "400"):
            return web.json_response({"error": {"message": "unavailable"}}, status=int(mode))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if mode == "hang":
                await asyncio.Event().wait()
            if self.release is not None:
                await self.release.wait()
            if self.delay:
                await asyncio.sleep(self.delay)
            n = int(body.get("max_tokens", 4))
            prompt = str(body.get("prompt", body.get("messages", "")))
            usage = {"prompt_tokens": max(1, len(prompt) // 4), "completion_tokens": n,
                     "total_tokens": max(1, len(prompt) // 4) + n}
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for i in range(n):
                    if self.event_delay and i:
                        await asyncio.sleep(self.event_delay)
                    chunk = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": f"t{i}"}]}
                    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    if mode == "stall":
                        await asyncio.Event().wait()
                await resp.write(f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n".encode())
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            return web.json_response({"id": "x", "object": "text_completion", "model": body.get("model"),
                                      "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                                      "usage": usage})
        except asyncio.CancelledError:
            self.disconnects += 1
            raise
        finally:
            self.running -= 1
