"""examples/fastapi_proxy.py, run as its users run it (uvicorn, in a process of its own), driven by
the official ``openai`` client against a loopback upstream: a quiet tenant is served while
another floods, a client that leaves while queued (plain or streamed) never reaches the
upstream and leaves no traceback in the server's log, bad bodies are OpenAI-shaped 400s, the
upstream's own 4xx reaches the client in its words, its 5xx and 429 are 502 and 503, and a
streamed request works end to end. Nothing is timed: orders and counts are what the upstream saw."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

import sfq
from support.proxies import Proxy, fake_openai, flood_then_quiet, prompts, running, serving, until

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fastapi_proxy.py"
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.skipif(not EXAMPLE.is_file(), reason="needs the source tree (examples/)")

CONTEXT_LENGTH = {"message": "This model's maximum context length is 8 tokens; the prompt has 12",
                  "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}


def _upstream() -> Any:
    """tests/policy/fake_openai.py's server (by path), answering a prompt that says "too long"
    with an upstream's context-length error."""
    class Upstream(fake_openai()):  # type: ignore[misc]
        async def _complete(self, request: web.Request) -> web.StreamResponse:
            body = await request.json()
            if "too long" in str(body.get("prompt")):
                self.requests.append(body)
                return web.json_response({"error": CONTEXT_LENGTH}, status=400)
            out: web.StreamResponse = await super()._complete(request)
            return out

    return Upstream()


@pytest.fixture
async def upstream() -> AsyncIterator[Any]:
    async with serving(_upstream()) as up:
        yield up


@pytest.fixture
async def proxy(upstream: Any, tmp_path: Path) -> AsyncIterator[Proxy]:
    async with running(EXAMPLE, upstream.url, tmp_path) as p:
        yield p
    text = p.log.read_text()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text


async def test_a_quiet_tenant_is_served_while_another_floods(proxy: Proxy, upstream: Any) -> None:
    await flood_then_quiet(proxy, upstream, 4)
    assert (await proxy.flow("globex/interactive/gpu"))["completed"] == 4


async def test_a_client_that_leaves_while_queued_never_reaches_the_upstream(proxy: Proxy, upstream: Any) -> None:
    upstream.release = asyncio.Event()
    acme, globex = proxy.client("key-acme"), proxy.client("key-globex")
    holder = asyncio.create_task(acme.completions.create(model="m", prompt="holder", max_tokens=2))

    async def holding() -> bool:
        return len(upstream.requests) == 1
    await until(holding, "the first request to hold the slot")

    async def streamed() -> None:
        async for _ in await globex.completions.create(model="m", prompt="leaver 2", max_tokens=2, stream=True):
            pass
    # a plain request (Starlette never cancels its handler) and a stream, both queued
    leavers = [asyncio.create_task(globex.completions.create(model="m", prompt="leaver 1", max_tokens=2)),
               asyncio.create_task(streamed())]

    async def queued() -> bool:
        return await proxy.waiting() == 2
    await until(queued, "both to wait their turn in the proxy")
    for task in leavers:
        task.cancel()  # the clients go away while their requests wait
    await asyncio.gather(*leavers, return_exceptions=True)

    async def withdrawn() -> bool:
        return await proxy.waiting() == 0
    await until(withdrawn, "the proxy to withdraw both")
    upstream.release.set()
    assert (await holder).choices[0].text == "ok"
    after = await globex.completions.create(model="m", prompt="after", max_tokens=2)  # the slot is free
    assert after.choices[0].text == "ok"
    assert prompts(upstream) == ["holder", "after"]  # neither leaver reached it
    flow = await proxy.flow("globex/interactive/gpu")
    assert flow["cancelled_before_start"] == 2 and flow["completed"] == 1
    log = proxy.log.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log


async def test_a_bad_body_is_an_openai_shaped_400(proxy: Proxy, upstream: Any) -> None:
    headers = {"Authorization": "Bearer key-acme", "Content-Type": "application/json"}
    for raw in (b"{not json", b"[1, 2]", b'"hi"', json.dumps({"prompt": "hi", "max_tokens": 2}).encode()):
        async with proxy.http.post(f"{proxy.url}/v1/completions", data=raw, headers=headers) as r:
            assert r.status == 400, raw
            assert r.headers["Content-Type"].startswith("application/json")
            error = (await r.json())["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "bad_request", raw
            assert set(error) == {"message", "type", "param", "code"}
    client = proxy.client("key-acme")
    with pytest.raises(openai.BadRequestError) as info:  # refused by sfq before any byte of the stream
        await client.completions.create(model="m", prompt="hi", max_tokens="abc", stream=True)
    assert info.value.status_code == 400 and "max_tokens" in str(info.value.message)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="gpt-x", prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        await proxy.client("key-nobody").completions.create(model="m", prompt="hi", max_tokens=2)
    assert upstream.requests == []


async def test_an_upstream_4xx_reaches_the_client_in_its_own_words(proxy: Proxy, upstream: Any) -> None:
    client = proxy.client("key-acme")
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model="m", prompt="far too long", max_tokens=2)
    err = info.value
    assert err.status_code == 400 and err.body == CONTEXT_LENGTH  # the upstream's error object, whole
    assert err.code == "context_length_exceeded" and err.param == "prompt"
    ok = await client.completions.create(model="m", prompt="fine", max_tokens=2)  # the backend stays in rotation
    assert ok.choices[0].text == "ok"
    assert (await proxy.stats())["backends"][upstream.url]["healthy"]


async def test_an_upstream_failure_is_a_502_or_503(proxy: Proxy, upstream: Any) -> None:
    """(needs Grant.fail)"""
    client = proxy.client("key-acme")
    upstream.modes.extend(["500", "429"])
    with pytest.raises(openai.InternalServerError) as info:
        await client.completions.create(model="m", prompt="a", max_tokens=2)
    assert info.value.status_code == 502 and info.value.code == "upstream_error"
    with pytest.raises(openai.APIStatusError) as limited:
        await client.completions.create(model="m", prompt="b", max_tokens=2)
    assert limited.value.status_code == 503 and limited.value.response.headers["Retry-After"] == "1"
    assert prompts(upstream) == ["a", "b"]  # never retried by the proxy: it is the embedder's call


async def test_a_streamed_request_works_end_to_end(proxy: Proxy, upstream: Any) -> None:
    for key in ("key-acme", "key-initech"):  # a named org; an org only the template covers
        stream = await proxy.client(key).completions.create(model="m", prompt=f"stream {key}", max_tokens=3,
                                                            stream=True)
        assert [c.choices[0].text async for c in stream if c.choices] == ["t0", "t1", "t2"]
    flows = (await proxy.stats())["flows"]
    assert flows["acme/interactive/gpu"]["completed"] == 1 and flows["initech/interactive/gpu"]["completed"] == 1
    assert all(b.get("stream") for b in upstream.requests) and len(upstream.requests) == 2
