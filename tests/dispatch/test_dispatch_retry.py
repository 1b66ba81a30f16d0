"""The library's Dispatcher retries as clients expect, by the request engine's one rule: a failure
before any byte of the reply (a connection error, an upstream 408, 409, 429 or 5xx) is tried again
in the request's own flow, preferably on another backend, within ``max_attempts``; a 4xx is not;
a stream that passed an event on is never retried. Real loopback servers (``FakeServer``)."""

from __future__ import annotations

import asyncio
import random

import pytest
from dispatch_helpers import FakeServer, wait_until

from sfq.backends import OpenAIBackend
from sfq.backends.health import HealthOptions
from sfq.dispatch import Dispatcher
from sfq.errors import BackendHTTPError, BackendUnavailable, StreamInterrupted
from sfq.policy import RetrySpec

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


def quick(backends: list[OpenAIBackend], **kw: object) -> Dispatcher:
    return Dispatcher(backends, rng=random.Random(7), **kw, health=HealthOptions(backoff=10, max_backoff=10))  # type: ignore[arg-type]


async def test_a_5xx_is_retried_and_the_caller_gets_the_reply(fake: FakeServer) -> None:
    fake.modes.extend(["503", "500"])
    async with quick([OpenAIBackend(fake.url)]) as d:
        reply = await d.submit("a", BODY)
        assert reply["choices"] and len(fake.requests) == 3
        s = d.stats()["flows"]["a"]
        assert s["retried"] == 2 and s["completed"] == 1 and s["failed"] == 0


async def test_a_4xx_is_not_retried(fake: FakeServer) -> None:
    fake.modes.append("400")
    async with quick([OpenAIBackend(fake.url)]) as d:
        with pytest.raises(BackendHTTPError) as info:
            await d.submit("a", BODY)
        assert info.value.status == 400 and len(fake.requests) == 1
        assert d.stats()["flows"]["a"]["failed"] == 1


async def test_max_attempts_counts_the_first_try(fake: FakeServer) -> None:
    fake.mode = "503"
    async with quick([OpenAIBackend(fake.url)], max_attempts=2) as d:
        with pytest.raises(BackendHTTPError):
            await d.submit("a", BODY)
        assert len(fake.requests) == 2


async def test_the_retry_goes_to_another_backend() -> None:
    bad, good = FakeServer(), FakeServer()
    await bad.start()
    await good.start()
    try:
        bad.mode = "500"
        async with quick([OpenAIBackend(bad.url, name="bad", max_in_flight=1),
                          OpenAIBackend(good.url, name="good", max_in_flight=1)]) as d:
            # the least-loaded tie goes to the first backend: the first try lands on "bad"
            reply = await d.submit("a", BODY)
            assert reply["choices"]
            assert len(bad.requests) == 1 and len(good.requests) == 1  # retried elsewhere, at once
    finally:
        await bad.stop()
        await good.stop()


async def test_a_connection_error_is_retried(fake: FakeServer, refused_url: str) -> None:
    async with quick([OpenAIBackend(refused_url, name="gone"), OpenAIBackend(fake.url, name="up")]) as d:
        for _ in range(3):
            assert (await d.submit("a", BODY))["choices"]
        assert d.stats()["backends"]["gone"]["healthy"] is False


async def test_a_stream_is_retried_only_before_its_first_event(fake: FakeServer) -> None:
    body = {**BODY, "stream": True}
    fake.modes.append("503")
    async with quick([OpenAIBackend(fake.url)]) as d:
        events = [ev async for ev in d.stream("a", body)]
        assert events and len(fake.requests) == 2  # failed before any event: retried
        fake.modes.append("cut")  # the stream is cut after it passed events on
        with pytest.raises((StreamInterrupted, BackendUnavailable)):
            async for _ in d.stream("a", body):
                pass
        assert len(fake.requests) == 3  # never retried once an event reached the caller


async def test_cancelled_while_waiting_to_be_retried_reaches_no_backend_again(fake: FakeServer) -> None:
    fake.mode = "503"
    async with Dispatcher([OpenAIBackend(fake.url)], rng=random.Random(1), health=HealthOptions(backoff=10, max_backoff=10)) as d:
        d.engine.retry.spec = RetrySpec(max_attempts=3, base_seconds=30, max_seconds=30, backoff="constant")
        t = asyncio.create_task(d.submit("a", BODY))
        await wait_until(lambda: len(fake.requests) == 1 and d.engine.live and next(iter(d.engine.live.values())).state
                         == "backoff", "the first try failed")
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert len(fake.requests) == 1
        s = d.stats()["flows"]["a"]
        assert s["cancelled"] + s["aborted"] == 1 and s["waiting"] == 0 and s["in_flight"] == 0  # (the engine: cancelled_during_execution)
