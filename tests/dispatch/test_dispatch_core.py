"""Dispatcher behaviour with in-process backends: ordering, placement, room, stalls and
overtaking, cancellation, close, stats, bad input. No sockets; deterministic."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from dispatch_helpers import GateBackend, settle

from sfq.cost import CostEstimator
from sfq.backends.health import HealthOptions
from sfq.dispatch import Dispatcher, DispatchRecord
from sfq.errors import BackendError, BackendUnavailable, BadRequest, DispatcherClosed, RequestTooLarge, UnknownModel


def body(n: int = 4, **kw):
    return {"model": "m", "prompt": "p", "max_tokens": n, **kw}


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def test_submit_returns_the_reply_and_calibrates(sched):
    b = GateBackend("b", max_in_flight=2)
    est = CostEstimator(input_weight=0.0, output_weight=1.0, prior_ratio=1.0)
    async with Dispatcher([b], estimator=est, scheduler=sched) as d:
        t = asyncio.create_task(d.submit("f", body(10)))
        await settle()
        assert len(b.calls) == 1 and b.calls[0][0] == "completions"
        b.release(0, completion_tokens=5)
        reply = await t
        assert reply["usage"]["completion_tokens"] == 5
        assert est.ratio("m") == 0.5
        s = d.stats()
        # estimated 10 at dispatch, settled to the usage (5) at completion (charge="served", the default)
        assert s["flows"]["f"]["completed"] == 1 and s["flows"]["f"]["charged_cost"] == 5
        assert s["backends"]["b"]["completed"] == 1 and s["backends"]["b"]["in_flight"] == 0


async def test_max_in_flight_and_least_loaded_placement(sched):
    b1, b2 = GateBackend("b1", max_in_flight=2), GateBackend("b2", max_in_flight=1)
    async with Dispatcher([b1, b2], scheduler=sched) as d:
        tasks = [asyncio.create_task(d.submit("f", body())) for _ in range(5)]
        await settle()
        # b1 at 0/2, b2 at 0/1 -> b1 (first, tie); then b1 1/2 = 0.5 vs b2 0 -> b2; then b1 -> full
        assert len(b1.calls) == 2 and len(b2.calls) == 1
        st = d.stats()
        assert st["flows"]["f"]["waiting"] == 2 and st["pools"]["null"]["waiting"] == 2
        b2.release(0)
        await settle()
        assert len(b2.calls) == 2 and len(b1.calls) == 2  # the freed slot took the next request
        while not all(t.done() for t in tasks):
            for g in (b1, b2):
                assert g.open_count() <= g.max_in_flight
                for i, (_, _, f) in enumerate(g.calls):
                    if not f.done():
                        g.release(i)
            await settle()
        await asyncio.gather(*tasks)
        assert d.stats()["flows"]["f"]["completed"] == 5


async def test_fair_order_and_charged_cost_bound(sched):
    """Two backlogged flows, costs 1 vs 8: dispatch by meter; |W_a - W_b| <= 2 c_max (Goyal, Vin and Cheng, 1996)."""
    b = GateBackend("b", max_in_flight=1)
    records: list[DispatchRecord] = []
    async with Dispatcher([b], scheduler=sched, on_dispatch=records.append) as d:
        heavy = [asyncio.create_task(d.submit("heavy", body(), cost=8.0)) for _ in range(20)]
        await settle()
        light = [asyncio.create_task(d.submit("light", body(), cost=1.0)) for _ in range(100)]
        await settle()
        done = 0
        while done < 120:
            b.release(done)
            done += 1
            await settle(3)
        await asyncio.gather(*heavy, *light)
    flows = [r.flow for r in records]
    # the first heavy request was dispatched alone; afterwards light goes whenever its meter is lower
    charged = {"heavy": 0.0, "light": 0.0}
    left = {"heavy": 20, "light": 100}
    worst = 0.0
    for r in records[1:]:  # from the moment both flows were waiting
        if left["heavy"] == 0 or left["light"] == 0:
            break
        charged[r.flow] += r.cost
        left[r.flow] -= 1
        worst = max(worst, abs(charged["heavy"] - charged["light"]))
    assert worst <= 2 * 8.0
    assert flows.count("light") == 100 and flows.count("heavy") == 20
    # starts are the meters before charging: each flow's meter only grows, by exactly its cost
    for flow, cost in (("heavy", 8.0), ("light", 1.0)):
        mine = [r for r in records if r.flow == flow]
        for a, c in itertools.pairwise(mine):
            assert c.start >= a.finish - 1e-9
        assert all(r.finish - r.start == pytest.approx(cost) for r in mine)


async def test_cancel_before_dispatch_is_uncharged(sched):
    b = GateBackend("b", max_in_flight=1)
    async with Dispatcher([b], scheduler=sched) as d:
        first = asyncio.create_task(d.submit("a", body(), cost=5.0))
        await settle()
        waiting = asyncio.create_task(d.submit("b", body(), cost=7.0))
        await settle()

        meter_before = d.meter("b")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert d.meter("b") == meter_before and len(d.scheduler_of(None)) == 0
        s = d.stats()["flows"]["b"]
        assert s == {**s, "cancelled": 1, "dispatched": 0, "charged_cost": 0.0, "waiting": 0}
        b.release(0)
        await first
        assert len(b.calls) == 1  # the cancelled request never reached the backend


async def test_cancel_after_dispatch_aborts_the_call_and_keeps_the_charge(sched):
    b = GateBackend("b", max_in_flight=1)
    async with Dispatcher([b], scheduler=sched) as d:
        t = asyncio.create_task(d.submit("a", body(), cost=5.0))
        nxt = asyncio.create_task(d.submit("c", body(), cost=1.0))
        await settle()
        meter = d.meter("a")
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert b.cancelled == 1  # the backend call itself was cancelled
        await settle()
        assert d.meter("a") >= meter == 5.0  # no refund (v may have moved past it)
        s = d.stats()
        assert s["flows"]["a"]["aborted"] == 1 and s["flows"]["a"]["charged_cost"] == 5.0
        assert s["backends"]["b"]["aborted"] == 1
        assert len(b.calls) == 2  # the slot went to the next request
        b.release(1)
        await nxt


async def test_backend_failure_reaches_the_caller_and_marks_unhealthy(sched):
    b1, b2 = GateBackend("b1", max_in_flight=1), GateBackend("b2", max_in_flight=1)
    b1.healthy = False
    async with Dispatcher([b1, b2], scheduler=sched,
                          max_attempts=1, health=HealthOptions(backoff=0.01, max_backoff=0.02, transport_failures=1)) as d:  # (retries: test_dispatch_retry.py)
        t = asyncio.create_task(d.submit("f", body()))
        await settle()
        b1.fail(0, BackendUnavailable("gone", backend="b1"))
        with pytest.raises(BackendUnavailable, match="gone"):
            await t
        assert d.stats()["backends"]["b1"]["healthy"] is False
        ts = [asyncio.create_task(d.submit("f", body())) for _ in range(3)]
        await settle()
        assert len(b1.calls) == 1 and len(b2.calls) == 1  # only the healthy one gets traffic
        await asyncio.sleep(0.1)
        assert b1.health_checks >= 2  # probed with backoff, still down
        b1.healthy = True
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(b1.calls) == 2:
                break
        assert len(b1.calls) == 2  # back in rotation after a passing health check
        while not all(t.done() for t in ts):
            for g in (b1, b2):
                for i, (_, _, f) in enumerate(g.calls):
                    if not f.done():
                        g.release(i)
            await settle()
        await asyncio.gather(*ts)
        st = d.stats()["backends"]["b1"]
        assert st["healthy"] and st["errors"] == 1 and st["unhealthy_spells"] == 1


async def test_non_sfq_exception_from_a_backend_is_wrapped(sched):
    b = GateBackend("b")
    async with Dispatcher([b], scheduler=sched) as d:
        t = asyncio.create_task(d.submit("f", body()))
        await settle()
        b.fail(0, KeyError("boom"))
        with pytest.raises(BackendError, match="KeyError") as ei:
            await t
        assert isinstance(ei.value.__cause__, KeyError)
        assert d.stats()["flows"]["f"]["failed"] == 1


async def test_stall_by_default_when_the_head_fits_nowhere(sched):
    small = GateBackend("small", max_in_flight=4, max_context=100)
    large = GateBackend("large", max_in_flight=1, max_context=10_000)
    async with Dispatcher([small, large], scheduler=sched) as d:
        t0 = asyncio.create_task(d.submit("x", body(1000), cost=1.0))  # only fits `large`
        await settle()
        assert len(large.calls) == 1
        big = asyncio.create_task(d.submit("a", body(1000), cost=1.0))  # selected next, fits nowhere now
        await settle()
        smalls = [asyncio.create_task(d.submit("b", body(10), cost=1.0)) for _ in range(3)]
        await settle()
        assert len(small.calls) == 0  # stalled behind the selected head
        s = d.stats()
        assert s["flows"]["a"]["held"] == 1 and s["pools"]["null"]["held"] == 1
        large.release(0)
        await settle()
        assert len(large.calls) == 2 and large.calls[1][1]["max_tokens"] == 1000
        assert len(small.calls) == 3  # the stall is over
        for i in range(3):
            small.release(i)
        large.release(1)
        await asyncio.gather(t0, big, *smalls)


async def test_overtake_lets_later_flows_go(sched):
    small = GateBackend("small", max_in_flight=4, max_context=100)
    large = GateBackend("large", max_in_flight=1, max_context=10_000)
    async with Dispatcher([small, large], scheduler=sched, overtake=1) as d:
        t0 = asyncio.create_task(d.submit("x", body(1000), cost=1.0))
        await settle()
        big = asyncio.create_task(d.submit("a", body(1000), cost=1.0))
        await settle()
        smalls = [asyncio.create_task(d.submit("b", body(10), cost=1.0)) for _ in range(3)]
        await settle()
        assert len(small.calls) == 3  # overtook the held request
        assert d.stats()["flows"]["a"]["held"] == 1
        # cancelling a held request: it waited aside uncharged (look before you pop), so it counts
        # as cancelled before dispatch and its flow's meter never moved
        meter = d.meter("a")
        big.cancel()
        with pytest.raises(asyncio.CancelledError):
            await big
        s = d.stats()["flows"]["a"]
        assert s["held"] == 0 and s["cancelled"] == 1 and s["aborted"] == 0 and s["charged_cost"] == 0.0
        assert d.meter("a") == meter and not d.scheduler_of(None).suspended("a")
        large.release(0)
        for i in range(3):
            small.release(i)
        await asyncio.gather(t0, *smalls)
        assert len(large.calls) == 1


async def test_request_too_large_and_unknown_model(sched):
    b = GateBackend("b", model="m", max_context=100)
    async with Dispatcher([b], scheduler=sched) as d:
        with pytest.raises(RequestTooLarge, match="max_context 100"):
            await d.submit("f", body(500))
        with pytest.raises(UnknownModel, match="'other'"):
            await d.submit("f", {"model": "other", "prompt": "p", "max_tokens": 1})
        assert d.stats()["flows"] == {}  # nothing was queued


async def test_pools_per_model_and_default_pool(sched):
    bm, bd = GateBackend("bm", model="m"), GateBackend("bd")
    async with Dispatcher([bm, bd], scheduler=sched) as d:
        t1 = asyncio.create_task(d.submit("f", {"model": "m", "prompt": "p", "max_tokens": 1}))
        t2 = asyncio.create_task(d.submit("f", {"model": "zzz", "prompt": "p", "max_tokens": 1}))
        t3 = asyncio.create_task(d.submit("f", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
        await settle()
        assert len(bm.calls) == 1 and len(bd.calls) == 2
        assert bd.calls[1][0] == "chat/completions"
        bm.release(0)
        bd.release(0)
        bd.release(1)
        await asyncio.gather(t1, t2, t3)
        assert set(d.stats()["pools"]) == {"m", "null"}  # (the default pool, as json.dumps writes None)


@pytest.mark.parametrize(
    "flow, b, kw, exc, match",
    [
        (["unhashable"], body(), {}, TypeError, "not hashable"),
        ("f", body(), {"cost": -1.0}, ValueError, "cost"),
        ("f", body(), {"cost": float("nan")}, ValueError, "cost"),
        ("f", body(), {"cost": "3"}, TypeError, "cost"),
        ("f", {"model": "m", "max_tokens": 3}, {}, BadRequest, "neither 'prompt'"),
        ("f", body(stream=True), {}, BadRequest, "use stream"),
        ("f", {"model": "m", "prompt": "p", "max_tokens": "abc"}, {}, BadRequest, "'max_tokens' must be an integer"),
        ("f", "not a body", {}, BadRequest, "must be a JSON object, got str"),
        ("f", [1, 2], {}, BadRequest, "must be a JSON object, got list"),
        ("f", 42, {}, BadRequest, "must be a JSON object, got int"),
        ("f", None, {}, BadRequest, "needs a body"),
    ],
)
async def test_bad_input_leaves_nothing_behind(sched, flow, b, kw, exc, match):
    g = GateBackend("g")
    async with Dispatcher([g], scheduler=sched) as d:
        with pytest.raises(exc, match=match):
            await d.submit(flow, b, **kw)
        assert d.stats()["flows"] == {} and len(d.scheduler_of(None)) == 0 and g.calls == []


async def test_stream_body_must_stream(sched):
    g = GateBackend("g")
    async with Dispatcher([g], scheduler=sched) as d:
        with pytest.raises(BadRequest, match="'stream' must be true") as info:
            async for _ in d.stream("f", body(stream=False)):
                pass
        assert info.value.http_status == 400 and info.value.param == "stream"
        with pytest.raises(BadRequest, match="'max_tokens' must be an integer >= 1, got 'abc'"):
            async for _ in d.stream("f", {"model": "m", "prompt": "p", "max_tokens": "abc", "stream": True}):
                pass
        assert g.calls == []


async def test_stream_hides_the_usage_chunk_unless_asked(sched):
    g = GateBackend("g")
    events = [{"choices": [{"text": "a"}]}, {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}]
    est = CostEstimator(input_weight=0.0, prior_ratio=1.0)
    async with Dispatcher([g], scheduler=sched, estimator=est) as d:
        async def run(b):
            return [e async for e in d.stream("f", b)]

        t = asyncio.create_task(run(body(4, stream=True)))
        await settle()
        g.calls[0][2].set_result({"events": events})
        assert await t == events[:1]
        t = asyncio.create_task(run(body(4, stream=True, stream_options={"include_usage": True})))
        await settle()
        g.calls[1][2].set_result({"events": events})
        assert await t == events
        assert est.ratio("m") == 0.25  # usage reached the estimator both times: 2 / 8


async def test_close_rejects_waiting_requests_uncharged(sched):
    g = GateBackend("g", max_in_flight=1)
    d = Dispatcher([g], scheduler=sched, close_grace=5)
    await d.start()
    running = asyncio.create_task(d.submit("a", body(), cost=2.0))
    queued = [asyncio.create_task(d.submit("b", body(), cost=3.0)) for _ in range(3)]
    await settle()
    closing = asyncio.create_task(d.close())
    await settle()
    for q in queued:
        with pytest.raises(DispatcherClosed):
            await q
    assert not closing.done()  # waits for the request in flight
    g.release(0)
    await running
    await closing
    s = d.stats()["flows"]
    assert s["b"]["rejected"] == 3 and s["b"]["charged_cost"] == 0 and s["a"]["completed"] == 1
    with pytest.raises(DispatcherClosed):
        await d.submit("a", body())


async def test_wait_percentiles_use_the_injected_clock(sched):
    clock = FakeClock()
    g = GateBackend("g", max_in_flight=1)
    async with Dispatcher([g], scheduler=sched, clock=clock) as d:
        ts = [asyncio.create_task(d.submit("f", body())) for _ in range(5)]
        await settle()
        for i in range(5):
            clock.t += 1.0  # each request waits one more second than the previous one
            g.release(i)
            await settle()
        await asyncio.gather(*ts)
        s = d.stats()["flows"]["f"]
    # waits: 0, 1, 2, 3, 4 seconds
    assert s["wait_p50"] == pytest.approx(2.0)
    assert s["wait_p95"] == pytest.approx(3.8)
    assert s["wait_p99"] == pytest.approx(3.96)


async def test_set_weight_applies_to_future_charges(sched):
    g = GateBackend("g", max_in_flight=8)
    recs: list[DispatchRecord] = []
    async with Dispatcher([g], scheduler=sched, on_dispatch=recs.append) as d:
        d.set_weight("w", 2.0)
        with pytest.raises(ValueError, match="weight"):
            d.set_weight("w", 0)
        t = asyncio.create_task(d.submit("w", body(), cost=4.0))
        await settle()
        g.release(0)
        await t
    assert recs[0].finish - recs[0].start == pytest.approx(2.0)


async def test_constructor_validation():
    g = GateBackend("g")
    with pytest.raises(ValueError, match="at least one"):
        Dispatcher([])
    with pytest.raises(ValueError, match="unique"):
        Dispatcher([g, GateBackend("g")])
    with pytest.raises(ValueError, match="overtake"):
        Dispatcher([g], overtake=-1)
    with pytest.raises(TypeError, match="Backend"):
        Dispatcher([object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="URL"):
        Dispatcher(["localhost:8000"])
    d = Dispatcher(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])  # URLs become OpenAIBackends
    assert set(d.stats()["backends"]) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}


async def test_a_broken_on_dispatch_hook_breaks_nothing(sched, caplog):
    def hook(rec: DispatchRecord) -> None:
        raise RuntimeError("hook bug")

    g = GateBackend("g")
    async with Dispatcher([g], scheduler=sched, on_dispatch=hook) as d:
        t = asyncio.create_task(d.submit("f", body()))
        await settle()
        g.release(0)
        assert (await t)["usage"]["completion_tokens"] == 4
    assert "on_dispatch hook raised" in caplog.text
    with pytest.raises(ValueError, match="max_in_flight"):
        GateBackend("x", max_in_flight=0)
