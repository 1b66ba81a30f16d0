"""PolicyDispatcher end to end against loopback fake OpenAI servers (aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import pytest
from fake_openai import FakeOpenAI
from prometheus_client import generate_latest

from sfq.backends.health import HealthOptions
from sfq.errors import BackendHTTPError, DeadlineExceeded, Refused
from sfq.dispatch import PolicyDispatcher
from sfq.policy import parse_policy

BODY = {"model": "m", "prompt": "hello there", "max_tokens": 4}


def make_policy(urls: list[str], *, slots: int = 4, org_limit: int | None = None, extra: str = "",
                classes: str = "") -> str:
    backends = "\n".join(f'      - {{url: "{u}", max_in_flight: {slots}}}' for u in urls)
    lim = f", max_in_flight: {org_limit}" if org_limit else ""
    classes = classes or "  interactive: {weight: 4}\n  batch: {weight: 1}"
    return f"""
pools:
  p:
    models: [m]
    backends:
{backends}
classes:
{classes}
orgs:
  a: {{keys: [ka], classes: [batch, interactive]{lim}}}
  b: {{keys: [kb], classes: [interactive]}}
retry: {{max_attempts: 3, budget_per_flow_percent: 50, base_seconds: 0.01, max_seconds: 0.05}}
{extra}
"""


@pytest.fixture
async def server() -> AsyncIterator[FakeOpenAI]:
    s = FakeOpenAI()
    await s.start()
    yield s
    await s.stop()


@contextlib.asynccontextmanager
async def policy_dispatcher(text: str, **kw: object) -> AsyncIterator[PolicyDispatcher]:
    pd = PolicyDispatcher(parse_policy(text), rng=random.Random(1),
                          health=HealthOptions(backoff=0.05, max_backoff=0.1), **kw)  # type: ignore[arg-type]
    async with pd:
        yield pd


async def test_submit_classifies_and_counts(server: FakeOpenAI) -> None:
    async with policy_dispatcher(make_policy([server.url])) as pd:
        reply = await pd.submit("ka", BODY, cls="interactive")
        assert reply["choices"][0]["text"] == "ok"
        st = pd.stats()
        row = st["flows"]["a/interactive/p"]
        assert row["completed"] == 1 and row["in_flight"] == 0 and row["waiting"] == 0
        assert row["served_cost"] > 0 and row["charged_cost"] > 0
        text = generate_latest(pd.registry).decode()
        assert 'sfq_requests_total{class="interactive",org="a",outcome="completed",pool="p"} 1.0' in text
        assert "sfq_queue_wait_seconds_bucket" in text and "sfq_in_flight" in text and "sfq_queue_length" in text


async def test_refusals(server: FakeOpenAI) -> None:
    async with policy_dispatcher(make_policy([server.url])) as pd:
        for key, cls, body, reason in (("nope", None, BODY, "unauthenticated"),
                                       ("kb", "batch", BODY, "class_not_allowed"),
                                       ("ka", None, {**BODY, "model": "other"}, "unknown_model"),
                                       ("ka", None, {"model": "m"}, "bad_request")):
            with pytest.raises(Refused) as info:
                await pd.submit(key, body, cls=cls)
            assert info.value.reason == reason
        assert server.requests == []
        st = pd.stats()
        assert st["unclassified"]["//"]["reasons"] == {"unauthenticated": 1}
        assert st["flows"]["a/batch/p"]["reasons"] == {"bad_request": 1}


async def test_org_limit_holds_at_the_server(server: FakeOpenAI) -> None:
    server.release = asyncio.Event()
    async with policy_dispatcher(make_policy([server.url], slots=8, org_limit=2)) as pd:
        tasks = [asyncio.create_task(pd.submit("ka", BODY)) for _ in range(5)]
        tasks += [asyncio.create_task(pd.submit("kb", BODY)) for _ in range(3)]
        for _ in range(200):
            await asyncio.sleep(0.01)
            if server.running == 5:
                break
        assert server.running == 5  # a: 2 (its limit), b: 3 — a held back does not block b
        server.release.set()
        await asyncio.gather(*tasks)
        assert pd.stats()["flows"]["a/batch/p"]["completed"] == 5


async def test_429_with_retry_after_is_retried_in_its_flow(server: FakeOpenAI) -> None:
    server.modes.extend(["429"])
    server.retry_after = "0"
    async with policy_dispatcher(make_policy([server.url])) as pd:
        reply = await pd.submit("kb", BODY)
        assert reply["choices"]
        row = pd.stats()["flows"]["b/interactive/p"]
        assert row["upstream_429"] == 1 and row["retries"] == 1 and row["attempts"] == 2 and row["completed"] == 1


async def test_5xx_retried_as_clients_do(server: FakeOpenAI) -> None:
    server.modes.extend(["503", "500"])
    async with policy_dispatcher(make_policy([server.url])) as pd:
        reply = await pd.submit("kb", BODY)  # 503 then 500: retried (the OpenAI client's and Envoy's rule)
        assert reply["choices"] and len(server.requests) == 3
        row = pd.stats()["flows"]["b/interactive/p"]
        assert row["completed"] == 1 and row["retries"] == 2


async def test_max_attempts(server: FakeOpenAI) -> None:
    server.mode = "503"
    async with policy_dispatcher(make_policy([server.url])) as pd:
        with pytest.raises(BackendHTTPError):
            await pd.submit("kb", BODY)
        assert len(server.requests) == 3  # max_attempts 3 counts the first try


async def test_deadline_before_start_and_while_running(server: FakeOpenAI) -> None:
    server.release = asyncio.Event()
    async with policy_dispatcher(make_policy([server.url], slots=1)) as pd:
        first = asyncio.create_task(pd.submit("kb", BODY, timeout=0.3))
        await asyncio.sleep(0.05)
        with pytest.raises(Refused) as info:
            await pd.submit("kb", BODY, timeout=0.1)  # waits behind the first, never starts
        assert info.value.reason == "deadline"
        with pytest.raises(DeadlineExceeded):
            await first  # running when its deadline ran out: aborted
        for _ in range(100):
            if server.disconnects:
                break
            await asyncio.sleep(0.01)
        assert server.disconnects == 1 and len(server.requests) == 1
        row = pd.stats()["flows"]["b/interactive/p"]
        assert row["refused"] == 1 and row["failed"] == 1 and row["timeouts"] == 2 and row["in_flight"] == 0


async def test_queue_age(server: FakeOpenAI) -> None:
    server.release = asyncio.Event()
    classes = "  interactive: {weight: 1, max_queue_age_seconds: 0.1}\n  batch: {weight: 1}"
    async with policy_dispatcher(make_policy([server.url], slots=1, classes=classes)) as pd:
        first = asyncio.create_task(pd.submit("kb", BODY))
        await asyncio.sleep(0.02)
        with pytest.raises(Refused) as info:
            await pd.submit("kb", BODY)
        assert info.value.reason == "queue_timeout"
        server.release.set()
        await first


async def test_cancel_before_and_during(server: FakeOpenAI) -> None:
    server.release = asyncio.Event()
    async with policy_dispatcher(make_policy([server.url], slots=1)) as pd:
        running = asyncio.create_task(pd.submit("kb", BODY))
        waiting = asyncio.create_task(pd.submit("kb", BODY))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        for _ in range(100):
            if server.disconnects:
                break
            await asyncio.sleep(0.01)
        assert len(server.requests) == 1 and server.disconnects == 1
        row = pd.stats()["flows"]["b/interactive/p"]
        assert row["cancelled_before_start"] == 1 and row["cancelled_during_execution"] == 1
        assert row["in_flight"] == 0 and row["waiting"] == 0
        server.release.set()
        assert (await pd.submit("kb", BODY))["choices"]  # the slot was freed


async def test_stream(server: FakeOpenAI) -> None:
    async with policy_dispatcher(make_policy([server.url])) as pd:
        events = [e async for e in pd.stream("kb", {**BODY, "stream": True, "max_tokens": 5})]
        assert [e["choices"][0]["text"] for e in events] == [f"t{i}" for i in range(5)]  # usage-only chunk held back
        row = pd.stats()["flows"]["b/interactive/p"]
        assert row["completed"] == 1 and row["served_cost"] > 0
        asked = [e async for e in pd.stream("kb", {**BODY, "stream": True, "max_tokens": 2,
                                                   "stream_options": {"include_usage": True}})]
        assert asked[-1]["usage"]["completion_tokens"] == 2


async def test_idempotency_key_joins_a_running_request(server: FakeOpenAI) -> None:
    server.release = asyncio.Event()
    async with policy_dispatcher(make_policy([server.url])) as pd:
        t1 = asyncio.create_task(pd.submit("kb", BODY, idempotency_key="same"))
        await asyncio.sleep(0.05)
        t2 = asyncio.create_task(pd.submit("kb", BODY, idempotency_key="same"))
        t3 = asyncio.create_task(pd.submit("ka", BODY, idempotency_key="same"))  # another org: its own
        await asyncio.sleep(0.05)
        server.release.set()
        r1, r2, r3 = await asyncio.gather(t1, t2, t3)
        assert r1 == r2 and len(server.requests) == 2


async def test_close_refuses_waiting(server: FakeOpenAI) -> None:
    server.release = asyncio.Event()
    pd = PolicyDispatcher(parse_policy(make_policy([server.url], slots=1)),
                          close_grace=0.2)
    await pd.start()
    running = asyncio.create_task(pd.submit("kb", BODY))
    waiting = asyncio.create_task(pd.submit("kb", BODY))
    await asyncio.sleep(0.05)
    await pd.close()
    with pytest.raises(Refused) as info:
        await waiting
    assert info.value.reason == "closed"
    with pytest.raises(BaseException):
        await running
    assert not pd.engine.live
    with pytest.raises(Refused):
        await pd.submit("kb", BODY)


async def test_a_429_pauses_only_its_backend() -> None:
    busy, calm = FakeOpenAI(), FakeOpenAI()
    await busy.start()
    await calm.start()
    try:
        busy.modes.extend(["429"])
        busy.retry_after = "3"
        async with policy_dispatcher(make_policy([busy.url, calm.url], slots=1)) as pd:
            first = asyncio.create_task(pd.submit("kb", BODY))  # busy answers 429: paused 3 s, retried >= 3 s later
            for _ in range(100):
                if len(busy.requests):
                    break
                await asyncio.sleep(0.01)
            replies = await asyncio.gather(*(pd.submit("kb", BODY) for _ in range(4)))
            assert all(r["choices"] for r in replies)
            assert len(busy.requests) == 1 and len(calm.requests) == 4  # the rest of the fleet kept serving
            assert pd.stats()["pools"]["p"]["backends"][busy.url]["paused_for"] <= 3
            assert (await first)["choices"]
            retried_at = max(busy.times[1:] + calm.times)  # the retry is the last request anywhere
            assert retried_at - busy.times[0] >= 3.0  # it waited at least the upstream's Retry-After
            row = pd.stats()["flows"]["b/interactive/p"]
            assert row["upstream_429"] == 1 and row["retries"] == 1 and row["completed"] == 5
    finally:
        await busy.stop()
        await calm.stop()


async def test_a_backend_that_refuses_connections(server: FakeOpenAI) -> None:
    import socket

    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with policy_dispatcher(make_policy([dead, server.url], slots=2)) as pd:
        replies = await asyncio.gather(*(pd.submit("kb", BODY) for _ in range(4)))
        assert all(r["choices"] for r in replies) and len(server.requests) == 4
        row = pd.stats()["flows"]["b/interactive/p"]
        assert row["completed"] == 4 and row["failed"] == 0 and row["retries"] >= 1
        assert pd.stats()["pools"]["p"]["backends"][dead]["healthy"] is False


async def test_close_ends_a_request_waiting_to_be_retried(server: FakeOpenAI) -> None:
    server.modes.extend(["429"])
    server.retry_after = "3600"
    pd = PolicyDispatcher(parse_policy(make_policy([server.url])))
    await pd.start()
    task = asyncio.create_task(pd.submit("kb", BODY))
    for _ in range(200):
        if any(r.state == "backoff" for r in pd.engine.live.values()):
            break
        await asyncio.sleep(0.01)
    await pd.close()
    with pytest.raises(Refused) as info:
        await asyncio.wait_for(task, 10)  # not an hour: close ends the wait
    assert info.value.reason == "closed"
    assert pd.stats()["flows"]["b/interactive/p"]["failed"] == 1 and not pd.engine.live


async def test_slow_replies_within_and_past_the_deadline(server: FakeOpenAI) -> None:
    server.delay = 0.3
    async with policy_dispatcher(make_policy([server.url])) as pd:
        assert (await pd.submit("kb", BODY, timeout=30))["choices"]  # slow but within its deadline
        with pytest.raises(DeadlineExceeded):
            await pd.submit("kb", BODY, timeout=0.1)  # slower than its deadline: aborted
        for _ in range(100):
            if server.disconnects:
                break
            await asyncio.sleep(0.01)
        assert server.disconnects == 1
        row = pd.stats()["flows"]["b/interactive/p"]
        assert row["completed"] == 1 and row["failed"] == 1 and row["reasons"] == {"deadline": 1}
