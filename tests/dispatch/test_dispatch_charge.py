"""The charge modes (issue 12): what each charges and when, look before you pop (nothing charged
while a request waits aside), the busy period held open while the fleet works, cancellation
after dispatch, and fairness on *delivered* tokens measured on a loopback server.

Meters are read from the pool's scheduler; every request here is estimated by an estimator
that never calibrates (``min_model_samples`` huge), so an estimate is known in advance:
``cost = prompt ids + 0.25 * max_tokens``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from dispatch_helpers import FakeServer, GateBackend, settle

import sfq
from sfq.backends.health import HealthOptions
from sfq.backends import OpenAIBackend
from sfq.cost import CostEstimator
from sfq.dispatch import Dispatcher, DispatchRecord

PROMPT = [1, 2, 3, 4]  # token ids: exactly 4 prompt tokens


def est() -> CostEstimator:
    return CostEstimator(1.0, 1.0, prior_ratio=0.25, min_model_samples=10**9, min_flow_samples=10**9)


def body(max_tokens: int = 40, stream: bool = False, **kw: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, **kw}
    if stream:
        b["stream"] = True
    return b


def chunk(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


class StreamGate(GateBackend):
    """A GateBackend whose streams deliver what the test puts in their queue (``None`` ends one)."""

    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.streams: list[tuple[dict[str, Any], asyncio.Queue[dict[str, Any] | None]]] = []
        self.aborted_streams = 0

    async def stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.streams.append((body, q))
        try:
            while True:
                ev = await q.get()
                if ev is None:
                    return
                yield ev
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted_streams += 1
            raise


async def consume(it: Any, into: list[dict[str, Any]]) -> None:
    async for ev in it:
        into.append(ev)


def meter(d: Dispatcher, flow: str) -> float:
    return float(d.meter(flow))


# ------------------------------------------------------------------ each mode's meter movement
@pytest.mark.parametrize("mode", ["seed", "settle", "served"])
async def test_a_reply_whose_usage_differs_from_the_estimate(sched, mode):
    """Estimate 4 + 0.25 * 40 = 14; the server reports 40 output tokens (actual 44): seed keeps
    14, settle and served (a non-streamed reply settles) correct the meter to 44 at completion."""
    b = GateBackend("b")
    async with Dispatcher([b], estimator=est(), scheduler=sched, charge=mode) as d:
        t = asyncio.create_task(d.submit("a", body()))
        await settle()
        assert meter(d, "a") == 14.0
        b.calls[0][2].set_result({"usage": {"prompt_tokens": 4, "completion_tokens": 40}})
        await t
        want = 14.0 if mode == "seed" else 44.0
        assert meter(d, "a") == want and d.stats()["flows"]["a"]["charged_cost"] == want


@pytest.mark.parametrize("mode", ["seed", "settle", "served"])
async def test_a_stream_is_charged_as_the_mode_says(sched, mode):
    """seed: 14 and stays; settle: 14, then 44 at completion; served: the prompt (4) at
    dispatch, +1 per delivered chunk of one token, then reconciled with the final usage."""
    b = StreamGate("b")
    async with Dispatcher([b], estimator=est(), scheduler=sched, charge=mode) as d:
        got: list[dict[str, Any]] = []
        t = asyncio.create_task(consume(d.stream("a", body(stream=True)), got))
        await settle()
        first = 4.0 if mode == "served" else 14.0
        assert meter(d, "a") == first
        q = b.streams[0][1]
        for i in range(3):
            q.put_nowait(chunk("x"))
            await settle()
            assert meter(d, "a") == (4.0 + i + 1 if mode == "served" else first)  # as the chunks arrive
        q.put_nowait(chunk("xxxxxxxx"))  # 8 characters at 4 per token: 2 tokens
        await settle()
        assert meter(d, "a") == (9.0 if mode == "served" else first)
        q.put_nowait({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 40}})
        q.put_nowait(None)
        await t
        assert len(got) == 4  # the usage-only chunk was not asked for: not passed on
        want = 14.0 if mode == "seed" else 44.0
        assert meter(d, "a") == want and d.stats()["flows"]["a"]["charged_cost"] == want


async def test_served_takes_a_running_usage_report_as_the_count(sched):
    """A server that reports usage on every chunk (vLLM's continuous usage stats): the count is
    the report's ``completion_tokens``, not a count of characters."""
    b = StreamGate("b")
    async with Dispatcher([b], estimator=est(), scheduler=sched) as d:
        assert d.charge == "served"
        t = asyncio.create_task(consume(d.stream("a", body(stream=True)), []))
        await settle()
        q = b.streams[0][1]
        q.put_nowait({**chunk("xxxxxxxxxxxx"), "usage": {"prompt_tokens": 4, "completion_tokens": 5}})
        await settle()
        assert meter(d, "a") == 4.0 + 5.0
        q.put_nowait({**chunk("x"), "usage": {"prompt_tokens": 4, "completion_tokens": 6}})
        await settle()
        assert meter(d, "a") == 4.0 + 6.0
        q.put_nowait(None)  # no final report: what was counted stands
        await t
        assert meter(d, "a") == 10.0


async def test_an_explicit_cost_is_charged_as_given(sched):
    b = StreamGate("b")
    async with Dispatcher([b], estimator=est(), scheduler=sched) as d:
        t = asyncio.create_task(consume(d.stream("a", body(stream=True), cost=3.0), []))
        await settle()
        q = b.streams[0][1]
        q.put_nowait(chunk("x"))
        q.put_nowait({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 40}})
        q.put_nowait(None)
        await t
        assert meter(d, "a") == 3.0


async def test_the_charge_is_estimated_at_dispatch_not_at_submit(sched):
    """Calibration learned while the request waited: it is charged the dispatch-time estimate."""
    b = GateBackend("b", max_in_flight=1)
    e = CostEstimator(0.0, 1.0, prior_ratio=1.0)
    async with Dispatcher([b], estimator=e, scheduler=sched, charge="seed") as d:
        first = asyncio.create_task(d.submit("a", body(40)))
        await settle()
        second = asyncio.create_task(d.submit("b", body(40)))
        await settle()
        assert meter(d, "a") == 40.0  # the prior: the full cap
        b.release(0, completion_tokens=10)  # the model's ratio becomes 0.25 before "b" is dispatched
        await first
        await settle()
        assert d.stats()["flows"]["b"]["charged_cost"] == 10.0  # not the 40 estimated at submit
        b.release(1)
        await second


# ------------------------------------------------------------------ look before you pop
async def test_a_stalled_head_is_not_charged_while_it_waits(sched):
    small = GateBackend("small", max_in_flight=4, max_context=100)
    large = GateBackend("large", max_in_flight=1, max_context=10_000)
    async with Dispatcher([small, large], estimator=est(), scheduler=sched) as d:
        t0 = asyncio.create_task(d.submit("x", body(1000)))  # only fits `large`
        await settle()
        big = asyncio.create_task(d.submit("a", body(1000)))  # next in line, fits nowhere now
        await settle()
        smalls = [asyncio.create_task(d.submit("b", body(10))) for _ in range(2)]
        await settle()
        s = d.stats()
        assert len(small.calls) == 0 and s["flows"]["a"]["held"] == 1 and s["pools"]["null"]["held"] == 1
        assert s["pools"]["null"]["waiting"] == 2
        assert meter(d, "a") == 0.0 and s["flows"]["a"]["charged_cost"] == 0.0  # waits uncharged
        assert s["flows"]["a"]["dispatched"] == 0
        large.release(0)
        await settle()
        assert len(large.calls) == 2 and meter(d, "a") > 0  # charged when it went
        assert len(small.calls) == 2
        for i in range(2):
            small.release(i)
        large.release(1)
        await asyncio.gather(t0, big, *smalls)


async def test_overtaking_a_held_request_does_not_charge_it(sched):
    """overtake=1: the held head's flow is suspended (uncharged, its requests keep waiting), others
    go; when a backend that fits has room, the flow rejoins at max(S, v) and is charged then."""
    small = GateBackend("small", max_in_flight=4, max_context=100)
    large = GateBackend("large", max_in_flight=1, max_context=10_000)
    records: list[DispatchRecord] = []
    async with Dispatcher([small, large], estimator=est(), scheduler=sched, overtake=1,
                          on_dispatch=records.append) as d:
        core = d.scheduler_of(None)
        t0 = asyncio.create_task(d.submit("x", body(1000)))
        await settle()
        big = [asyncio.create_task(d.submit("a", body(1000))) for _ in range(2)]
        await settle()
        smalls = [asyncio.create_task(d.submit("b", body(10))) for _ in range(3)]
        await settle()
        assert len(small.calls) == 3  # overtook the held request
        s = d.stats()["flows"]["a"]
        assert s["held"] == 1 and s["waiting"] == 1 and s["charged_cost"] == 0.0 and s["dispatched"] == 0
        v = core.virtual_time
        assert core.suspended(d.flow_key("a")) and core.pending(d.flow_key("a")) == 1 and meter(d, "a") == v  # one entry per flow (its next turn); where it would rejoin
        large.release(0)
        await settle()
        assert len(large.calls) == 2  # a's head went; its next request waits aside in turn, uncharged
        assert core.suspended(d.flow_key("a")) and d.stats()["flows"]["a"]["held"] == 1
        ra = [r for r in records if r.flow == "a"]
        assert len(ra) == 1 and ra[0].start == v  # rejoined at max(S, v) = v: nothing banked aside
        assert d.stats()["flows"]["a"]["charged_cost"] == 4 + 250
        for i in range(3):
            small.release(i)
        large.release(1)
        await settle()
        large.release(2)
        await asyncio.gather(t0, *big, *smalls)
        assert d.stats()["flows"]["a"]["held"] == 0


# ------------------------------------------------------------------ the busy period
@pytest.mark.parametrize("mode", ["seed", "settle", "served"])
async def test_the_busy_period_stays_open_while_work_is_in_flight(sched, mode):
    """a's only request is dispatched (nothing waits any more) and runs: the idle rule must not
    fire, so b, arriving while it runs, starts at v = 0, not at a's finish tag 14."""
    b = GateBackend("b", max_in_flight=2)
    records: list[DispatchRecord] = []
    async with Dispatcher([b], estimator=est(), scheduler=sched, charge=mode, on_dispatch=records.append) as d:
        core = d.scheduler_of(None)
        ta = asyncio.create_task(d.submit("a", body()))
        await settle()
        assert core.in_flight == 1 and len(core) == 0 and core.virtual_time == 0.0
        tb = asyncio.create_task(d.submit("b", body()))
        await settle()
        assert [r.start for r in records] == [0.0, 0.0]
        assert core.running(d.flow_key("a")) == (0 if mode == "seed" else 1)
        b.release(0, completion_tokens=10)
        b.release(1, completion_tokens=10)
        await asyncio.gather(ta, tb)
        assert core.in_flight == 0 and core.virtual_time == 14.0  # the system idle: the period closed


# ------------------------------------------------------------------ cancel after dispatch
@pytest.mark.parametrize("mode", ["seed", "settle", "served"])
async def test_cancel_after_dispatch(sched, mode):
    """seed and settle keep the estimate (14); served keeps the prompt plus what was delivered."""
    b = StreamGate("b")
    async with Dispatcher([b], estimator=est(), scheduler=sched, charge=mode) as d:
        core = d.scheduler_of(None)
        t = asyncio.create_task(consume(d.stream("a", body(stream=True)), []))
        await settle()
        q = b.streams[0][1]
        q.put_nowait(chunk("x"))
        q.put_nowait(chunk("x"))
        await settle()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await settle()
        assert b.aborted_streams == 1 and core.in_flight == 0 and core.running(d.flow_key("a")) == 0
        want = 6.0 if mode == "served" else 14.0
        s = d.stats()["flows"]["a"]
        assert s["aborted"] == 1 and s["charged_cost"] == want and meter(d, "a") == want
        # a non-streamed request cancelled after dispatch keeps its estimate in every mode
        t2 = asyncio.create_task(d.submit("c", body()))
        await settle()
        t2.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t2
        assert d.stats()["flows"]["c"]["charged_cost"] == 14.0 and core.in_flight == 0


async def test_bad_charge_mode_is_refused():
    with pytest.raises(ValueError, match="charge must be one of .*'fair'"):
        Dispatcher([GateBackend("b")], charge="fair")


# ------------------------------------------------------------------ fairness on delivered tokens
async def closed_loop(mode: str, fake: FakeServer, stop_after: int = 120) -> dict[str, int]:
    """Flows 'under' (real output 4x its estimate) and 'exact' (real output = its estimate), four
    closed-loop clients each, one backend with one slot; the tokens the fake server delivered to
    each flow while both were backlogged (a snapshot when ``stop_after`` requests are done)."""
    fake.output = lambda b: b["max_tokens"] if b["prompt"] == "under" else b["max_tokens"] // 4
    e = CostEstimator(0.0, 1.0, prior_ratio=0.25, min_model_samples=10**9, min_flow_samples=10**9)
    done = 0
    snapshot: dict[str, int] = {}
    stop = asyncio.Event()

    async with Dispatcher([OpenAIBackend(fake.url, name="f", max_in_flight=1)], estimator=e, charge=mode) as d:
        async def client(flow: str) -> None:
            nonlocal done
            while not stop.is_set():
                async for _ in d.stream(flow, {"model": "m", "prompt": flow, "max_tokens": 32, "stream": True}):
                    pass
                done += 1
                if done == stop_after and not stop.is_set():
                    snapshot.update(fake.delivered)
                    stop.set()

        await asyncio.gather(*(client(f) for f in ("under", "exact") for _ in range(4)))
    return snapshot


@pytest.mark.parametrize("mode", ["served", "settle", "seed"])
async def test_delivered_tokens_converge_under_served_and_settle_not_under_seed(fake, mode):
    got = await closed_loop(mode, fake)
    under, exact = got["under"], got["exact"]
    ratio = under / exact
    if mode == "seed":
        assert ratio > 2.5, got  # charged equally on estimates, served 4x more
    else:
        # the delivered-cost bound: 2 c_max (c_max = 32) plus the work in flight of each flow
        # (one slot: one request of up to 32 tokens), and the ratio near 1
        assert abs(under - exact) <= 2 * 32 + 32 and 0.8 <= ratio <= 1.25, got


def test_the_default_is_served():
    assert Dispatcher([GateBackend("b")]).charge == "served" and sfq.Dispatcher is Dispatcher


@pytest.mark.parametrize("mode", ["settle", "served"])
async def test_an_absurd_usage_report_moves_the_meter_only_as_far_as_the_request_could_cost(sched, mode):
    """10**12 tokens reported: output clamped to max_tokens (40), the prompt (4 token ids) to
    4 * 4 + 64: the meter settles at 80 + 40, and nothing raises."""
    b = GateBackend("b")
    async with Dispatcher([b], estimator=est(), scheduler=sched, charge=mode) as d:
        t = asyncio.create_task(d.submit("a", body()))
        await settle()
        b.calls[0][2].set_result({"usage": {"prompt_tokens": 10**12, "completion_tokens": 10**12}})
        await t
        assert meter(d, "a") == 4 * 4 + 64 + 40
        e = est()
        assert e.actual_cost(e.estimate(body()), {"prompt_tokens": "x", "completion_tokens": -1}) is None
        assert e.actual_cost(e.estimate(body()), {"completion_tokens": 7}) == 4 + 7  # no prompt report: the estimate


async def test_a_held_request_expires_uncharged_when_no_backend_is_healthy(sched):
    from sfq.errors import BackendUnavailable, NoHealthyBackend

    small = GateBackend("small", max_in_flight=4, max_context=100)
    large = GateBackend("large", max_in_flight=1, max_context=10_000)
    small.healthy = large.healthy = False  # their health checks fail: they stay down
    async with Dispatcher([small, large], estimator=est(), scheduler=sched, overtake=1, unavailable_timeout=0.05, health=HealthOptions(transport_failures=1, backoff=10, max_backoff=10)) as d:
        core = d.scheduler_of(None)
        tx = asyncio.create_task(d.submit("x", body(1000)))
        await settle()
        ta = asyncio.create_task(d.submit("a", body(1000)))
        ty = asyncio.create_task(d.submit("y", body(10)))
        await settle()
        assert d.stats()["flows"]["a"]["held"] == 1 and core.suspended(d.flow_key("a")) and len(small.calls) == 1
        small.fail(0, BackendUnavailable("gone", backend="small"))
        large.fail(0, BackendUnavailable("gone", backend="large"))
        for t in (tx, ty):  # no backend left to retry on: the pool's answer, from the failure
            with pytest.raises(NoHealthyBackend) as info:
                await t
            assert isinstance(info.value.__cause__, BackendUnavailable)
        with pytest.raises(NoHealthyBackend):
            await ta
        s = d.stats()["flows"]["a"]
        assert s["held"] == 0 and s["unavailable"] == 1 and s["charged_cost"] == 0.0 and s["dispatched"] == 0
        assert not core.suspended(d.flow_key("a")) and core.pending(d.flow_key("a")) == 0 and core.in_flight == 0
