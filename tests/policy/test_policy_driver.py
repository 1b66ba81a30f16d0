"""PolicyDispatcher as the request engine's asyncio driver, against loopback fake servers:
the embedder primitives (``acquire``, ``open_stream``), retries as clients expect them, the
pool's upstream timeouts, a pool with no backend in rotation, capped 429 pauses, and
Idempotency-Key joiners."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from fake_openai import FakeOpenAI

from sfq.backends import Backend, SaturationProbe
from sfq.backends.health import HealthOptions
from sfq.dispatch import PolicyDispatcher
from sfq.dispatch.policy_dispatcher import EventStream
from sfq.errors import (
    BackendHTTPError,
    BackendTimeout,
    BackendUnavailable,
    BadRequest,
    DeadlineExceeded,
    NoHealthyBackend,
    Refused,
    SFQError,
)
from sfq.policy import Flow, parse_policy

BODY = {"model": "m", "prompt": "hello there", "max_tokens": 4}
STREAM = {**BODY, "stream": True}
FLOW = Flow("b", "interactive", "p")
LIMIT = 10.0  # seconds: the safety net of every wait (never a timing check)


def make_policy(urls: list[str], *, slots: int = 4, timeouts: str = "", retry: str = "") -> str:
    backends = "\n".join(f'      - {{url: "{u}", max_in_flight: {slots}, api_key_env: SFQ_DRIVER_TEST_KEY}}'
                         for u in urls)
    t = f"\n    timeouts: {timeouts}" if timeouts else ""
    retry = retry or "{max_attempts: 3, budget_per_flow_percent: 100, base_seconds: 0.01, max_seconds: 0.05}"
    return f"""
pools:
  p:
    models: [m]
    backends:
{backends}{t}
classes:
  interactive: {{weight: 4}}
  batch: {{weight: 1}}
orgs:
  a: {{keys: [ka], classes: [batch, interactive]}}
  b: {{keys: [kb], classes: [interactive]}}
retry: {retry}
"""


@pytest.fixture(autouse=True)
def _upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SFQ_DRIVER_TEST_KEY", "sk-upstream-key")


@pytest.fixture
async def server() -> AsyncIterator[FakeOpenAI]:
    s = FakeOpenAI()
    await s.start()
    yield s
    await s.stop()


@contextlib.asynccontextmanager
async def dispatcher(text: str, *, health: HealthOptions | None = None) -> AsyncIterator[PolicyDispatcher]:
    pd = PolicyDispatcher(parse_policy(text), rng=random.Random(1),
                          health=health or HealthOptions(backoff=0.05, max_backoff=0.1), close_grace=1.0)
    async with pd:
        yield pd


async def until(cond: object, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + LIMIT
    while not (cond() if callable(cond) else cond):
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def row(pd: PolicyDispatcher, flow: str = "b/interactive/p") -> dict:
    return pd.stats()["flows"][flow]


def dead_url() -> str:
    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# ---------------------------------------------------------------- acquire
async def test_acquire_grants_a_backend_and_settles_from_the_usage(server: FakeOpenAI) -> None:
    async with dispatcher(make_policy([server.url])) as pd:
        async with pd.acquire(FLOW, BODY, timeout=LIMIT) as grant:
            assert grant.backend.url == server.url and grant.url == server.url + "/v1/completions"
            assert grant.backend.headers["Authorization"] == "Bearer sk-upstream-key"
            assert "sk-upstream-key" not in repr(grant.backend)
            async with aiohttp.ClientSession() as http:  # the embedder's own client
                async with http.post(grant.url, json=BODY, headers=dict(grant.backend.headers)) as resp:
                    reply = await resp.json()
            assert pd.stats()["backends"][server.url]["in_flight"] == 1
            grant.finish(reply["usage"])
            with pytest.raises(RuntimeError):
                grant.finish(reply["usage"])
            assert pd.stats()["backends"][server.url]["in_flight"] == 0  # finish frees the slot at once
        assert server.headers[0]["Authorization"] == "Bearer sk-upstream-key"
        r = row(pd)
        assert r["completed"] == 1 and r["served_cost"] > 0 and r["in_flight"] == 0


async def test_acquire_without_finish_completes_and_an_error_inside_fails_unretried(server: FakeOpenAI) -> None:
    async with dispatcher(make_policy([server.url])) as pd:
        async with pd.acquire(FLOW, BODY) as grant:
            grant.delivered(3)
        assert row(pd)["completed"] == 1
        with pytest.raises(BackendUnavailable):
            async with pd.acquire(FLOW, BODY):
                raise BackendUnavailable("the embedder's call could not connect", never_sent=True)
        r = row(pd)
        assert r["failed"] == 1 and r["retries"] == 0 and r["in_flight"] == 0  # retried by nobody
        # it counted toward the backend's health: one flow's failure alone is confirmed by the
        # backend's own health check before it leaves, and the check passes: it stays
        await until(lambda: pd.monitor_of(server.url).stats()["confirmations"] >= 1, "the health check to confirm")
        assert pd.stats()["backends"][server.url]["healthy"]
        with pytest.raises(KeyError):
            async with pd.acquire(FLOW, BODY):
                raise KeyError("a bug in the embedder's own code")
        assert row(pd)["failed"] == 2 and row(pd)["in_flight"] == 0
        assert server.requests == []  # the dispatcher itself never called the upstream


async def test_acquire_cancelled_or_timed_out_while_waiting_never_reaches_the_upstream(server: FakeOpenAI) -> None:
    server.release = asyncio.Event()
    async with dispatcher(make_policy([server.url], slots=1)) as pd:
        running = asyncio.create_task(pd.submit_flow(FLOW, BODY))
        await until(lambda: server.running == 1, "the first request to run")

        async def embed() -> None:
            async with pd.acquire(FLOW, BODY):
                raise AssertionError("granted while the only slot was taken")

        waiting = asyncio.create_task(embed())
        await until(lambda: row(pd)["waiting"] == 1, "the embedder's request to wait")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(Refused) as info:
            async with pd.acquire(FLOW, BODY, timeout=0.05):
                pass
        assert info.value.reason == "deadline"
        r = row(pd)
        assert r["cancelled_before_start"] == 1 and r["refused"] == 1 and r["waiting"] == 0
        server.release.set()
        await running
        assert len(server.requests) == 1


async def test_acquire_refuses_a_bad_body_and_an_unknown_org(server: FakeOpenAI) -> None:
    async with dispatcher(make_policy([server.url])) as pd:
        with pytest.raises(BadRequest) as bad:
            async with pd.acquire(FLOW, {**BODY, "max_tokens": "abc"}):
                pass
        assert isinstance(bad.value, ValueError) and bad.value.reason == "bad_request" and "max_tokens" in str(bad.value)
        with pytest.raises(Refused, match="'nobody'"):
            async with pd.acquire(Flow("nobody", "interactive", "p"), BODY):
                pass
        with pytest.raises(Refused):
            async with pd.acquire(Flow("b", "batch", "p"), BODY):  # b may not use batch
                pass
        assert server.requests == [] and not pd.engine.live


# ---------------------------------------------------------------- open_stream
async def test_open_stream_refuses_a_bad_body_before_anything_is_sent(server: FakeOpenAI) -> None:
    async with dispatcher(make_policy([server.url])) as pd:
        with pytest.raises(BadRequest, match="max_tokens"):
            async with pd.open_stream(FLOW, {**STREAM, "max_tokens": "abc"}):
                raise AssertionError("entered")
        with pytest.raises(BadRequest):
            async with pd.open_stream(FLOW, {**STREAM, "max_tokens": 10**9 * 10**9}):
                raise AssertionError("entered")
        assert server.requests == [] and row(pd)["reasons"] == {"bad_request": 2}


async def test_open_stream_has_the_upstreams_answer_before_it_returns(server: FakeOpenAI) -> None:
    async with dispatcher(make_policy([server.url])) as pd:
        server.modes.extend(["400"])
        with pytest.raises(BackendHTTPError) as info:  # a 4xx: the request's own, not retried
            async with pd.open_stream(FLOW, STREAM):
                raise AssertionError("entered")
        assert info.value.status == 400 and isinstance(info.value, SFQError) and len(server.requests) == 1
        server.modes.extend(["503"])  # retried before the first event: the caller never sees it
        async with pd.open_stream(FLOW, {**STREAM, "max_tokens": 3}) as events:
            assert isinstance(events, EventStream) and len(server.requests) == 3
            texts = [e["choices"][0]["text"] async for e in events]
        assert texts == ["t0", "t1", "t2"]  # the usage-only event held back: not asked for
        assert server.requests[-1]["stream_options"] == {"include_usage": True}  # asked of the upstream anyway
        r = row(pd)
        assert r["completed"] == 1 and r["failed"] == 1 and r["retries"] == 1 and r["in_flight"] == 0


async def test_a_queued_stream_cancelled_never_reaches_the_upstream(server: FakeOpenAI) -> None:
    server.release = asyncio.Event()
    async with dispatcher(make_policy([server.url], slots=1)) as pd:
        first = asyncio.create_task(pd.submit_flow(FLOW, BODY))
        await until(lambda: server.running == 1, "the first request to run")

        async def consume() -> None:
            async with pd.open_stream(FLOW, STREAM) as events:
                async for _ in events:
                    pass

        queued = asyncio.create_task(consume())
        await until(lambda: row(pd)["waiting"] == 1, "the stream to wait")
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        server.release.set()
        await first
        await asyncio.sleep(0.05)
        assert len(server.requests) == 1 and row(pd)["cancelled_before_start"] == 1


async def test_a_stream_closed_early_cancels_its_request(server: FakeOpenAI) -> None:
    server.event_delay = 0.02
    async with dispatcher(make_policy([server.url])) as pd:
        async with pd.stream("kb", {**STREAM, "max_tokens": 50}) as events:
            async for _ in events:
                break
        await until(lambda: server.disconnects == 1, "the upstream call to be aborted")
        r = row(pd)
        assert r["cancelled_during_execution"] == 1 and r["in_flight"] == 0
        async with contextlib.aclosing(pd.stream_flow(FLOW, {**STREAM, "max_tokens": 2})) as s:
            assert [e["choices"][0]["text"] async for e in s] == ["t0", "t1"]


# ---------------------------------------------------------------- retries
async def test_a_5xx_is_retried_on_another_backend_and_takes_the_bad_one_out() -> None:
    bad, good = FakeOpenAI(), FakeOpenAI()
    await bad.start()
    await good.start()
    try:
        bad.mode = "500"
        async with dispatcher(make_policy([bad.url, good.url], slots=2),
                              health=HealthOptions(error_window=4, error_rate=0.5, backoff=30, max_backoff=30)) as pd:
            for i in range(12):
                flow = FLOW if i % 2 else Flow("a", "batch", "p")
                assert (await pd.submit_flow(flow, BODY))["choices"]  # every one served
            assert len(bad.requests) <= 4  # each 5xx was retried on the healthy one; then it left rotation
            assert len(good.requests) == 12
            b = pd.stats()["backends"][bad.url]
            assert b["healthy"] is False and "5xx" in b["down_reason"]
    finally:
        await bad.stop()
        await good.stop()


async def test_a_stream_is_never_retried_once_an_event_passed(server: FakeOpenAI) -> None:
    timeouts = "{between_events: 0.2}"
    async with dispatcher(make_policy([server.url], timeouts=timeouts)) as pd:
        server.modes.extend(["stall"])
        got = []
        with pytest.raises(BackendTimeout):
            async for e in pd.stream_flow(FLOW, STREAM):
                got.append(e)
        assert len(got) == 1 and len(server.requests) == 1  # not retried: an event had reached the caller
        r = row(pd)
        assert r["failed"] == 1 and r["retries"] == 0 and r["in_flight"] == 0


async def test_max_attempts_and_the_retry_budget(server: FakeOpenAI) -> None:
    server.mode = "503"
    retry = "{max_attempts: 2, budget_per_flow_percent: 100, base_seconds: 0.01, max_seconds: 0.02}"
    async with dispatcher(make_policy([server.url], retry=retry), health=HealthOptions(error_window=100)) as pd:
        with pytest.raises(BackendHTTPError) as info:
            await pd.submit_flow(FLOW, BODY)
        assert info.value.status == 503 and len(server.requests) == 2


# ---------------------------------------------------------------- upstream timeouts
async def test_first_byte_timeout(server: FakeOpenAI) -> None:
    server.mode = "hang"
    async with dispatcher(make_policy([server.url], timeouts="{first_byte: 0.2, total: 30}")) as pd:
        with pytest.raises(BackendTimeout, match="upstream timeout"):
            await pd.submit_flow(FLOW, BODY)
        await until(lambda: server.disconnects == 1, "the upstream call to be aborted")
        assert len(server.requests) == 1  # a read timeout is not retried (the model may still be at it)
        with pytest.raises(BackendTimeout):
            async with pd.open_stream(FLOW, STREAM):
                raise AssertionError("entered")
        r = row(pd)
        assert r["failed"] == 2 and r["in_flight"] == 0 and r["timeouts"] == 2


async def test_total_timeout_of_a_busy_stream(server: FakeOpenAI) -> None:
    server.event_delay = 0.05
    async with dispatcher(make_policy([server.url], timeouts="{between_events: 5, total: 0.3}")) as pd:
        events = 0
        with pytest.raises(BackendTimeout, match="total"):
            async for _ in pd.stream_flow(FLOW, {**STREAM, "max_tokens": 1000}):
                events += 1
        assert 0 < events < 1000 and row(pd)["in_flight"] == 0
        assert pd.stats()["backends"][server.url]["healthy"]  # a long stream is not the backend's fault


async def test_a_stream_longer_than_its_silence_bound_is_not_cut(server: FakeOpenAI) -> None:
    # the bound is on the silence between two events, not on the stream: 30 events 0.05 s apart
    # (1.5 s in all) pass a between_events bound of 0.25 s (the watchdog looks again when it fires)
    server.event_delay = 0.05
    async with dispatcher(make_policy([server.url], timeouts="{first_byte: 10, between_events: 0.25}")) as pd:
        got = [e async for e in pd.stream_flow(FLOW, {**STREAM, "max_tokens": 30})]
        assert len(got) >= 30 and row(pd)["failed"] == 0 and row(pd)["timeouts"] == 0


async def test_a_deadline_frees_the_slot_of_a_stream_whose_reader_stopped(server: FakeOpenAI) -> None:
    server.event_delay = 0.01
    async with dispatcher(make_policy([server.url])) as pd:
        s = pd.stream_flow(FLOW, {**STREAM, "max_tokens": 1000}, timeout=0.3)
        await s.__anext__()
        await until(lambda: row(pd)["in_flight"] == 0, "the slot to be freed at the deadline")  # not reading
        with pytest.raises(DeadlineExceeded):
            await s.__anext__()
        await s.aclose()
        await until(lambda: server.disconnects == 1, "the upstream call to be aborted")
        r = row(pd)
        assert r["failed"] == 1 and r["reasons"] == {"deadline": 1}


# ---------------------------------------------------------------- no backend in rotation
async def test_no_healthy_backend_answers_at_once_and_ends_the_waiting(server: FakeOpenAI) -> None:
    server.release = asyncio.Event()
    async with dispatcher(make_policy([server.url], slots=1),
                          health=HealthOptions(backoff=0.2, max_backoff=0.2)) as pd:
        running = asyncio.create_task(pd.submit_flow(FLOW, BODY))
        await until(lambda: server.running == 1, "the first request to run")
        waiting = [asyncio.create_task(pd.submit_flow(FLOW, BODY)) for _ in range(3)]
        stream = asyncio.create_task(pd.open_stream(FLOW, STREAM).__aenter__())
        await until(lambda: row(pd)["waiting"] == 4, "four requests to wait")
        pd.monitor_of(server.url).mark_down("test: taken out of rotation")  # the pool's last backend
        for t in [*waiting, stream]:
            with pytest.raises(NoHealthyBackend) as info:
                await asyncio.wait_for(t, LIMIT)
            assert info.value.retry_after is not None
        with pytest.raises(NoHealthyBackend):
            await pd.submit_flow(FLOW, BODY)  # refused at once
        server.release.set()
        assert (await running)["choices"]  # the running one finishes
        await until(lambda: pd.engine.pool_available("p"), "the health check to bring it back")
        assert (await pd.submit_flow(FLOW, BODY))["choices"]
        assert len(server.requests) == 2


async def test_a_dead_backend_beside_a_live_one(server: FakeOpenAI) -> None:
    dead = dead_url()
    async with dispatcher(make_policy([dead, server.url], slots=2),
                          health=HealthOptions(backoff=30, max_backoff=30)) as pd:
        replies = await asyncio.gather(*(pd.submit_flow(FLOW, BODY) for _ in range(6)))
        assert all(r["choices"] for r in replies) and len(server.requests) == 6
        assert pd.stats()["backends"][dead]["healthy"] is False
        assert row(pd)["failed"] == 0


# ---------------------------------------------------------------- 429
async def test_a_429_pause_is_capped(server: FakeOpenAI) -> None:
    server.modes.extend(["429"])
    server.retry_after = "3600"
    async with dispatcher(make_policy([server.url]), health=HealthOptions(max_pause=0.3)) as pd:
        assert (await asyncio.wait_for(pd.submit_flow(FLOW, BODY), LIMIT))["choices"]  # retried after the cap
        assert len(server.requests) == 2
        b = pd.stats()["backends"][server.url]
        assert b["rate_limited"] == 1 and b["paused_for"] <= 0.3 and b["healthy"]


# ---------------------------------------------------------------- Idempotency-Key
async def test_a_joiner_keeps_its_own_deadline_and_outlives_the_first_caller(server: FakeOpenAI) -> None:
    server.release = asyncio.Event()
    async with dispatcher(make_policy([server.url])) as pd:
        first = asyncio.create_task(pd.submit_flow(FLOW, BODY, idempotency_key="k"))
        await until(lambda: server.running == 1, "the request to run")
        with pytest.raises(DeadlineExceeded):  # a joiner's own (short) deadline
            await pd.submit_flow(FLOW, BODY, idempotency_key="k", timeout=0.05)
        joiner = asyncio.create_task(pd.submit_flow(FLOW, BODY, idempotency_key="k", timeout=LIMIT))
        await asyncio.sleep(0.02)
        first.cancel()  # the first caller leaves; the joiner still waits: the request goes on
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.sleep(0.02)
        assert server.disconnects == 0
        server.release.set()
        assert (await joiner)["choices"] and len(server.requests) == 1
        assert row(pd)["completed"] == 1
        last = asyncio.create_task(pd.submit_flow(FLOW, BODY, idempotency_key="k2"))
        server.release.clear()
        await until(lambda: server.running == 1, "the request to run")
        last.cancel()  # its only caller leaves: so does the request
        with pytest.raises(asyncio.CancelledError):
            await last
        await until(lambda: server.disconnects == 1, "the upstream call to be aborted")
        server.release.set()


async def test_close_lets_the_running_finish_and_refuses_the_rest(server: FakeOpenAI) -> None:
    server.release = asyncio.Event()
    pd = PolicyDispatcher(parse_policy(make_policy([server.url], slots=1)), close_grace=LIMIT)
    await pd.start()
    running = asyncio.create_task(pd.submit_flow(FLOW, BODY))
    await until(lambda: server.running == 1, "the request to run")
    waiting = asyncio.create_task(pd.submit_flow(FLOW, BODY))
    await until(lambda: row(pd)["waiting"] == 1, "the second to wait")
    closing = asyncio.create_task(pd.close())
    with pytest.raises(Refused) as info:
        await waiting
    assert info.value.reason == "closed"
    server.release.set()
    assert (await running)["choices"]
    await closing
    assert not pd.engine.live
    with pytest.raises(Refused):
        await pd.submit_flow(FLOW, BODY)


# ---------------------------------------------------------------- a transport of the embedder's own
class Double(Backend):
    """An in-process backend: plain replies without usage; saturated while ``full`` is set
    (its probe reads a vLLM-style gauge)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, max_in_flight=2, probe=SaturationProbe(interval=0.01, max_waiting=0))
        self.full = False
        self.calls = 0

    async def complete(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        return {"choices": [{"index": 0, "text": "x" * 400}]}  # no usage: 100 tokens of text

    async def stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.calls += 1
        yield {"choices": [{"index": 0, "text": "x" * 40}]}

    async def fetch_metrics(self) -> str:
        return f"vllm:num_requests_waiting {5 if self.full else 0}\n"


async def test_a_reply_without_usage_settles_from_its_text_and_a_saturated_backend_holds_requests() -> None:
    url = "http://127.0.0.1:9"
    double = Double(url)
    pd = PolicyDispatcher(parse_policy(make_policy([url]).replace("api_key_env: SFQ_DRIVER_TEST_KEY", "")),
                          backends={url: double}, health=HealthOptions(backoff=0.05, max_backoff=0.1))
    async with pd:
        reply = await pd.submit_flow(FLOW, {**BODY, "max_tokens": 1000})
        assert reply["choices"] and double.calls == 1
        served = row(pd)["served_cost"]
        prompt = len(BODY["prompt"]) / pd.estimator.chars_per_token_of("m")
        assert served == pytest.approx(prompt + 2 * 400 / pd.estimator.chars_per_token_of("m"), rel=0.01)
        double.full = True
        await until(lambda: pd.stats()["backends"][url]["saturated"], "the probe to see it saturated")
        held = asyncio.create_task(pd.submit_flow(FLOW, BODY))
        await until(lambda: row(pd)["waiting"] == 1, "the request to wait")
        await asyncio.sleep(0.05)
        assert double.calls == 1 and pd.engine.pool_available("p")  # held, not refused: the pool is not down
        double.full = False
        assert (await asyncio.wait_for(held, LIMIT))["choices"] and double.calls == 2


async def test_a_reload_keeps_the_monitors_word(server: FakeOpenAI) -> None:
    text = make_policy([server.url])
    async with dispatcher(text, health=HealthOptions(backoff=30, max_backoff=30)) as pd:
        pd.monitor_of(server.url).mark_down("test: out of rotation")
        assert not pd.engine.pool_available("p")
        pd.reload(parse_policy(text.replace("interactive: {weight: 4}", "interactive: {weight: 2}")))
        assert not pd.engine.pool_available("p")  # still out, under the new policy too
        with pytest.raises(NoHealthyBackend):
            await pd.submit_flow(FLOW, BODY)
        assert server.requests == []
