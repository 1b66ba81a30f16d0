"""OpenAIBackend and the Dispatcher against a loopback aiohttp server of our own that answers,
refuses, stalls, fails with 5xx/4xx, cuts replies and streams, and sends garbage.
(``max_attempts=1`` throughout: these tests classify failures; retries are test_dispatch_retry.py's.)
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from dispatch_helpers import FakeServer, wait_until

from sfq.backends import OpenAIBackend, SaturationProbe
from sfq.backends.health import HealthOptions
from sfq.cost import CostEstimator
from sfq.dispatch import Dispatcher
from sfq.errors import (
    BackendError,
    BackendHTTPError,
    BackendTimeout,
    BackendUnavailable,
    StreamInterrupted,
)

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}




async def test_plain_and_chat_replies_with_usage(fake: FakeServer):
    est = CostEstimator(input_weight=0.0, output_weight=1.0, prior_ratio=0.5)
    async with Dispatcher([OpenAIBackend(fake.url, max_in_flight=2)], max_attempts=1, estimator=est) as d:
        r = await d.submit("f", BODY)
        assert r["choices"][0]["text"] == "xxxx" and r["usage"]["completion_tokens"] == 4
        r = await d.submit("f", CHAT)
        assert r["choices"][0]["message"]["content"] == "xxx"
    assert fake.requests[0] == BODY and "stream" not in fake.requests[0]
    assert est.ratio("m") == 1.0  # calibrated from the usage reports


async def test_streaming_asks_for_usage_and_passes_events_through(fake: FakeServer):
    est = CostEstimator(input_weight=0.0, prior_ratio=0.5)
    async with Dispatcher([OpenAIBackend(fake.url)], max_attempts=1, estimator=est) as d:
        events = [e async for e in d.stream("f", {**CHAT, "stream": True})]
        assert [e["choices"][0]["delta"]["content"] for e in events] == ["x", "x", "x"]
        assert fake.requests[-1]["stream_options"] == {"include_usage": True}
        assert est.ratio("m") == 1.0
        events = [e async for e in d.stream("f", {**BODY, "stream_options": {"include_usage": True}})]
        assert events[-1]["usage"]["completion_tokens"] == 4 and events[-1]["choices"] == []


async def test_awkward_but_legal_sse(fake: FakeServer):
    fake.mode = "sse_odd"
    async with OpenAIBackend(fake.url) as b:
        events = [e async for e in b.stream("completions", {"prompt": "p", "max_tokens": 3})]
    assert [e["choices"][0]["text"] for e in events] == ["a", "b", "c"]


async def test_connection_refused(refused_url: str):
    async with Dispatcher([OpenAIBackend(refused_url)], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10)) as d:
        with pytest.raises(BackendUnavailable, match="cannot connect") as ei:
            await d.submit("f", BODY)
        assert ei.value.backend == refused_url and ei.value.unhealthy
        s = d.stats()
        assert s["backends"][refused_url]["healthy"] is False
        assert s["backends"][refused_url]["errors"] == 1 and s["flows"]["f"]["failed"] == 1


async def test_stall_times_out(fake: FakeServer):
    fake.mode = "stall"
    async with Dispatcher([OpenAIBackend(fake.url, read_timeout=0.3)], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10, transport_failures=1)) as d:
        with pytest.raises(BackendTimeout, match="timed out"):
            await d.submit("f", BODY)
        assert not d.stats()["backends"][fake.url]["healthy"]
    await wait_until(lambda: fake.disconnects == 1, "the server to see the client leave")


async def test_stream_headers_deadline(fake: FakeServer):
    fake.mode = "stall"
    async with Dispatcher([OpenAIBackend(fake.url, timeout=0.3)], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10)) as d:
        with pytest.raises(BackendTimeout, match="no reply headers"):
            async for _ in d.stream("f", BODY):
                pass


async def test_5xx_marks_unhealthy_4xx_does_not(fake: FakeServer):
    """With a window of one reply, one 5xx is an error rate of 100%; a 4xx never counts."""
    fake.modes.extend(["400", "500"])
    async with Dispatcher([OpenAIBackend(fake.url)], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10, error_window=1)) as d:
        with pytest.raises(BackendHTTPError, match="HTTP 400") as ei:
            await d.submit("f", BODY)
        assert ei.value.status == 400 and not ei.value.unhealthy and "injected 400" in ei.value.body
        assert d.stats()["backends"][fake.url]["healthy"]
        with pytest.raises(BackendHTTPError, match="HTTP 500") as ei:
            await d.submit("f", BODY)
        assert ei.value.unhealthy
        assert not d.stats()["backends"][fake.url]["healthy"]


async def test_plain_reply_cut_midway(fake: FakeServer):
    fake.mode = "cut"
    async with Dispatcher([OpenAIBackend(fake.url)], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10)) as d:
        with pytest.raises(BackendUnavailable, match="connection lost"):
            await d.submit("f", BODY)


async def test_stream_cut_midway(fake: FakeServer):
    fake.mode = "cut"
    got = []
    async with Dispatcher([OpenAIBackend(fake.url)], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10, transport_failures=1)) as d:
        with pytest.raises(StreamInterrupted) as ei:
            async for e in d.stream("f", {**BODY, "max_tokens": 10}):
                got.append(e)
        # aiohttp drops bytes that arrive together with the cut, so "2" depends on timing
        assert ei.value.chunks == len(got) <= 2 and ei.value.unhealthy
        s = d.stats()
        assert s["flows"]["f"]["failed"] == 1 and not s["backends"][fake.url]["healthy"]


async def test_error_event_inside_a_stream(fake: FakeServer):
    fake.mode = "sse_error"
    async with Dispatcher([OpenAIBackend(fake.url)], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10)) as d:
        with pytest.raises(StreamInterrupted, match="injected mid-stream error") as ei:
            async for _ in d.stream("f", BODY):
                pass
        assert not ei.value.unhealthy and d.stats()["backends"][fake.url]["healthy"]


async def test_garbage_reply(fake: FakeServer):
    fake.mode = "garbage"
    async with Dispatcher([OpenAIBackend(fake.url)], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10)) as d:
        with pytest.raises(BackendError, match="not JSON"):
            await d.submit("f", BODY)


async def test_unhealthy_backend_is_probed_with_backoff_and_returns(fake: FakeServer, refused_url: str):
    """A failing server leaves the rotation, is health-checked with backoff, and comes back."""
    fake.modes.append("503")
    fake.health_status = 503
    good = FakeServer()
    await good.start()
    try:
        flaky = OpenAIBackend(fake.url, name="flaky", max_in_flight=1)
        steady = OpenAIBackend(good.url, name="steady", max_in_flight=1)
        async with Dispatcher([flaky, steady], max_attempts=1, health=HealthOptions(backoff=0.05, max_backoff=0.1, error_window=1)) as d:
            with pytest.raises(BackendHTTPError):
                await d.submit("f", BODY)  # flaky first (tie goes to the first backend)
            for _ in range(4):
                await d.submit("f", BODY)  # all on steady while flaky is out
            assert len(fake.requests) == 1 and len(good.requests) == 4
            await wait_until(lambda: fake.health_calls >= 2, "repeated health checks")
            assert not d.stats()["backends"]["flaky"]["healthy"]
            fake.health_status = 200
            await wait_until(lambda: d.stats()["backends"]["flaky"]["healthy"], "flaky to return")
            await asyncio.gather(*(d.submit("f", BODY) for _ in range(4)))
            assert len(fake.requests) > 1  # back in rotation
    finally:
        await good.stop()


async def test_all_backends_down_requests_wait_then_flow(fake: FakeServer):
    fake.modes.append("500")
    fake.health_status = 503
    async with Dispatcher([OpenAIBackend(fake.url)], max_attempts=1, health=HealthOptions(backoff=0.05, max_backoff=0.05, error_window=1)) as d:
        with pytest.raises(BackendHTTPError):
            await d.submit("f", BODY)
        t = asyncio.create_task(d.submit("g", BODY))
        await asyncio.sleep(0.2)
        assert not t.done() and d.stats()["flows"]["g"]["waiting"] == 1  # queued, not dropped
        fake.health_status = 200
        r = await asyncio.wait_for(t, 5)
        assert r["usage"]["completion_tokens"] == 4


async def test_cancel_after_dispatch_aborts_the_http_call(fake: FakeServer):
    fake.mode = "slow"
    fake.delay = 30
    async with Dispatcher([OpenAIBackend(fake.url)], max_attempts=1) as d:
        t = asyncio.create_task(d.submit("f", BODY))
        await wait_until(lambda: len(fake.requests) == 1, "the request to reach the server")
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await wait_until(lambda: fake.disconnects == 1, "the server to see the disconnect")
        s = d.stats()
        assert s["flows"]["f"]["aborted"] == 1 and s["backends"][fake.url]["in_flight"] == 0
        assert s["backends"][fake.url]["healthy"]  # a cancellation is not the backend's fault


async def test_stopping_a_stream_early_aborts_it(fake: FakeServer):
    fake.mode = "slow"
    fake.delay = 0.02
    async with Dispatcher([OpenAIBackend(fake.url)], max_attempts=1) as d:
        got = 0
        async with contextlib.aclosing(d.stream("f", {**BODY, "max_tokens": 1000})) as it:
            async for _ in it:
                got += 1
                if got == 3:
                    break
        await wait_until(lambda: fake.disconnects == 1, "the server to see the disconnect")
        assert fake.finished == 0
        s = d.stats()["flows"]["f"]
        assert s["aborted"] == 1 and s["in_flight"] == 0


async def test_saturation_probe_holds_dispatch(fake: FakeServer):
    fake.metrics_text = "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 3\n"
    b = OpenAIBackend(fake.url, max_in_flight=8, probe=SaturationProbe(interval=0.02))
    async with Dispatcher([b], max_attempts=1) as d:
        await wait_until(lambda: d.stats()["backends"][fake.url]["saturated"], "the probe's first reading")
        t = asyncio.create_task(d.submit("f", BODY))
        await asyncio.sleep(0.1)
        assert not t.done() and fake.requests == []  # held in sfq, not sent to the engine's queue
        st = d.stats()["backends"][fake.url]["probe"]
        assert st["waiting"] == 3 and "3 requests waiting" in st["reason"]
        fake.metrics_text = "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 0\n"
        await asyncio.wait_for(t, 5)
        # an unreadable /metrics is "unknown": dispatch falls back to max_in_flight
        fake.metrics_text = "this is { not prometheus"
        await wait_until(lambda: d.stats()["backends"][fake.url]["probe_errors"] > 0, "a probe error")
        await asyncio.wait_for(d.submit("f", BODY), 5)


def test_backend_validation():
    with pytest.raises(ValueError, match="URL"):
        OpenAIBackend("localhost:8000")
    with pytest.raises(ValueError, match="read_timeout"):
        OpenAIBackend("http://x", read_timeout=0)
    with pytest.raises(ValueError, match="max_context"):
        OpenAIBackend("http://x", max_context=0)
    b = OpenAIBackend("http://10.0.0.1:8000/v1/", probe=True)
    assert b.url == "http://10.0.0.1:8000" and b.name == "http://10.0.0.1:8000/v1/"
    assert isinstance(b.probe, SaturationProbe)
