"""Identity the embedder owns, end to end through ``PolicyDispatcher`` and a loopback server:
an org without keys is served when the embedder names it, every org the file does not name
gets the template's settings (its own limits, not a share of one), and without a template
such an org is refused with a 403 that names it."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import AsyncIterator

import pytest
from fake_openai import FakeOpenAI

import sfq
from sfq.policy import Policy, parse_policy


def _policy(url: str, template: str = "") -> Policy:
    return parse_policy(textwrap.dedent(f"""\
        pools:
          gpu:
            models: [m]
            backends: [{{url: "{url}", max_in_flight: 4}}]
        classes:
          interactive: {{weight: 1}}
        orgs:
          acme: {{classes: [interactive]}}
        """) + template)


@pytest.fixture
async def upstream() -> AsyncIterator[FakeOpenAI]:
    up = FakeOpenAI()
    await up.start()
    yield up
    if up.release is not None:
        up.release.set()
    await up.stop()


async def _until(cond, what: str, limit: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def _body(prompt: str, **kw: object) -> dict[str, object]:
    return {"model": "m", "prompt": prompt, "max_tokens": 2, **kw}


async def test_an_org_without_keys_is_served_when_the_embedder_names_it(upstream: FakeOpenAI) -> None:
    async with sfq.PolicyDispatcher(_policy(upstream.url)) as pd:
        flow = sfq.Flow("acme", "interactive", "gpu")
        reply = await pd.submit_flow(flow, _body("plain"))
        assert reply["choices"][0]["text"] == "ok"
        async with pd.stream_flow(flow, _body("streamed", stream=True)) as events:
            texts = [e["choices"][0]["text"] async for e in events if e.get("choices")]
        assert texts == ["t0", "t1"]
        with pytest.raises(sfq.Refused) as info:  # no key reaches it: the gateway cannot authenticate it
            await pd.submit("acme", _body("by key"))
        assert info.value.http_status == 401
        assert pd.stats()["flows"]["acme/interactive/gpu"]["completed"] == 2


async def test_without_a_template_an_unnamed_org_is_a_403_naming_it(upstream: FakeOpenAI) -> None:
    async with sfq.PolicyDispatcher(_policy(upstream.url)) as pd:
        for call in (lambda: pd.submit_flow(sfq.Flow("initech", "interactive", "gpu"), _body("x")),
                     lambda: pd.open_stream(sfq.Flow("initech", "interactive", "gpu"),
                                            _body("x", stream=True)).__aenter__()):
            with pytest.raises(sfq.Refused) as info:
                await call()
            exc = info.value
            assert exc.http_status == 403 and "'initech'" in str(exc)
            assert "Bearer" not in str(exc) and "acme" not in str(exc)  # no gateway wording, no other tenant
            assert exc.to_openai()["error"]["type"] == "permission_error"
    assert upstream.requests == []


async def test_template_orgs_get_limits_of_their_own(upstream: FakeOpenAI) -> None:
    upstream.release = asyncio.Event()
    policy = _policy(upstream.url, "org_template: {classes: [interactive], max_in_flight: 1}\n")
    async with sfq.PolicyDispatcher(policy) as pd:
        tasks = [asyncio.create_task(pd.submit_flow(sfq.Flow(org, "interactive", "gpu"), _body(f"{org} {i}")))
                 for org in ("initech", "hooli") for i in range(2)]
        # one each at a time (the backend has 4 slots): the template's limit is per org, not shared
        await _until(lambda: len(upstream.requests) == 2, "one request of each template org to start")
        await asyncio.sleep(0.05)
        assert sorted(str(b["prompt"]).split()[0] for b in upstream.requests) == ["hooli", "initech"]
        upstream.release.set()
        await asyncio.gather(*tasks)
        assert upstream.max_running == 2 and len(upstream.requests) == 4
        flows = pd.stats()["flows"]
        assert flows["initech/interactive/gpu"]["completed"] == 2 and flows["hooli/interactive/gpu"]["completed"] == 2
        assert pd.policy.org("initech") is pd.policy.org("initech")


async def test_template_orgs_get_rates_of_their_own(upstream: FakeOpenAI) -> None:
    policy = _policy(upstream.url, "org_template: {classes: [interactive], requests_per_minute: 1}\n")
    async with sfq.PolicyDispatcher(policy) as pd:
        await pd.submit_flow(sfq.Flow("initech", "interactive", "gpu"), _body("first"))
        with pytest.raises(sfq.Refused) as info:
            await pd.submit_flow(sfq.Flow("initech", "interactive", "gpu"), _body("second"))
        assert info.value.reason == "rate_limited" and info.value.http_status == 429
        assert info.value.retry_after is not None and info.value.retry_after > 0
        await pd.submit_flow(sfq.Flow("hooli", "interactive", "gpu"), _body("another org"))  # its own bucket
    assert [b["prompt"] for b in upstream.requests] == ["first", "another org"]
