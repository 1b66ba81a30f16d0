"""Review regressions of the dispatch layer: races between cancellation and selection, backends
that break the stream contract, abandoned streams, close with requests in flight, calibration
that must never break the loop, batch prompts in the estimator, the JSON round trip."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest
from dispatch_helpers import FakeServer, GateBackend, settle, wait_until

from sfq.backends import OpenAIBackend
from sfq.cost import CostEstimator
from sfq.dispatch import Dispatcher
from sfq.errors import BackendError, BackendUnavailable, DispatcherClosed


def body(n: int = 4, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "p", "max_tokens": n, **kw}


async def test_cancel_requested_before_selection_is_never_charged(sched):
    """The caller cancels a waiting request; before its task runs again, a completion frees
    the slot and the pump runs. The request was given up before dispatch: it must leave the
    queue uncharged and never take the slot (API.md: cancelling before dispatch is uncharged)."""
    b = GateBackend("b", max_in_flight=1)
    async with Dispatcher([b], max_attempts=1, scheduler=sched) as d:
        first = asyncio.create_task(d.submit("a", body(), cost=5.0))
        await settle()
        waiting = asyncio.create_task(d.submit("b", body(), cost=7.0))
        third = asyncio.create_task(d.submit("c", body(), cost=1.0))
        await settle()
        assert len(b.calls) == 1
        b.release(0)  # `first` wakes up first and its completion pumps ...
        waiting.cancel()  # ... while this cancellation is still on its way
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await first
        await settle()
        s = d.stats()["flows"]["b"]
        assert s["dispatched"] == 0 and s["charged_cost"] == 0.0 and s["cancelled"] == 1 and s["aborted"] == 0
        assert s["waiting"] == 0 and s["in_flight"] == 0
        sch = d.scheduler_of(None)
        assert sch.meter(d.flow_key("b")) <= sch.virtual_time  # never charged its 7.0
        assert len(b.calls) == 2 and b.calls[1][1] is not None  # the slot went to `third`
        b.release(1)
        await third
        assert d.stats()["backends"]["b"]["in_flight"] == 0


class SyncRaisingStream(GateBackend):
    """A backend whose ``stream`` is a plain function (allowed: it returns an async iterator)
    that rejects the request before returning one."""

    def stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:  # type: ignore[override]
        raise BackendError("stream refused", backend=self.name, unhealthy=False)


async def test_a_stream_that_fails_before_iterating_frees_its_slot(sched):
    b = SyncRaisingStream("b", max_in_flight=1)
    async with Dispatcher([b], max_attempts=1, scheduler=sched, close_grace=0.5) as d:
        with pytest.raises(BackendError, match="stream refused"):
            async for _ in d.stream("f", body()):
                pass
        s = d.stats()
        assert s["backends"]["b"]["in_flight"] == 0 and s["flows"]["f"]["in_flight"] == 0
        assert s["flows"]["f"]["failed"] == 1
        # the slot is free: a plain request goes through
        t = asyncio.create_task(d.submit("f", body()))
        await settle()
        assert len(b.calls) == 1
        b.release(0)
        await t


async def test_breaking_out_of_a_stream_without_aclosing_aborts_it(fake: FakeServer):
    """``break`` out of ``async for`` (no aclosing): once the generator is dropped, the request
    is aborted, the server sees the connection close, and the slot is free."""
    fake.mode = "slow"
    fake.delay = 0.02
    async with Dispatcher([OpenAIBackend(fake.url, max_in_flight=1)], max_attempts=1) as d:
        got = 0
        async for _ in d.stream("f", {**body(), "max_tokens": 1000}):
            got += 1
            if got == 2:
                break
        gc.collect()
        await wait_until(lambda: fake.disconnects == 1, "the server to see the disconnect")
        await wait_until(lambda: d.stats()["flows"]["f"]["in_flight"] == 0, "the slot to be freed")
        s = d.stats()
        assert s["flows"]["f"]["aborted"] == 1 and s["backends"][fake.url]["in_flight"] == 0
        r = await asyncio.wait_for(d.submit("f", body()), 5)  # the slot is usable again
        assert r["usage"]["completion_tokens"] == 4


async def test_close_aborts_what_outlives_the_grace(fake: FakeServer):
    """A request still running when ``close_grace`` runs out ends with an error; close returns,
    nothing is left in flight, no connection and no aiohttp session is left open."""
    fake.mode = "stall"
    backend = OpenAIBackend(fake.url)
    d = Dispatcher([backend], max_attempts=1, close_grace=0.2)
    await d.start()
    t = asyncio.create_task(d.submit("f", body()))
    await wait_until(lambda: len(fake.requests) == 1, "the request to reach the server")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        await asyncio.wait_for(d.close(), 5)
        with pytest.raises(BackendUnavailable):
            await asyncio.wait_for(t, 5)
    s = d.stats()
    assert s["flows"]["f"]["in_flight"] == 0 and s["flows"]["f"]["failed"] == 1
    assert backend._pool is None and backend._aux is None


async def test_a_calibration_failure_does_not_break_the_reply_or_the_loop(sched):
    """A backend reporting absurd usage must not turn a successful reply into an exception,
    nor keep the next waiting request from being dispatched."""
    b = GateBackend("b", max_in_flight=1)
    async with Dispatcher([b], max_attempts=1, scheduler=sched) as d:
        t1 = asyncio.create_task(d.submit("f", body()))
        t2 = asyncio.create_task(d.submit("g", body()))
        await settle()
        b.calls[0][2].set_result({"usage": {"prompt_tokens": 1, "completion_tokens": 10**400}})
        r = await t1
        assert r["usage"]["completion_tokens"] == 10**400
        await settle()
        assert len(b.calls) == 2  # the completion pumped the next request
        b.release(1)
        await t2
        assert d.stats()["backends"]["b"]["in_flight"] == 0


def test_batch_prompts_multiply_the_output_cap():
    """``prompt`` as a list of strings (or of token-id lists) is a batch: the server generates up
    to ``n * max_tokens`` for every prompt, so the cap (and the calibration) must count them."""
    est = CostEstimator(input_weight=0.0, output_weight=1.0, prior_ratio=1.0)
    assert est.estimate({"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 10}).max_tokens == 30
    assert est.estimate({"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 10, "n": 2}).max_tokens == 40
    assert est.estimate({"model": "m", "prompt": [1, 2, 3], "max_tokens": 10}).max_tokens == 10
    e = est.estimate({"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 10})
    est.observe(e, {"prompt_tokens": 3, "completion_tokens": 30})  # every prompt used its whole cap
    assert est.ratio("m") == 1.0


def test_state_round_trip_keeps_every_ratio(tmp_path):
    est = CostEstimator(input_weight=1.0, output_weight=1.0, min_flow_samples=2)
    flows = ["a", 7, ("org", 3, None), 2.5, True]
    for i, flow in enumerate(flows):
        for k in range(3):
            e = est.estimate({"model": "m", "prompt": "x" * (10 + i), "max_tokens": 10 * (k + 1)}, flow)
            est.observe(e, {"prompt_tokens": 3 + i, "completion_tokens": k + i}, flow)
    est.save(tmp_path / "cal.json")
    other = CostEstimator(input_weight=1.0, output_weight=1.0, min_flow_samples=2)
    other.load(tmp_path / "cal.json")
    assert other.state() == est.state()
    for flow in flows:
        assert other.ratio("m", flow) == est.ratio("m", flow)
    assert other.chars_per_token_of("m") == est.chars_per_token_of("m")


async def test_close_while_waiting_and_held_leaves_counters_at_zero(sched):
    small = GateBackend("small", max_in_flight=1, max_context=100)
    large = GateBackend("large", max_in_flight=1, max_context=10_000)
    d = Dispatcher([small, large], max_attempts=1, scheduler=sched, close_grace=5)
    await d.start()
    t0 = asyncio.create_task(d.submit("x", body(1000), cost=1.0))  # on `large`
    await settle()
    held = asyncio.create_task(d.submit("a", body(1000), cost=1.0))  # selected, fits nowhere now: held
    waiting = [asyncio.create_task(d.submit("b", body(10), cost=1.0)) for _ in range(3)]  # stalled
    await settle()
    assert d.stats()["flows"]["a"]["held"] == 1
    closing = asyncio.create_task(d.close())
    await settle()
    for t in (held, *waiting):
        with pytest.raises(DispatcherClosed):
            await t
    large.release(0)
    await t0
    await closing
    s = d.stats()
    for f in s["flows"].values():
        assert f["waiting"] == 0 and f["held"] == 0 and f["in_flight"] == 0
    assert s["flows"]["a"]["rejected"] == 1 and s["flows"]["b"]["rejected"] == 3
    assert s["flows"]["b"]["charged_cost"] == 0.0


async def test_max_context_is_per_sequence_not_per_request(sched):
    """``n`` completions of one prompt each need prompt + max_tokens of context, not n times it
    (vLLM's max_model_len and max_context are per sequence)."""
    b = GateBackend("b", max_context=1000)
    async with Dispatcher([b], max_attempts=1, scheduler=sched) as d:
        t = asyncio.create_task(d.submit("f", {**body(600), "n": 2}))
        await settle()
        assert len(b.calls) == 1
        b.release(0, completion_tokens=1200)
        await t


def test_a_state_with_infinite_counts_is_a_value_error(tmp_path):
    """``json.load`` accepts ``Infinity``: a corrupt file must raise ValueError (the documented
    error), and leave the estimator unchanged."""
    est = CostEstimator()
    e = est.estimate({"model": "m", "prompt": "abcd", "max_tokens": 10})
    est.observe(e, {"prompt_tokens": 2, "completion_tokens": 5})
    before = est.state()
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "models": {"m": {"output": 1, "cap": 2, "n_out": Infinity, '
                   '"chars": 0, "tokens": 0, "n_prompt": 0}}, "flows": []}')
    with pytest.raises(ValueError, match="bad calibration entry"):
        est.load(bad)
    assert est.state() == before


def test_an_absurd_usage_report_is_clamped_to_the_cap():
    from sfq.cost import CostEstimator

    est = CostEstimator(1.0, 2.0, prior_ratio=0.5)
    body = {"model": "m", "prompt": "hello", "max_tokens": 100}
    e = est.estimate(body)
    assert est.observe(e, {"prompt_tokens": 5, "completion_tokens": 10**300})
    assert est.ratio("m") <= 1.0
    later = est.estimate(body)
    assert later.expected_output <= 100 and later.cost < float("inf")


async def test_flow_stats_are_bounded_under_key_churn(sched):
    """A proxy keyed by API key sees endless distinct flows: idle flows' stats are forgotten."""
    class Instant(GateBackend):
        async def complete(self, endpoint, body):
            return {"usage": {"prompt_tokens": 1, "completion_tokens": 2}}

    b = Instant("b", max_in_flight=4)
    async with Dispatcher([b], max_attempts=1, scheduler=sched, max_flow_stats=50) as d:
        for k in range(400):
            await d.submit(("key", k), {"model": "m", "prompt": "p", "max_tokens": 2})
        flows = d.stats()["flows"]
        assert len(flows) <= 50 and str(("key", 399)) in flows and d.flow_stats(("key", 399)) is not None
    with pytest.raises(ValueError, match="max_flow_stats"):
        Dispatcher([GateBackend("c")], max_attempts=1, max_flow_stats=0)


def test_estimator_per_flow_calibration_is_bounded():
    est = CostEstimator(1.0, 1.0, min_flow_samples=2, max_flows=10)
    body = {"model": "m", "prompt": "x", "max_tokens": 10}
    for _ in range(3):  # "steady" has enough samples to be used
        est.observe(est.estimate(body, flow="steady"), {"completion_tokens": 2}, flow="steady")
    for k in range(100):  # a stream of one-shot keys
        est.observe(est.estimate(body, flow=k), {"completion_tokens": 9}, flow=k)
    assert len(est._flows) <= 10
    assert est.ratio("m", "steady") == pytest.approx(0.2)  # the calibrated flow survived
    with pytest.raises(ValueError, match="max_flows"):
        CostEstimator(max_flows=0)
