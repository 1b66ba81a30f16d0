"""examples/proxy.py, run as its users run it, driven by the official ``openai`` client against
a loopback upstream: a streamed bad request is a 400 JSON error (not a 200 and a cut stream),
a queued stream whose client leaves never reaches the upstream, two tenants get their shares
while one floods, and orgs the policy file gives no key (or only its template) are served."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import sfq
from support.proxies import Proxy, fake_openai, flood_then_quiet, prompts, running, serving, until

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "proxy.py"
openai = pytest.importorskip("openai")

pytestmark = [
    pytest.mark.skipif(not EXAMPLE.is_file(), reason="needs the source tree (examples/)"),
    pytest.mark.skipif(not hasattr(sfq.PolicyDispatcher, "open_stream"),
                       reason="needs PolicyDispatcher.acquire and open_stream"),
]


@pytest.fixture
async def upstream() -> AsyncIterator[Any]:
    async with serving(fake_openai()()) as up:
        yield up


@pytest.fixture
async def proxy(upstream: Any, tmp_path: Path) -> AsyncIterator[Proxy]:
    async with running(EXAMPLE, upstream.url, tmp_path) as p:
        yield p


async def test_a_streamed_bad_request_is_a_400_before_any_byte(proxy: Proxy, upstream: Any) -> None:
    client = proxy.client("key-acme")
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model="m", prompt="hi", max_tokens="abc", stream=True)  # type: ignore[arg-type]
    err = info.value
    assert err.status_code == 400
    assert err.response.headers["content-type"].startswith("application/json")
    body = err.body if isinstance(err.body, dict) else {}
    assert body.get("code") == "bad_request" and body.get("type") == "invalid_request_error"
    assert "max_tokens" in str(body.get("message"))
    with pytest.raises(openai.AuthenticationError):  # the proxy's own users: an unknown key is a 401
        await proxy.client("key-nobody").completions.create(model="m", prompt="hi", max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="served model"):
        await client.completions.create(model="gpt-x", prompt="hi", max_tokens=2, stream=True)
    assert upstream.requests == []


async def test_a_queued_stream_whose_client_leaves_never_reaches_the_upstream(proxy: Proxy, upstream: Any) -> None:
    upstream.release = asyncio.Event()  # the only slot stays busy until released
    acme, globex = proxy.client("key-acme"), proxy.client("key-globex")
    holder = asyncio.create_task(acme.completions.create(model="m", prompt="holder", max_tokens=2))

    async def holding() -> bool:
        return len(upstream.requests) == 1
    await until(holding, "the first request to hold the slot")

    async def leave() -> None:
        stream = await globex.completions.create(model="m", prompt="leaver", max_tokens=2, stream=True)
        async for _ in stream:
            pass
    leaver = asyncio.create_task(leave())

    async def queued() -> bool:
        return await proxy.waiting() == 1
    await until(queued, "the stream to wait its turn in the proxy")
    leaver.cancel()  # the client goes away while its stream waits
    with pytest.raises(asyncio.CancelledError):
        await leaver

    async def withdrawn() -> bool:
        return await proxy.waiting() == 0
    await until(withdrawn, "the proxy to withdraw the stream")
    upstream.release.set()
    assert (await holder).choices[0].text == "ok"
    after = await globex.completions.create(model="m", prompt="after", max_tokens=2)  # the slot is free
    assert after.choices[0].text == "ok"
    assert prompts(upstream) == ["holder", "after"]  # "leaver" never reached it
    flow = (await proxy.stats())["flows"]["globex/interactive/gpu"]
    assert flow["cancelled_before_start"] == 1 and flow["completed"] == 1


async def test_two_tenants_get_their_shares_while_one_floods(proxy: Proxy, upstream: Any) -> None:
    await flood_then_quiet(proxy, upstream, 8)
    flows = (await proxy.stats())["flows"]
    assert flows["acme/interactive/gpu"]["completed"] == 24 and flows["globex/interactive/gpu"]["completed"] == 8


async def test_orgs_without_keys_and_template_orgs_are_served(proxy: Proxy, upstream: Any) -> None:
    for key in ("key-acme", "key-initech"):  # a named org without keys; an org only the template covers
        client = proxy.client(key)
        reply = await client.completions.create(model="m", prompt=f"plain {key}", max_tokens=3)
        assert reply.choices[0].text == "ok" and reply.usage is not None and reply.usage.completion_tokens == 3
        stream = await client.completions.create(model="m", prompt=f"stream {key}", max_tokens=3, stream=True)
        texts = [c.choices[0].text async for c in stream if c.choices]
        assert texts == ["t0", "t1", "t2"]
    flows = (await proxy.stats())["flows"]
    assert flows["acme/interactive/gpu"]["completed"] == 2
    assert flows["initech/interactive/gpu"]["completed"] == 2
    assert prompts(upstream) == ["plain key-acme", "stream key-acme", "plain key-initech", "stream key-initech"]
