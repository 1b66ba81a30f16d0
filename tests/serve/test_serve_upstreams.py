"""Misbehaving upstreams behind a real ``sfq serve`` process, with the official ``openai``
client: a backend that answers 500 to everything beside a healthy one (every request served,
the broken one out of rotation), an upstream that hangs (the pool's ``timeouts`` from the
policy file), a ``Retry-After: 3600`` (the pause capped at 60 s), and an upstream 4xx (a
context-length error reaches the client, redacted; a 401 does not)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from serve_helpers import LIMIT, GatewayProcess, Upstream, make_client, wait_until


class Broken:
    """A loopback upstream that answers every request with ``status`` (and ``headers``, and
    ``body``: default ``{"error": {"message": "broken (<status>)"}}``), on its own event loop
    in a thread; ``hits`` counts the requests it got."""

    def __init__(self, status: int, headers: dict[str, str] | None = None,
                 body: dict[str, Any] | None = None) -> None:
        self.status = status
        self.headers = headers or {}
        self.body = body
        self.hits = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> Broken:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(LIMIT)
        return self

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_get("/health", self._answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def _answer(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            self.hits += 1
        body = self.body if self.body is not None else {"error": {"message": f"broken ({self.status})"}}
        return web.json_response(body, status=self.status, headers=self.headers)

    def stop(self) -> None:
        async def _stop() -> None:
            assert self._runner is not None
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(LIMIT)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(LIMIT)


def _policy(backends: list[str], *, timeouts: str = "", slots: int = 2) -> str:
    lines = "\n".join(f'      - {{url: "{u}", max_in_flight: {slots}}}' for u in backends)
    t = f"\n    timeouts: {timeouts}" if timeouts else ""
    return f"""\
pools:
  main:
    models: [m]
    backends:
{lines}{t}
classes:
  batch: {{weight: 1}}
orgs:
  team-a: {{keys: ["sk-a"], classes: [batch]}}
  team-b: {{keys: ["sk-b"], classes: [batch]}}
retry: {{max_attempts: 3, budget_per_flow_percent: 100, base_seconds: 0.01, max_seconds: 0.05}}
"""


@pytest.fixture
def broken500() -> Iterator[Broken]:
    b = Broken(500).start()
    yield b
    b.stop()


def _health(gw: GatewayProcess) -> dict[str, Any]:
    status, body = gw.get("/health")
    return json.loads(body)


def test_a_backend_that_answers_500_beside_a_healthy_one(broken500: Broken, gate: Upstream, tmp_path: Path) -> None:
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(_policy([broken500.url, gate.url]))
    gw = GatewayProcess(cfg)
    try:
        clients = [make_client(gw, "sk-a"), make_client(gw, "sk-b")]
        for i in range(20):
            reply = clients[i % 2].completions.create(model="m", prompt=f"ok-{i}", max_tokens=2)
            assert reply.choices[0].text == "xx"  # retried on the healthy backend: nobody saw the 500
        wait_until(lambda: _health(gw)["backends"][broken500.url]["healthy"] is False,
                   "the broken backend to leave rotation")
        assert broken500.hits < 20
        # a stream too: retried before its first event, on the healthy one
        events = list(clients[0].completions.create(model="m", prompt="s", max_tokens=3, stream=True))
        assert "".join(e.choices[0].text for e in events if e.choices) == "xxx"
    finally:
        gw.stop()


def test_an_upstream_that_hangs_is_bounded_by_the_pools_timeouts(gate: Upstream, tmp_path: Path) -> None:
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(_policy([gate.url], timeouts="{first_byte: 0.5}"))
    gw = GatewayProcess(cfg)
    try:
        client = make_client(gw)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="m", prompt="hold-hang", max_tokens=1)
        assert info.value.status_code == 503 and info.value.code == "upstream_timeout"
        wait_until(lambda: "hold-hang" in gate.aborted, "the upstream call to be aborted")
        assert gate.texts().count("hold-hang") == 1  # a read timeout is not retried
        assert _health(gw)["pools"]["main"]["in_flight"] == 0
    finally:
        gw.stop()


def test_a_retry_after_of_an_hour_pauses_at_most_a_minute(tmp_path: Path) -> None:
    slow = Broken(429, {"Retry-After": "3600"}).start()
    try:
        cfg = tmp_path / "policy.yaml"
        cfg.write_text(_policy([slow.url]))
        gw = GatewayProcess(cfg)
        try:
            client = make_client(gw)
            with pytest.raises(openai.InternalServerError) as info:  # its deadline is shorter than any pause
                client.completions.create(model="m", prompt="x", max_tokens=1, extra_headers={"X-SFQ-Timeout": "5"})
            assert info.value.status_code == 503
            paused = _health(gw)["pools"]["main"]["backends"][slow.url]["paused_for"]
            assert 0 < paused <= 60
            assert slow.hits == 1
        finally:
            gw.stop()
    finally:
        slow.stop()


CONTEXT_ERROR = {"error": {
    "message": "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 "
               "tokens (key sk-abcdefgh1234567, server http://10.0.0.5:8000).",
    "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}
KEY_ERROR = {"error": {"message": "Incorrect API key provided: sk-abcdefgh1234567 (http://10.0.0.5:8000)",
                       "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


def test_an_upstream_4xx_reaches_the_client_redacted_but_a_401_does_not(tmp_path: Path) -> None:
    too_long = Broken(400, body=CONTEXT_ERROR).start()
    refused = Broken(401, body=KEY_ERROR).start()
    try:
        cfg = tmp_path / "policy.yaml"
        cfg.write_text(f"""\
pools:
  long:
    models: [m]
    backends: [{{url: "{too_long.url}", max_in_flight: 2}}]
  keyed:
    models: [k]
    backends: [{{url: "{refused.url}", max_in_flight: 2}}]
classes:
  batch: {{weight: 1}}
orgs:
  team-a: {{keys: ["sk-a"], classes: [batch]}}
retry: {{max_attempts: 3, base_seconds: 0.01, max_seconds: 0.05}}
""")
        gw = GatewayProcess(cfg)
        try:
            client = make_client(gw)
            messages: Any = [{"role": "user", "content": "a very long conversation"}]
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as info:
                    client.chat.completions.create(model="m", messages=messages, max_tokens=4, stream=stream)
                e = info.value
                assert (e.status_code, e.code, e.param, e.type) == (400, "context_length_exceeded", "messages",
                                                                    "invalid_request_error")
                assert isinstance(e.body, dict)
                message = e.body["message"]
                assert message.startswith("This model's maximum context length is 8192 tokens.")
                assert "sk-abcdefgh1234567" not in str(e.body) and "10.0.0.5" not in str(e.body)
                assert "http://" not in message and "[redacted]" in message

                with pytest.raises(openai.InternalServerError) as bad_gateway:  # the gateway's key: not the client's
                    client.chat.completions.create(model="k", messages=messages, max_tokens=4, stream=stream)
                e = bad_gateway.value
                assert e.status_code == 502 and e.code == "upstream_error"
                assert "sk-abcdefgh1234567" not in str(e.body) and "Incorrect API key" not in str(e.body)
                assert "10.0.0.5" not in str(e.body)
            assert too_long.hits == 2 and refused.hits == 2  # neither retried
            assert all(b["healthy"] for b in _health(gw)["backends"].values())
        finally:
            gw.stop()
    finally:
        too_long.stop()
        refused.stop()
