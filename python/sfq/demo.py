"""``sfq demo-backend``: a demo inference engine for trying ``sfq serve`` without a GPU.

**It is not a model.** It answers the OpenAI API the way an inference server does, with
made-up text: a fixed sentence, one word per token, at a steady pace. What it does model is
what a fair queue in front of it is about:

* ``slots`` requests generate at once (continuous batching); more wait inside the engine,
  first come first served, as on a real server;
* a request first "reads" its prompt (``prefill_tokens_per_second``), then streams one token
  every ``1 / tokens_per_second`` seconds, so time to first token and duration are realistic;
* it generates ``max_tokens`` tokens (``default_max_tokens`` when the request sets none) and
  reports ``usage`` (prompt tokens: characters / 4), in the reply, or as a last stream event
  when the request asks for it (``stream_options: {"include_usage": true}``);
* one model name, ``model``; another gets a 404 in OpenAI's error shape.

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (``"stream": true`` too),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (the engine's own counters, in
Prometheus text). A client that disconnects frees its slot at once.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

__all__ = ["DemoConfig", "DemoEngine", "run", "serve"]

#: what the engine "generates", one word per token, over and over
TEXT = ("This is sfq's demo engine, not a model: it makes up text at a steady pace so that "
        "you can watch a fair queue share it. ").split(" ")[:-1]


@dataclass(frozen=True)
class DemoConfig:
    """What the demo engine serves and how fast."""

    model: str = "demo"
    slots: int = 4
    tokens_per_second: float = 50.0
    prefill_tokens_per_second: float = 5000.0
    default_max_tokens: int = 128
    max_tokens_limit: int = 4096

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {self.slots!r}")
        for name in ("tokens_per_second", "prefill_tokens_per_second"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("default_max_tokens", "max_tokens_limit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


class _BadRequest(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _error(status: int, code: str, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


class DemoEngine:
    """The engine behind ``sfq demo-backend``: :attr:`app` is its aiohttp application."""

    def __init__(self, config: DemoConfig | None = None) -> None:
        self.config = config if config is not None else DemoConfig()
        self._slots = asyncio.Semaphore(self.config.slots)
        self.running = 0
        self.waiting = 0
        self.requests_total = 0
        self.tokens_total = 0
        self._ids = 0
        self.app = web.Application(client_max_size=32 * 1024 * 1024)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)

    # ------------------------------------------------------------ routes
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "created": 0, "owned_by": "sfq-demo"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "demo": True, "model": self.config.model,
                                  "running": self.running, "waiting": self.waiting})

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = [
            "# HELP demo_requests_running Requests generating now.", "# TYPE demo_requests_running gauge",
            f"demo_requests_running {self.running}",
            "# HELP demo_requests_waiting Requests waiting for a slot inside the engine.",
            "# TYPE demo_requests_waiting gauge", f"demo_requests_waiting {self.waiting}",
            "# HELP demo_requests_total Requests served.", "# TYPE demo_requests_total counter",
            f"demo_requests_total {self.requests_total}",
            "# HELP demo_tokens_total Tokens generated.", "# TYPE demo_tokens_total counter",
            f"demo_tokens_total {self.tokens_total}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    # ------------------------------------------------------------ generation
    def _parse(self, raw: bytes, chat: bool) -> tuple[dict[str, Any], int, int]:
        try:
            body = json.loads(raw)
        except ValueError:
            raise _BadRequest(400, "invalid_json", "the body is not JSON") from None
        if not isinstance(body, dict):
            raise _BadRequest(400, "invalid_body", "the body must be a JSON object")
        model = body.get("model")
        if model != self.config.model:
            raise _BadRequest(404, "model_not_found",
                              f"this demo engine serves model {self.config.model!r} only, got {model!r}")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise _BadRequest(400, "invalid_messages", "messages must be a non-empty list")
            chars = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else
                        len(json.dumps(m.get("content"))) for m in msgs if isinstance(m, dict))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list):
                prompt = "".join(p for p in prompt if isinstance(p, str))
            if not isinstance(prompt, str):
                raise _BadRequest(400, "invalid_prompt", "prompt must be a string")
            chars = len(prompt)
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        if mt is None:
            mt = self.config.default_max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise _BadRequest(400, "invalid_max_tokens", f"max_tokens must be an integer >= 1, got {mt!r}")
        if mt > self.config.max_tokens_limit:
            raise _BadRequest(400, "invalid_max_tokens",
                              f"max_tokens must be at most {self.config.max_tokens_limit}, got {mt}")
        return body, max(1, math.ceil(chars / 4)), mt

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body, prompt_tokens, n = self._parse(await request.read(), chat)
        except _BadRequest as exc:
            return _error(exc.status, exc.code, exc.message)
        stream = bool(body.get("stream"))
        so = body.get("stream_options")
        include_usage = isinstance(so, dict) and bool(so.get("include_usage"))
        self._ids += 1
        rid = f"{'chatcmpl' if chat else 'cmpl'}-demo-{self._ids}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        cfg = self.config
        loop = asyncio.get_running_loop()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            self.requests_total += 1
            t0 = loop.time() + prompt_tokens / cfg.prefill_tokens_per_second
            if not stream:
                await asyncio.sleep(max(0.0, t0 + n / cfg.tokens_per_second - loop.time()))
                self.tokens_total += n
                text = "".join(self._word(i) for i in range(n))
                choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                           "finish_reason": "length"} if chat else
                                          {"index": 0, "text": text, "finish_reason": "length"})
                return web.json_response({"id": rid, "object": obj, "created": created, "model": cfg.model,
                                          "choices": [choice], "usage": usage})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"

            async def send(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> None:
                doc = {"id": rid, "object": chunk_obj, "created": created, "model": cfg.model, "choices": choices}
                if extra:
                    doc.update(extra)
                await resp.write(b"data: " + json.dumps(doc).encode() + b"\n\n")

            if chat:
                await send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            for i in range(n):
                await asyncio.sleep(max(0.0, t0 + (i + 1) / cfg.tokens_per_second - loop.time()))
                last = i == n - 1
                word = self._word(i)
                piece: dict[str, Any] = ({"index": 0, "delta": {"content": word}} if chat else
                                         {"index": 0, "text": word})
                piece["finish_reason"] = "length" if last else None
                await send([piece])
                self.tokens_total += 1
            if include_usage:
                await send([], {"usage": usage})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.running -= 1
            self._slots.release()

    @staticmethod
    def _word(i: int) -> str:
        return ("" if i == 0 else " ") + TEXT[i % len(TEXT)]


async def serve(config: DemoConfig | None = None, *, host: str = "127.0.0.1", port: int = 8001,
                ready: asyncio.Future[tuple[str, int]] | None = None, stop: asyncio.Event | None = None) -> None:
    """Run the demo engine until SIGTERM/SIGINT (or ``stop`` is set)."""
    engine = DemoEngine(config)
    loop = asyncio.get_running_loop()
    stop = stop if stop is not None else asyncio.Event()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass
    runner = web.AppRunner(engine.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    try:
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
        c = engine.config
        print(f"sfq demo-backend: a DEMO engine, not a model (it makes up text); listening on "
              f"http://{bound[0]}:{bound[1]}: model {c.model!r}, {c.slots} slots, "
              f"{c.tokens_per_second:g} tokens/s per request", file=sys.stderr, flush=True)
        if ready is not None and not ready.done():
            ready.set_result((bound[0], bound[1]))
        await stop.wait()
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await runner.cleanup()


def run(config: DemoConfig | None = None, *, host: str = "127.0.0.1", port: int = 8001) -> int:
    """``sfq demo-backend``'s entry point: 0 after SIGTERM/SIGINT, 2 when the address cannot be bound."""
    try:
        asyncio.run(serve(config, host=host, port=port))
    except OSError as exc:
        print(f"sfq demo-backend: {exc}", file=sys.stderr)
        return 2
    return 0
