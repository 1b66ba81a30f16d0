"""The shared state (``sfq.state.RedisState``) against a real redis-server, in process: global
leases that expire on Redis's time whatever the gateways' clocks say, global buckets and usage
corrections, org rates and queue lengths, the fair order across gateways, renewals, a Redis
that restarts empty, a policy that differs, and an embedder's PolicyDispatcher sharing it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from state_helpers import LIMIT, RedisServer, Upstream, free_port

from sfq.errors import PolicyError, Refused
from sfq.policy import Flow, parse_policy
from sfq.dispatch import PolicyDispatcher
from sfq.engine import Request
from sfq.state import InMemoryState, RedisState, state_for


def _policy(url: str, prefix: str, *, lease: float = 1.0, limits: str = "max_in_flight: 2",
            orgs: str = "", classes: str = "", backend: str = "http://127.0.0.1:9", extra: str = "",
            backend_limit: int = 16, on_loss: str = "local") -> Any:
    return parse_policy(f"""
pools:
  p:
    models: [m]
    backends: [{{url: "{backend}", max_in_flight: {backend_limit}}}]
    limits: {{{limits}}}
classes:
  batch: {{weight: 1}}
{classes}
orgs:
  a: {{keys: [ka], classes: [batch], weight: 3}}
  b: {{keys: [kb], classes: [batch]}}
{orgs}
state: {{redis: "{url}", prefix: "{prefix}", lease_seconds: {lease}, on_loss: {on_loss}}}
{extra}""")


def _req(flow: Flow, tokens: float = 0.0) -> Request:
    r = Request(flow, 1.0, tokens, 0.0)
    r.backend = "http://127.0.0.1:9"
    r.tries = 1
    return r


BACKENDS = [("http://127.0.0.1:9", 16)]
A, B = Flow("a", "batch", "p"), Flow("b", "batch", "p")


async def _denied(st: RedisState, r: Request, wait: float = 0.05) -> bool:
    try:
        await st.acquire(r, BACKENDS, st.clock() + wait)
    except Refused as exc:
        assert exc.reason == "queue_timeout"
        return True
    return False


async def test_leases_expire_on_redis_time_whatever_the_gateways_clocks(redis_server: RedisServer, prefix: str):
    pol = _policy(redis_server.url, prefix, lease=1.0)
    ahead = RedisState(pol.state, pol, clock=lambda: time.monotonic() + 86400.0)  # a day ahead
    behind = RedisState(pol.state, pol, clock=lambda: time.monotonic() - 86400.0)  # a day behind
    await ahead.start()
    await behind.start()
    try:
        held = [_req(A), _req(A)]
        for r in held:
            await ahead.acquire(r, BACKENDS, None)
        assert await _denied(behind, _req(B)), "the pool's 2 slots are held by the other gateway"
        await ahead.abandon()  # the gateway dies: it stops renewing, gives nothing back
        assert (await behind.global_counts())["pool:p"] == 2  # still counted until the leases expire
        t0 = time.monotonic()
        r = _req(B)
        await behind.acquire(r, BACKENDS, behind.clock() + LIMIT)
        freed_after = time.monotonic() - t0
        assert freed_after <= pol.state.lease_seconds + 0.5, f"freed after {freed_after:.2f} s"
        behind.attempt_over(r, None)
    finally:
        await behind.close()
        await ahead.close()


async def test_renewals_keep_what_is_held_and_a_restart_empty_gets_it_back(redis_server: RedisServer, prefix: str):
    pol = _policy(redis_server.url, prefix, lease=0.6)
    a, b = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await a.start()
    await b.start()
    try:
        for r in (_req(A), _req(A)):
            await a.acquire(r, BACKENDS, None)
        # for three lease periods the other gateway finds the pool full: the holder renews
        assert await _denied(b, _req(B), wait=3 * 0.6)
        assert a._client is not None
        await a._client.flushall()  # Redis restarted empty: the running requests are still real
        async def counted() -> bool:
            return (await b.global_counts()).get("pool:p") == 2
        deadline = time.monotonic() + LIMIT
        while not await counted():
            assert time.monotonic() < deadline, "the holder never put its leases back"
            await asyncio.sleep(0.02)
        assert await _denied(b, _req(B))
    finally:
        await a.close()
        await b.close()


async def test_pool_buckets_are_global_and_usage_corrects_them(redis_server: RedisServer, prefix: str):
    pol = _policy(redis_server.url, prefix, limits="requests_per_minute: 3, tokens_per_minute: 100")
    a, b = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await a.start()
    await b.start()
    try:
        r1 = _req(A, tokens=60)
        await a.acquire(r1, BACKENDS, None)
        r2 = _req(B, tokens=60)
        assert await _denied(b, r2), "40 tokens left of 100, the request needs 60"
        a.attempt_over(r1, 10.0)  # the usage report: 10 tokens, not 60: 50 go back (to every gateway)
        await b.acquire(r2, BACKENDS, b.clock() + LIMIT)
        b.attempt_over(r2, None)
        r3 = _req(A, tokens=1)
        await a.acquire(r3, BACKENDS, None)  # the third request of the minute
        a.attempt_over(r3, None)
        assert await _denied(b, _req(B, tokens=1)), "requests_per_minute 3 is spent, by both gateways together"
    finally:
        await a.close()
        await b.close()


async def test_org_rates_and_queue_lengths_are_global(redis_server: RedisServer, prefix: str):
    pol = _policy(redis_server.url, prefix, classes="  short: {weight: 1, max_queue_length: 3}",
                  orgs="  c: {keys: [kc], classes: [short], requests_per_minute: 2}\n"
                       "  d: {keys: [kd], classes: [short]}")
    a, b = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await a.start()
    await b.start()
    try:
        c = Flow("c", "short", "p")
        d = Flow("d", "short", "p")
        ta = await a.admit(c)
        tb = await b.admit(c)
        with pytest.raises(Refused) as ei:
            await a.admit(c)
        assert ei.value.reason == "rate_limited" and ei.value.retry_after is not None and ei.value.retry_after > 1
        ra, rb = _req(c), _req(c)
        a.bind(ta, ra)
        b.bind(tb, rb)
        b.bind(await b.admit(d), _req(d))
        # three waiting, on both gateways: the class's queue is full. d holds fewer places than
        # c, so c's newest place (rb, on gateway b) goes to d's request: queue space is fair
        evicted: list[int] = []
        a.on_evicted = b.on_evicted = evicted.append
        b.bind(await b.admit(d), _req(d))
        assert evicted == [rb.id]
        with pytest.raises(Refused) as ei:  # now d holds the most: d is refused, nobody else loses
            await b.admit(d)
        assert ei.value.reason == "queue_full" and "'d' holds the most" in str(ei.value)
        a.ended(ra)  # one leaves the queue: a place frees for every gateway
        deadline = time.monotonic() + LIMIT
        while True:
            try:
                await b.admit(d)
                break
            except Refused:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
        assert await a.admit(Flow("a", "batch", "p")) is None  # nothing to count: no round trip
    finally:
        await a.close()
        await b.close()


async def _caller(st: RedisState, flow: Flow, got: list[str], n: int, runs: float = 0.002) -> None:
    """A closed-loop caller of ``flow`` at gateway ``st``: acquire, "run" ``runs`` seconds,
    release, until ``got`` (the orgs started, in order) holds ``n``."""
    while len(got) < n:
        r = _req(flow)
        await st.acquire(r, BACKENDS, None)
        got.append(flow.org)
        await asyncio.sleep(runs)
        st.attempt_over(r, None)


async def test_the_next_slot_goes_to_the_smallest_meter_whichever_gateway_holds_it(
        redis_server: RedisServer, prefix: str):
    pol = _policy(redis_server.url, prefix, limits="max_in_flight: 1")
    a, b = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await a.start()
    await b.start()
    got: list[str] = []
    n = 48
    try:
        tasks = [asyncio.create_task(_caller(a, A, got, n)), asyncio.create_task(_caller(b, B, got, n))]
        await asyncio.wait_for(asyncio.gather(*tasks), LIMIT)
    finally:
        await a.close()
        await b.close()
    first = got[:n]
    # weights 3 (org a, on one gateway) and 1 (org b, on the other): 3 of every 4 slots go to a
    assert abs(first.count("a") - 0.75 * n) <= 3, first


async def test_a_different_policy_refuses_to_start(redis_server: RedisServer, prefix: str):
    p1 = _policy(redis_server.url, prefix)
    p2 = _policy(redis_server.url, prefix, limits="max_in_flight: 3")
    a = RedisState(p1.state, p1)
    await a.start()
    try:
        b = RedisState(p2.state, p2)
        with pytest.raises(PolicyError, match="different policy"):
            await b.start()
        await b.close()
        same = RedisState(p1.state, p1)
        await same.start()
        assert same.available
        await same.close()
    finally:
        await a.close()


async def test_in_memory_is_the_default_and_costs_nothing(redis_server: RedisServer, prefix: str):
    pol = parse_policy("""
pools: {p: {models: [m], backends: [{url: "http://127.0.0.1:9"}]}}
classes: {batch: {weight: 1}}
orgs: {a: {keys: [ka], classes: [batch]}}
""")
    st = state_for(pol)
    assert isinstance(st, InMemoryState) and not st.shared
    pd = PolicyDispatcher(pol)
    assert pd.state.shared is False and pd.engine.on_attempt_over is None
    with pytest.raises(TypeError, match="SharedState"):
        PolicyDispatcher(pol, state=object())  # type: ignore[arg-type]
    assert isinstance(state_for(_policy(redis_server.url, prefix)), RedisState)


@contextlib.asynccontextmanager
async def _dispatchers(pol: Any, n: int = 2) -> AsyncIterator[list[PolicyDispatcher]]:
    """``n`` embedders' dispatchers of ``pol`` sharing its state, started, closed after."""
    pds = [PolicyDispatcher(pol) for _ in range(n)]
    try:
        for pd in pds:
            await pd.start()
        yield pds
    finally:
        for pd in pds:
            await pd.close()


async def test_an_embedders_dispatchers_share_the_limits_and_refuse_without_redis(
        redis_server: RedisServer, prefix: str):
    up = Upstream(delay=0.03).start()
    try:
        pol = _policy(redis_server.url, prefix, limits="max_in_flight: 3", backend=up.url)
        async with _dispatchers(pol) as pds:
            body = {"model": "m", "prompt": "x", "max_tokens": 1}
            replies = await asyncio.wait_for(asyncio.gather(*(
                pds[i % 2].submit("ka" if i % 3 else "kb", body) for i in range(24))), LIMIT)
            assert len(replies) == 24 and all(r["choices"] for r in replies)
            assert up.peak <= 3 and up.total == 24
            assert all(pd.stats()["state"]["round_trips"] > 0 for pd in pds)
            # the metrics count a request as waiting until the shared state grants its start
            flows = [pd.stats()["flows"][f] for pd in pds for f in ("a/batch/p", "b/batch/p")]
            assert sum(f["attempts"] for f in flows) == 24 and sum(f["completed"] for f in flows) == 24
            assert all(f["waiting"] == 0 and f["in_flight"] == 0 for f in flows)
            assert max(f["mean_wait"] or 0.0 for f in flows) > 0.01  # 24 requests, 3 at a time, 30 ms each
        # no pool limit: the backend's own max_in_flight holds for both dispatchers together
        up.peak = 0
        pol = _policy(redis_server.url, prefix + "b:", limits="", backend=up.url, backend_limit=2)
        pds = [PolicyDispatcher(pol), PolicyDispatcher(pol)]
        for pd in pds:
            await pd.start()
        try:
            await asyncio.wait_for(asyncio.gather(*(pds[i % 2].submit("ka", body) for i in range(16))), LIMIT)
            assert up.peak == 2
            h = pds[0].stats()["pools"]["p"]
            assert h["backends"][up.url]["max_in_flight"] == 2 and h["max_in_flight"] is None
        finally:
            for pd in pds:
                await pd.close()
        # Redis down at start: the dispatcher starts, refuses with the reason, never breaks a limit
        down = _policy(f"redis://127.0.0.1:{free_port()}/0", prefix, backend=up.url)
        pd = PolicyDispatcher(down)
        await pd.start()
        try:
            assert not pd.state.available and "cannot be reached" in (pd.state.reason or "")
            with pytest.raises(Refused) as ei:
                await pd.submit("ka", body)
            assert ei.value.reason == "state_unavailable"
        finally:
            await pd.close()
    finally:
        up.stop()


async def test_a_reload_puts_the_new_policy_in_force_for_the_prefix(redis_server: RedisServer, prefix: str):
    p1 = _policy(redis_server.url, prefix, lease=0.4)
    p2 = _policy(redis_server.url, prefix, lease=0.4, limits="max_in_flight: 1")
    a, b = RedisState(p1.state, p1), RedisState(p1.state, p1)
    await a.start()
    await b.start()
    try:
        a.reloaded(p2)  # its limits from now on: one at a time
        r = _req(A)
        await a.acquire(r, BACKENDS, None)
        assert await _denied(a, _req(A))
        a.attempt_over(r, None)
        deadline = time.monotonic() + LIMIT
        while b.available:  # the other gateway, still on the old file, stops admitting and says why
            assert time.monotonic() < deadline, "the gateway on the old policy kept admitting"
            await asyncio.sleep(0.02)
        assert "different policy" in (b.reason or "")
        with pytest.raises(Refused) as ei:
            await b.admit(A)
        assert ei.value.reason == "state_unavailable"
        b.reloaded(p2)
        while not b.available:
            assert time.monotonic() < deadline, "the reloaded gateway did not come back"
            await asyncio.sleep(0.02)
    finally:
        await a.close()
        await b.close()


async def test_the_retry_budget_counts_every_gateway(redis_server: RedisServer, prefix: str):
    pol = _policy(redis_server.url, prefix, limits="max_in_flight: 8",
                  extra="retry: {max_attempts: 3, budget_per_flow_percent: 20}")
    a, b = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await a.start()
    await b.start()
    try:
        firsts = [(a, _req(A)) for _ in range(4)] + [(b, _req(A))]
        for st, r in firsts:  # five first attempts of the flow, four of them on one gateway
            await st.acquire(r, BACKENDS, None)
        for st, r in firsts:
            st.attempt_over(r, None)
        ra = firsts[0][1]
        ra.tries = 1
        assert await a.retry_allowed(ra), "one retry per flow is always allowed"
        rb = firsts[4][1]
        # the second gateway saw one first attempt; over both, 2 retries of 7 attempts > 20 %
        assert not await b.retry_allowed(rb)
        ra.retrying = True
        a.attempt_over(ra, None)  # that retry's attempt ended: no retry of the flow is outstanding
        deadline = time.monotonic() + LIMIT
        while not await b.retry_allowed(rb):
            assert time.monotonic() < deadline, "the ended retry still counted as outstanding"
            await asyncio.sleep(0.01)
    finally:
        await a.close()
        await b.close()


async def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + LIMIT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_on_loss_refuse_waiting_requests_wait_through_an_outage_and_within_their_age(prefix: str):
    r = RedisServer(free_port()).start()
    up = Upstream(delay=0.0).start()
    try:
        pol = _policy(r.url, prefix, limits="max_in_flight: 1", backend=up.url,
                      classes="  quick: {weight: 1, max_queue_age_seconds: 0.3}",
                      orgs="  q: {keys: [kq], classes: [quick]}", on_loss="refuse")
        pd = PolicyDispatcher(pol)
        await pd.start()
        body = {"model": "m", "prompt": "x", "max_tokens": 1}
        try:
            up.hold = True
            first = asyncio.create_task(pd.submit("ka", body))
            await _until(lambda: up.now == 1, "the first request to run")
            second = asyncio.create_task(pd.submit("kb", body))
            await _until(lambda: pd.stats()["pools"]["p"]["waiting"] == 1, "the second to wait")
            # a waiting request runs out of its queue age while the slot is held: 504's reason
            with pytest.raises(Refused) as ei:
                await asyncio.wait_for(pd.submit("kq", body), LIMIT)
            assert ei.value.reason == "queue_timeout"
            r.stop()  # Redis goes away: the running one finishes, the waiting one waits
            await _until(lambda: not pd.state.available, "the state to notice")
            up.release()
            assert (await asyncio.wait_for(first, LIMIT))["choices"]
            with pytest.raises(Refused) as ei:
                await pd.submit("ka", body)
            assert ei.value.reason == "state_unavailable"
            assert not second.done()
            r.start()  # back, empty: the waiting request goes
            assert (await asyncio.wait_for(second, LIMIT))["choices"]
            assert up.peak == 1
        finally:
            await pd.close()
    finally:
        up.release()
        up.stop()
        r.stop()



@contextlib.asynccontextmanager
async def _decider_and_other(pol: Any) -> AsyncIterator[tuple[RedisState, RedisState, Request]]:
    """Two gateways of ``pol``: ``a`` the fleet's decider, with a request of org a running that
    its queues charged (the first, which made it the decider, is adopted uncharged: ended), and
    ``b``; closed at the end."""
    a, b = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await a.start()
    await b.start()
    try:
        r0 = _req(A)
        await a.acquire(r0, BACKENDS, None)  # (a becomes the decider: its queues adopt r0, uncharged)
        assert await _decider_of(a, b) is a
        a.attempt_over(r0, None)
        r1 = _req(A)
        await a.acquire(r1, BACKENDS, None)  # started at once, charged by the decider
        yield a, b, r1
    finally:
        await b.close()
        await a.close()


async def test_a_gateway_left_alone_keeps_the_fleets_meters(prefix: str):
    """Redis lost: a gateway alone starts each flow's meter where the fleet's decider last had it
    (``P leads``, which its renewals bring when newer), not level: an org far ahead of the other
    while Redis answered still waits behind it when its own request came first."""
    r = RedisServer(free_port()).start()
    try:
        async with _decider_and_other(_policy(r.url, prefix, limits="max_in_flight: 4", lease=1.0)) as (a, b, r1):
            await a.acquire(_req(A), BACKENDS, None)
            held = [_req(A), _req(A)]
            for x in held:  # b holds the other two slots: its slice alone
                await b.acquire(x, BACKENDS, None)
            busy = asyncio.create_task(b.acquire(_req(B), BACKENDS, None))  # b's org waits: a busy period
            a.charged(r1, 300.0)  # a's org took far more than it was charged: 100 ahead (weight 3)
            await _until(lambda: any(row[0][0] == "a" and row[1] > 50 for row in b._leads_in.get("p", [])),
                         "b to have the decider's leads (a table every second, a renewal every 0.25 s)")
            await _until(lambda: len(b._tables) == 2 and min(t.get(b.gateway_id, 0) for _, t in b._tables) > 0.3,
                         "b's slices by demand (both tables since b's org waits there)")
            busy.cancel()  # (its own order from here)
            await asyncio.sleep(0.05)
            r.stop()
            await _until(lambda: b.degraded, "b to go on alone")
            first = asyncio.create_task(b.acquire(_req(A), BACKENDS, None))  # a's comes first
            await asyncio.sleep(0.05)
            second = asyncio.create_task(b.acquire(_req(B), BACKENDS, None))
            await asyncio.sleep(0.05)
            assert not first.done() and not second.done()
            b.attempt_over(held[0], None)  # one of b's slots frees: b's org first, a's is 100 ahead
            done, _ = await asyncio.wait({first, second}, timeout=LIMIT, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(0.05)
            assert done == {second} and not first.done(), "the fleet's meters forgiven: a's (first) went first"
            first.cancel()
    finally:
        r.stop()


# ---------------------------------------------------------------- Redis lost: alone, within a slice
def test_the_live_gateways_slices_add_up_to_each_limit():
    from sfq.state._local import Slices

    for n in range(1, 9):
        for limit in range(0, 40):
            parts = [Slices(rank, n).count(limit) for rank in range(n)]
            assert sum(parts) == limit and max(parts) - min(parts) <= 1
        assert sum(Slices(rank, n).rate(120.0) for rank in range(n)) == pytest.approx(120.0)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        Slices(2, 2)


@contextlib.asynccontextmanager
async def _alone(prefix: str, gateways: int, make: Any, *, delay: float = 0.0,
                 before: Any = None) -> AsyncIterator[tuple[RedisServer, Upstream, list[PolicyDispatcher]]]:
    """A real redis-server, an upstream and ``gateways`` dispatchers of the policy
    ``make(redis_url, upstream_url)``; ``before(pds)`` runs while Redis is there; then Redis
    is killed and every dispatcher goes on alone: ``(redis, upstream, dispatchers)``."""
    r = RedisServer(free_port()).start()
    up = Upstream(delay=delay).start()
    pds = [PolicyDispatcher(make(r.url, up.url)) for _ in range(gateways)]
    try:
        for pd in pds:
            await pd.start()
        if before is not None:
            await before(pds)
        await _until(lambda: all(pd.state.stats()["gateways"] == gateways for pd in pds), "the gateways to be named")
        r.stop()
        await _until(lambda: all(pd.state.degraded for pd in pds), "the gateways to go on alone")
        yield r, up, pds
    finally:
        for pd in pds:
            await pd.close()
        up.release()
        up.stop()
        r.stop()


async def test_redis_lost_each_gateway_goes_on_alone_within_its_slice_then_rejoins(prefix: str):
    from prometheus_client import generate_latest

    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    async with _alone(prefix, 2, lambda url, backend: _policy(url, prefix, limits="max_in_flight: 3", backend=backend,
                                                              lease=1.0), delay=0.02) as (r, up, pds):
        assert all(pd.state.available and "cannot be reached" in (pd.state.reason or "") for pd in pds)
        assert b"sfq_state_degraded 1.0" in generate_latest(pds[0].registry)
        up.peak = 0
        replies = await asyncio.wait_for(asyncio.gather(*(
            pds[i % 2].submit("ka" if i % 3 else "kb", body) for i in range(24))), LIMIT)
        assert len(replies) == 24 and all(x["choices"] for x in replies)
        assert 2 <= up.peak <= 3  # the slices (2 + 1) add up to the pool's limit, and both are used
        r.start()  # back, empty: the gateways rejoin by themselves, and the limit is Redis's again
        await _until(lambda: all(pd.state.available and not pd.state.degraded for pd in pds), "both gateways to rejoin")
        assert b"sfq_state_degraded 0.0" in generate_latest(pds[0].registry)
        trips = [pd.state.round_trips for pd in pds]
        up.peak = 0
        replies = await asyncio.wait_for(asyncio.gather(*(pds[i % 2].submit("ka", body) for i in range(24))), LIMIT)
        assert len(replies) == 24 and up.peak <= 3
        assert all(pd.state.round_trips > t for pd, t in zip(pds, trips))


async def test_alone_the_gateway_orders_its_flows_by_their_weights(prefix: str):
    async with _alone(prefix, 1, lambda url, backend: _policy(url, prefix, limits="max_in_flight: 1", backend=backend,
                                                              lease=1.0), delay=0.005) as (r, up, pds):
        pd = pds[0]  # (a: weight 3, b: 1)
        up.hold = True
        first = asyncio.create_task(pd.submit("kb", {"model": "m", "prompt": "first", "max_tokens": 1}))
        await _until(lambda: up.now == 1, "the first request to run")
        tasks = [asyncio.create_task(pd.submit(k, {"model": "m", "prompt": k, "max_tokens": 1}))
                 for k in ["kb"] * 8 + ["ka"] * 8]  # b floods first
        await _until(lambda: pd.state.stats()["candidates"] == 16, "the others to wait")
        up.hold = False
        up.release()
        await asyncio.wait_for(asyncio.gather(first, *tasks), LIMIT)
        served = up.order[1:9]  # the first eight after the first (b's), all sixteen waiting
        assert served == ["ka", "ka", "ka", "kb"] * 2, up.order  # weights 3:1, the engine's order


async def test_on_loss_refuse_or_no_gateway_ever_named_refuses(prefix: str):
    up = Upstream(delay=0.0).start()
    try:
        # Redis down at start: no slice is known (how many gateways share the limits?): refused
        pd = PolicyDispatcher(_policy(f"redis://127.0.0.1:{free_port()}/0", prefix, backend=up.url))
        await pd.start()
        try:
            assert not pd.state.available and not pd.state.degraded
            with pytest.raises(Refused) as ei:
                await pd.submit("ka", {"model": "m", "prompt": "x", "max_tokens": 1})
            assert ei.value.reason == "state_unavailable"
        finally:
            await pd.close()
    finally:
        up.stop()
    with pytest.raises(PolicyError, match=r"state\.on_loss.*local, refuse.*'sometimes'"):
        _policy("redis://127.0.0.1:1/0", prefix, on_loss="sometimes")


def _budgets(url: str, backend: str, prefix: str) -> Any:
    return parse_policy(f"""
pools:
  p:
    models: [m]
    backends: [{{url: "{backend}", max_in_flight: 16}}]
    prices: {{input: 0, output: 1000000}}
classes:
  batch: {{weight: 1}}
orgs:
  a: {{keys: [ka], classes: [batch], budget: {{amount: 10, per: day}}}}
  b: {{keys: [kb], classes: [batch], budget: {{amount: 10, per: day}}}}
state: {{redis: "{url}", prefix: "{prefix}", lease_seconds: 1}}
""")


async def test_alone_each_gateway_spends_at_most_its_part_of_what_was_left_of_a_budget(prefix: str):
    one = {"model": "m", "prompt": "x", "max_tokens": 1}  # costs exactly 1

    async def spend_two(pds: list[PolicyDispatcher]) -> None:  # 2 of a's 10 spent, each gateway saw its budget
        for pd in pds:
            await pd.submit("ka", one)

    async with _alone(prefix, 2, lambda url, backend: _budgets(url, backend, prefix), before=spend_two) as (_, _, pds):
        ok = refused = 0
        for i in range(20):
            try:
                await pds[i % 2].submit("ka", one)
                ok += 1
            except Refused as exc:
                assert exc.reason == "budget_exhausted", exc
                refused += 1
        # together never past the 8 left (each its half of what it last saw left: 8 or 9)
        assert 6 <= ok <= 8 and ok + refused == 20
        with pytest.raises(Refused) as ei:  # b's budget was never seen: what is left is unknown here
            await pds[0].submit("kb", one)
        assert ei.value.reason == "state_unavailable" and "budget" in str(ei.value)


async def test_alone_a_caller_that_leaves_frees_its_place_and_its_slot(prefix: str):
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    async with _alone(prefix, 1, lambda url, backend: _policy(url, prefix, limits="max_in_flight: 1", backend=backend,
                                                              lease=1.0)) as (_, up, pds):
        pd = pds[0]
        up.hold = True
        running = asyncio.create_task(pd.submit("ka", body))
        await _until(lambda: up.now == 1, "the first request to run")
        waiting = asyncio.create_task(pd.submit("kb", body))
        await _until(lambda: pd.state.stats()["candidates"] == 1, "the second to wait")
        waiting.cancel()  # its client went away while it waited alone
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await _until(lambda: pd.state.stats()["candidates"] == 0, "its place to be given up")
        running.cancel()  # and this one while it ran: its slot comes back
        with pytest.raises(asyncio.CancelledError):
            await running
        up.hold = False
        up.release()
        assert (await asyncio.wait_for(pd.submit("kb", body), LIMIT))["choices"]
        assert pd.state.stats()["holding"] == 0


async def test_a_teams_max_users_counts_its_live_users_over_every_gateway(redis_server: RedisServer, prefix: str):
    """``max_users`` (nested shares) is the team's over the fleet: a user live at one gateway
    is live at all (its requests at another are admitted), a new user beyond the bound is
    refused wherever it arrives (429 ``too_many_users``), and a user whose last request ends
    at every gateway frees its place."""
    pol = _policy(redis_server.url, prefix, orgs="""  acme:
    classes: [batch]
    users: equal
    teams:
      research: {keys: [kr], max_users: 2}
""")
    one, two = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await one.start()
    await two.start()
    try:
        def flow(user: str) -> Flow:
            return Flow("acme", "batch", "p", "research", user)

        t1 = await one.admit(flow("ana"))
        r1 = _req(flow("ana"))
        one.bind(t1, r1)
        t2 = await two.admit(flow("bo"))
        r2 = _req(flow("bo"))
        two.bind(t2, r2)
        t3 = await two.admit(flow("ana"))  # live at the other gateway: admitted here too
        r3 = _req(flow("ana"))
        two.bind(t3, r3)
        for st in (one, two):
            with pytest.raises(Refused) as ei:
                await st.admit(flow("cy"))
            assert ei.value.reason == "too_many_users" and "all gateways together" in str(ei.value)
        one.ended(r1)  # ana is still live at gateway two
        with pytest.raises(Refused):
            await one.admit(flow("cy"))
        two.ended(r3)  # ana's last request: her place frees
        for _ in range(50):
            await asyncio.sleep(0.02)
            try:
                t4 = await one.admit(flow("cy"))
                break
            except Refused:
                continue
        else:
            pytest.fail("ana's place never freed")
        assert t4 is not None and t4.user is not None
        one.drop(t4)
    finally:
        await one.close()
        await two.close()


async def test_a_flows_nearest_deadline_goes_first_whichever_gateway_holds_it(
        redis_server: RedisServer, prefix: str):
    """EDF inside a flow holds over the fleet (docs/design.md §5d): the decider orders a flow's
    candidates by their deadlines, so with the slots held, the next goes to the flow's request
    due soonest, whichever gateway it waits at; one without a deadline goes after them."""
    pol = _policy(redis_server.url, prefix, limits="max_in_flight: 4")
    a, b = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await a.start()
    await b.start()
    order: list[str] = []
    try:
        holds = [_req(A) for _ in range(4)]
        for h in holds:
            await a.acquire(h, BACKENDS, None)  # every slot, held
        now = a.clock()

        def due(seconds: float | None) -> Request:
            r = _req(A)
            if seconds is not None:
                r.deadline = r.drop_at = now + seconds
            return r

        waiting = {"none": (a, due(None)), "late": (b, due(30.0)), "soon": (a, due(10.0)), "soonest": (b, due(5.0))}

        async def wait(name: str, st: RedisState, r: Request) -> None:
            await st.acquire(r, BACKENDS, None if r.deadline is None else r.deadline)
            order.append(name)
            await asyncio.sleep(0.01)
            st.attempt_over(r, None)

        tasks = []
        for name, (st, r) in waiting.items():
            tasks.append(asyncio.create_task(wait(name, st, r)))
            await asyncio.sleep(0.05)  # (each one a candidate at the decider before the next)
        a.attempt_over(holds[0], None)  # one slot frees: the four go through it one by one
        await asyncio.wait_for(asyncio.gather(*tasks), LIMIT)
        for h in holds[1:]:
            a.attempt_over(h, None)
    finally:
        await a.close()
        await b.close()
    assert order == ["soonest", "soon", "late", "none"], order


async def test_an_org_rate_that_waits_takes_its_tokens_ahead_once_over_every_gateway(redis_server: RedisServer,
                                                                                      prefix: str):
    """``on_limit: wait`` in ``ADMIT``: over the org's rate, a request that may wait longer
    than its token's refill takes the token ahead (the bucket in Redis goes into debt) and its
    ticket says how long until it refills; the next admission, at any gateway, waits for the
    next token; one that may not wait that long is refused, told when its token would come.
    The waits are Redis's computation on its own clock (two requests a minute: 30 s a token),
    checked with the few milliseconds the round trips take."""
    pol = _policy(redis_server.url, prefix, orgs="  c: {keys: [kc], classes: [batch], requests_per_minute: 2}")
    a, b = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await a.start()
    await b.start()
    try:
        c = Flow("c", "batch", "p")
        waits = []
        for st in (a, b, a, b):
            t = await st.admit(c, 1000.0)
            assert t is not None
            waits.append(t.wait)
        assert waits[:2] == [0.0, 0.0]
        assert 29.0 < waits[2] <= 30.0 and 59.0 < waits[3] <= 60.0, waits  # one bucket, two gateways
        for st, horizon in ((b, 80.0), (a, None)):  # the next token comes 90 s from now: refused
            with pytest.raises(Refused) as ei:
                await st.admit(c, horizon)
            assert ei.value.reason == "rate_limited" and 89.0 < (ei.value.retry_after or 0) <= 90.0
        t = await b.admit(c, float("inf"))  # no bound: it waits
        assert t is not None and 89.0 < t.wait <= 90.0
    finally:
        await a.close()
        await b.close()


def test_while_redis_is_lost_an_org_rate_that_waits_takes_its_tokens_ahead_in_the_gateways_slice(prefix: str):
    """Degraded (``on_loss: local``): the gateway admits alone within its slice of the org's
    rate, and a request that may wait takes its token ahead there too (an injected clock;
    one live gateway: the whole rate is its slice)."""
    pol = _policy("redis://127.0.0.1:9", prefix, orgs="  c: {keys: [kc], classes: [batch], requests_per_minute: 2}")
    now = [100.0]
    st = RedisState(pol.state, pol, clock=lambda: now[0])
    st._gateways = [st.gateway_id]  # (what its last look at the live gateways found)
    c = Flow("c", "batch", "p")
    assert [st._admit_alone(c, 1000.0) for _ in range(2)] == [None, None]  # (nothing to hold: no ticket)
    t = st._admit_alone(c, 1000.0)
    assert t is not None and t.wait == pytest.approx(30.0)
    with pytest.raises(Refused) as ei:
        st._admit_alone(c, 59.0)  # its token would come in 60 s
    assert ei.value.reason == "rate_limited" and ei.value.retry_after == pytest.approx(60.0)
    with pytest.raises(Refused):
        st._admit_alone(c, None)  # on_limit: refuse
    now[0] += 30.0
    t = st._admit_alone(c, 31.0)
    assert t is not None and t.wait == pytest.approx(30.0)


async def test_a_corrupt_event_is_skipped_and_the_fleet_goes_on(redis_server: RedisServer, prefix: str,
                                                                caplog: pytest.LogCaptureFixture):
    """A record in ``P ev`` (or a message) the decider cannot read, as a gateway of another
    version or a hand in Redis might leave: skipped, logged; the grants go on."""
    pol = _policy(redis_server.url, prefix, limits="max_in_flight: 1")
    a, b = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await a.start()
    await b.start()
    try:
        r1 = _req(A)
        await a.acquire(r1, BACKENDS, None)  # a decides (it found no decider), r1 runs
        for _ in range(100):  # (its queues made from what Redis holds)
            if a.decider("p") is not None:
                break
            await asyncio.sleep(0.02)
        assert a.decider("p") is not None and a._client is not None
        await a._client.execute_command("EVAL", "local q = redis.call('INCR', KEYS[1]) "
                                        "local j = '{\"t\":\"c\",\"m\":\"x:1:1\",\"pool\":\"p\","
                                        "\"flow\":[\"a\",\"batch\",\"p\"],\"cost\":\"abc\","
                                        "\"tokens\":0,\"q\":' .. q .. '}' "
                                        "redis.call('ZADD', KEYS[2], q, j) "
                                        "redis.call('PUBLISH', KEYS[3], 'e\\n[' .. j .. ']') "
                                        "return q", 3, f"{prefix}evq", f"{prefix}ev", f"{prefix}wake")
        r2 = _req(B)
        waiting = asyncio.create_task(b.acquire(r2, BACKENDS, None))
        await asyncio.sleep(0.1)
        a.attempt_over(r1, None)
        assert await asyncio.wait_for(waiting, LIMIT) == BACKENDS[0][0]  # granted after the bad record
        b.attempt_over(r2, None)
        assert any("skipped an event" in m for m in caplog.messages), caplog.messages
    finally:
        await a.close()
        await b.close()


async def _decider_of(*gws: RedisState) -> RedisState:
    for _ in range(200):
        for g in gws:
            if g.decider("p") is not None:
                return g
        await asyncio.sleep(0.02)
    raise AssertionError("no gateway became the fleet's decider")


async def test_a_grant_redis_has_no_room_for_waits_for_what_the_decider_has_not_seen(
        redis_server: RedisServer, prefix: str):
    """The decider's view can lag what Redis holds (a running attempt put back after a restart,
    its own release applied before the others' events): ``DECIDE`` makes no start past a limit
    the leases count; the decider waits for what it has not seen, then grants."""
    pol = _policy(redis_server.url, prefix, limits="max_in_flight: 1")
    a, b = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await a.start()
    await b.start()
    try:
        r1 = _req(A)
        await a.acquire(r1, BACKENDS, None)
        lead = await _decider_of(a, b)
        assert lead is a and a._client is not None
        # an attempt the decider knows nothing of holds the pool's slot (far in the future)
        await a._client.zadd(f"{prefix}lease:pool:p", {"ghost:1:1": time.time() + 3600})
        r2 = _req(B)
        waiting = asyncio.create_task(b.acquire(r2, BACKENDS, None))
        await asyncio.sleep(0.1)
        a.attempt_over(r1, None)  # free in the decider's view, not in Redis's
        await asyncio.sleep(0.8)
        assert not waiting.done(), "a start past the pool's limit"
        assert (await b.global_counts())["pool:p"] == 1
        await a._client.zrem(f"{prefix}lease:pool:p", "ghost:1:1")
        assert await asyncio.wait_for(waiting, LIMIT) == BACKENDS[0][0]
        b.attempt_over(r2, None)
    finally:
        await a.close()
        await b.close()


async def test_the_deciders_own_requests_ride_its_round_trips_and_one_that_leaves_is_gone(
        redis_server: RedisServer, prefix: str):
    """While candidates wait, the decider's own gateway sends its candidates and releases with
    its ``DECIDE`` (a release and the start it frees in one round trip), not by ``OFFER``; one
    of its candidates that gives up leaves Redis too, and blocks nobody."""
    pol = _policy(redis_server.url, prefix, limits="max_in_flight: 1")
    a, b = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await a.start()
    await b.start()
    got: list[str] = []
    n = 40
    try:
        r0 = _req(A)
        await a.acquire(r0, BACKENDS, None)
        assert await _decider_of(a, b) is a
        a.attempt_over(r0, None)
        offers0 = a.trips_by.get("OFFER", 0)
        # two callers per gateway: something always waits
        tasks = [asyncio.create_task(_caller(g, f, got, n, 0.005)) for g, f in ((a, A), (a, A), (b, B), (b, B))]
        await asyncio.wait_for(asyncio.gather(*tasks), LIMIT)
        mine = got.count("a")
        assert abs(mine - 0.75 * len(got)) <= 4, got  # weights 3:1 (a on the decider's gateway)
        assert a.trips_by.get("OFFER", 0) - offers0 <= mine / 4, (a.trips_by, mine)
        # one of the decider's own candidates gives up while the slot is held elsewhere
        r1 = _req(B)
        await b.acquire(r1, BACKENDS, None)
        with pytest.raises(Refused):
            await a.acquire(_req(A), BACKENDS, a.clock() + 0.3)
        b.attempt_over(r1, None)
        r2 = _req(B)
        assert await asyncio.wait_for(b.acquire(r2, BACKENDS, None), LIMIT) == BACKENDS[0][0]
        b.attempt_over(r2, None)
        assert a._client is not None
        for _ in range(100):
            if not await a._client.hlen(f"{prefix}cand:p"):
                break
            await asyncio.sleep(0.02)
        assert not await a._client.hlen(f"{prefix}cand:p"), "the candidate that left is still in Redis"
    finally:
        await a.close()
        await b.close()


async def test_slots_kept_back_hold_over_the_fleet(redis_server: RedisServer, prefix: str):
    """``limits.headroom``: the last free slot is kept for a flow below its part, over every
    gateway: an org running its part already waits even when nothing else does (no start at
    once past the decider), and the slot goes to another org's request when one comes."""
    pol = _policy(redis_server.url, prefix, limits="max_in_flight: 3, headroom: 1")
    a, b = RedisState(pol.state, pol), RedisState(pol.state, pol)
    await a.start()
    await b.start()
    try:
        held = [_req(A), _req(A)]
        for r in held:
            await asyncio.wait_for(b.acquire(r, BACKENDS, None), LIMIT)
        third = asyncio.create_task(b.acquire(_req(A), BACKENDS, None))
        await asyncio.sleep(0.8)
        assert not third.done(), "org a took the slot kept back"
        rb = _req(B)
        assert await asyncio.wait_for(a.acquire(rb, BACKENDS, None), LIMIT) == BACKENDS[0][0]
        assert not third.done()
        a.attempt_over(rb, None)
        b.attempt_over(held[0], None)
        await asyncio.wait_for(third, LIMIT)
        third.cancel()
    finally:
        await a.close()
        await b.close()


async def test_the_predicted_wait_is_the_deciders_in_a_fleet(redis_server: RedisServer, prefix: str):
    """Each gateway's engine sees only its own requests: in a fleet the predicted wait of a new
    request is the fleet's decider's (its queues hold every gateway's), and a gateway that does
    not decide predicts nothing (``None``) rather than something only its own requests say."""
    up = Upstream(delay=0.02).start()
    try:
        pol = _policy(redis_server.url, prefix, limits="max_in_flight: 2", backend=up.url)
        async with _dispatchers(pol) as pds:
            body = {"model": "m", "prompt": "x", "max_tokens": 1}
            await asyncio.wait_for(asyncio.gather(*(pds[i % 2].submit("ka", body) for i in range(24))), LIMIT)
            lead = [pd for pd in pds if pd.state.decider("p") is not None]
            assert len(lead) == 1
            other = next(pd for pd in pds if pd is not lead[0])
            assert other.engine.predicted_wait("a", "batch", "p") is None
            assert lead[0].engine.predicted_wait("a", "batch", "p") == 0.0  # (idle: a slot is free)
            # the decider's queue holds the other gateway's waiting requests too
            flood = [asyncio.create_task(other.submit("ka", body)) for _ in range(12)]
            q = lead[0].state.decider("p")
            assert q is not None
            for _ in range(500):  # (until some of them wait at the decider: at the other gateway)
                if q.n_waiting:
                    break
                await asyncio.sleep(0.002)
            assert q.n_waiting
            wa = lead[0].engine.predicted_wait("a", "batch", "p")
            assert wa is not None and wa > 0.0, "a's requests wait at the other gateway: a new one of a's waits"
            assert other.engine.predicted_wait("a", "batch", "p") is None
            await asyncio.wait_for(asyncio.gather(*flood), LIMIT)
    finally:
        up.stop()


async def test_a_new_decider_keeps_the_meters_the_last_one_left(redis_server: RedisServer, prefix: str):
    """The decider's role moving (its gateway killed) does not forgive a flow the service it took
    ahead of the others: the next decider starts each flow's meter as far ahead of its virtual
    time as the last one left it (written with the shares table, at most ``lease / 2`` old)."""
    pol = _policy(redis_server.url, prefix, limits="max_in_flight: 1", lease=5.0)
    async with _decider_and_other(pol) as (a, b, r1):
        r2 = _req(B)
        waiting = asyncio.create_task(b.acquire(r2, BACKENDS, None))  # b's org waits: a busy period
        a.charged(r1, 300.0)  # a's running request delivered far more than it was charged
        q = a.decider("p")
        assert q is not None
        for _ in range(200):  # (the correction rides on a round trip within ADJUST_DELAY)
            if q.meter(A) - q.sched.virtual_time > 50:
                break
            await asyncio.sleep(0.02)
        ahead = q.meter(A) - q.sched.virtual_time
        assert ahead > 50, ahead
        assert a._client is not None
        for _ in range(300):  # (written with the next shares table: every max(lease / 2, 1 s))
            if b'[["a"' in (await a._client.get(f"{prefix}leads") or b""):
                break
            await asyncio.sleep(0.02)
        await a.abandon()  # the decider dies: its role expires (1.5 s), r1's leases later (5 s)
        qb = (await _decider_of(b)).decider("p")  # b's next look takes the role; r1 still holds the slot
        assert qb is not None and not waiting.done()
        got = qb.meter(A) - qb.sched.virtual_time
        assert abs(got - ahead) < 0.05 * ahead, (got, ahead)
        for k in (f"{prefix}lease:pool:p", f"{prefix}lease:backend:{BACKENDS[0][0]}"):  # (r1: its gateway died)
            await a._client.zrem(k, f"{a.gateway_id}:{r1.id}:1")
        assert await asyncio.wait_for(waiting, LIMIT) == BACKENDS[0][0]
        b.attempt_over(r2, None)
