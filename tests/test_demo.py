"""``sfq demo-backend``: the demo engine speaks the OpenAI API over real loopback HTTP."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from sfq.demo import DemoConfig, DemoEngine

FAST = DemoConfig(model="demo", slots=2, tokens_per_second=2000.0)


async def _server(cfg: DemoConfig = FAST) -> tuple[DemoEngine, TestServer]:
    engine = DemoEngine(cfg)
    server = TestServer(engine.app)
    await server.start_server()
    return engine, server


async def test_completion_and_chat_replies_report_usage():
    engine, server = await _server()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(server.make_url("/v1/completions"),
                              json={"model": "demo", "prompt": "x" * 40, "max_tokens": 5}) as r:
                doc = await r.json()
            assert r.status == 200 and doc["object"] == "text_completion"
            assert doc["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
            assert len(doc["choices"][0]["text"].split(" ")) == 5
            async with s.post(server.make_url("/v1/chat/completions"),
                              json={"model": "demo", "messages": [{"role": "user", "content": "Hi"}]}) as r:
                doc = await r.json()
            assert doc["choices"][0]["message"]["role"] == "assistant"
            assert doc["usage"]["completion_tokens"] == FAST.default_max_tokens
            async with s.get(server.make_url("/v1/models")) as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["demo"]
            async with s.get(server.make_url("/health")) as r:
                assert (await r.json())["demo"] is True
    finally:
        await server.close()


async def test_a_stream_sends_one_event_per_token_then_usage_then_done():
    engine, server = await _server()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(server.make_url("/v1/chat/completions"), json={
                    "model": "demo", "stream": True, "max_tokens": 4, "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": "Hi"}]}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        docs = [json.loads(e) for e in events[:-1]]
        words = [d["choices"][0]["delta"].get("content") for d in docs if d["choices"]]
        assert words[0] == "" and len(words[1:]) == 4  # the role event, then one event per token
        assert docs[-1]["choices"] == [] and docs[-1]["usage"]["completion_tokens"] == 4
        assert engine.tokens_total == 4
    finally:
        await server.close()


@pytest.mark.parametrize("body, status, code", [
    ({"model": "other", "prompt": "x"}, 404, "model_not_found"),
    ({"model": "demo", "prompt": "x", "max_tokens": 0}, 400, "invalid_max_tokens"),
    ({"model": "demo", "prompt": 3}, 400, "invalid_prompt"),
])
async def test_bad_requests_get_openai_shaped_errors(body, status, code):
    engine, server = await _server()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(server.make_url("/v1/completions"), json=body) as r:
                doc = await r.json()
        assert r.status == status and doc["error"]["code"] == code
        assert engine.requests_total == 0
    finally:
        await server.close()


async def test_at_most_slots_requests_generate_at_once():
    engine, server = await _server(DemoConfig(slots=2, tokens_per_second=200.0))
    seen: list[int] = []
    try:
        async with aiohttp.ClientSession() as s:
            async def one() -> None:
                async with s.post(server.make_url("/v1/completions"),
                                  json={"model": "demo", "prompt": "x", "max_tokens": 6}) as r:
                    assert r.status == 200

            async def watch() -> None:
                while True:
                    seen.append(engine.running)
                    await asyncio.sleep(0.005)

            w = asyncio.ensure_future(watch())
            await asyncio.gather(*(one() for _ in range(5)))
            w.cancel()
        assert max(seen) == 2 and engine.requests_total == 5 and engine.running == 0 and engine.waiting == 0
    finally:
        await server.close()


@pytest.mark.parametrize("kw, msg", [
    ({"slots": 0}, "slots must be an integer >= 1, got 0"),
    ({"tokens_per_second": float("nan")}, "tokens_per_second must be a finite number > 0"),
    ({"model": ""}, "model must be a non-empty string"),
])
def test_bad_config_is_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        DemoConfig(**kw)
