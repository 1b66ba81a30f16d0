"""Failure isolation in the dispatcher: one bad reply, one bad tenant or one missing route must
not take the fleet down. One regression per fault, against the loopback fault server.
(``max_attempts=1`` throughout: these tests classify failures; retries are test_dispatch_retry.py's.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from dispatch_helpers import FakeServer, GateBackend, LagProbe, servers_in_a_thread, settle, wait_until

import json

from sfq.backends import OpenAIBackend
from sfq.backends.health import HealthOptions
from sfq.backends.openai import parse_retry_after
from sfq.backends.sse import SSEParser, payload_bytes
from sfq.cost import CostEstimator
from sfq.dispatch import Dispatcher, DispatchRecord
from sfq.errors import (
    BackendError,
    BackendHTTPError,
    BackendRateLimited,
    BackendTimeout,
    BackendUnavailable,
    NoHealthyBackend,
)

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


def body(prompt: str = "hello", n: int = 4, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": n, **kw}


# ------------------------------------------------------------------ 1. calibration
async def test_an_absurd_usage_report_cannot_poison_calibration(fake: FakeServer, tmp_path):
    """A reply claiming 10**12 prompt and completion tokens for a 5-character prompt: every later
    request, of every flow, is still estimated sanely and served; the saved state loads."""
    est = CostEstimator(chars_per_token=4.0)
    fake.modes.append("absurd")
    async with Dispatcher([OpenAIBackend(fake.url)], max_attempts=1, estimator=est) as d:
        await d.submit("victim", body())
        assert est.clamped == 2
        cpt = est.chars_per_token_of("m")
        assert 1.0 <= cpt <= 4.0  # moved at most by the factor 4 one report may move it
        for flow in ("a", "b", "victim"):
            e = est.estimate(body("x" * 400, 100), flow)
            assert e.prompt_tokens <= 4 * 100 and e.cost <= 400 + 100
            await d.submit(flow, body("x" * 400, 100))
    path = tmp_path / "cal.json"
    est.save(path)
    fresh = CostEstimator()
    fresh.load(path)
    assert fresh.chars_per_token_of("m") == est.chars_per_token_of("m")


def test_one_outlier_moves_a_calibrated_ratio_little():
    est = CostEstimator(input_weight=1.0, output_weight=0.0)
    b = body("x" * 400, 8)
    for _ in range(20):
        est.observe(est.estimate(b), {"prompt_tokens": 100, "completion_tokens": 8})
    assert est.chars_per_token_of("m") == 4.0
    tiny = est.estimate(body("x" * 25))
    est.observe(tiny, {"prompt_tokens": 10**6, "completion_tokens": 1})  # 1e6 tokens for 25 chars
    assert est.chars_per_token_of("m") > 3.7  # one report: at most its share of the chars, times 4
    assert est.estimate(b).prompt_tokens < 110
    est.observe(tiny, {"prompt_tokens": 1, "completion_tokens": 1})  # absurdly few tokens: clamped too
    assert est.chars_per_token_of("m") < 4.3


def test_a_poisoned_saved_state_is_refused_on_load(tmp_path):
    """A state saved before the clamps existed (10**12 tokens for 25 characters), or any total
    that no server could have produced, is a ValueError naming the entry; nothing changes."""
    est = CostEstimator()
    before = est.state()
    entry = {"output": 4, "cap": 4, "n_out": 1, "chars": 25, "tokens": 1e12, "n_prompt": 1}
    for bad, match in ((entry, "characters per token"),
                       ({**entry, "tokens": 5, "output": 10**12}, "exceeds 'cap'"),
                       ({**entry, "tokens": 5, "n_prompt": 0}, "disagree")):
        p = tmp_path / "bad.json"
        p.write_text(json.dumps({"version": 1, "models": {"m": bad}, "flows": []}))
        with pytest.raises(ValueError, match=match) as ei:
            est.load(p)
        assert "model 'm'" in str(ei.value)
        assert est.state() == before


# ------------------------------------------------------------------ 2. resend only what is safe
async def test_a_fresh_connection_that_drops_is_not_resent(fake: FakeServer):
    """ServerDisconnectedError on a fresh connection (and on a reused one, once the request was
    written): the server may have the request, so it is not sent again."""
    fake.modes.extend(["drop", "ok", "drop"])
    b = OpenAIBackend(fake.url)
    async with Dispatcher([b], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10)) as d:
        with pytest.raises(BackendUnavailable) as ei:
            await d.submit("f", BODY)
        assert len(fake.requests) == 1 and b.resent == 0 and not ei.value.never_sent
        await d.submit("f", BODY)  # leaves a pooled connection
        with pytest.raises(BackendUnavailable):
            await d.submit("f", BODY)  # reused, written, dropped: not resent either
        assert len(fake.requests) == 3 and b.resent == 0
        assert d.stats()["backends"][fake.url]["healthy"]  # two isolated drops: not down


def _pooled(b: OpenAIBackend) -> list[Any]:
    """The connections waiting in the backend's keep-alive pool."""
    assert b._pool is not None
    return list(b._pool._idle)


async def test_a_pooled_connection_that_fails_before_writing_is_resent(fake: FakeServer):
    """A kept-alive connection that turns out closed when the request is written: the request
    provably never left, so it goes out again on another connection - once."""
    b = OpenAIBackend(fake.url)
    async with Dispatcher([b], max_attempts=1) as d:
        await d.submit("f", BODY)
        pooled = _pooled(b)
        assert len(pooled) == 1
        pooled[0].transport.is_closing = lambda: True  # closed by the server, seen just too late
        r = await d.submit("f", BODY)
        assert r["usage"]["completion_tokens"] == 4
        assert _pooled(b)[0] is not pooled[0]  # the new connection is kept instead
    assert b.resent == 1 and len(fake.requests) == 2  # the server saw each request once


async def test_the_request_path_runs_no_client_session(fake: FakeServer):
    """Requests go over the backend's own pooled connections (no aiohttp session, no trace
    hook): one connection serves request after request."""
    b = OpenAIBackend(fake.url)
    async with Dispatcher([b]) as d:
        for _ in range(5):
            await d.submit("f", BODY)
        pool = b._pool
        assert pool is not None and pool.idle == 1 and pool.connects == 1
        assert b._aux is not None and b._aux.trace_configs == []  # the health checks' own session
    assert b.resent == 0 and len(fake.requests) == 5


async def test_a_connection_the_server_closed_unseen_is_resent():
    """The server closes a kept-alive connection; its end is waiting in the client's socket but
    the event loop has not read it yet. The request is not written there (the pool looks at the
    socket before writing) but on a new connection: the server sees it once, nothing fails."""
    with servers_in_a_thread(1) as (srv,):
        b = OpenAIBackend(srv.url)
        try:
            await b.complete("completions", BODY)
            pooled = _pooled(b)
            assert len(pooled) == 1
            fd = pooled[0].transport.get_extra_info("socket").fileno()
            runner = srv._runner
            assert runner is not None and runner.server is not None

            async def close_kept_alive() -> None:
                for handler in runner.server.connections:  # type: ignore[union-attr]
                    handler.transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)

            assert srv.loop is not None
            asyncio.run_coroutine_threadsafe(close_kept_alive(), srv.loop).result(5)
            readable, _, _ = select.select([fd], [], [], 5)  # the server's end reached this socket
            assert readable
            # no await between here and the write: the loop cannot have read the end yet
            r = await b.complete("completions", BODY)
            assert r["usage"]["completion_tokens"] == 4
            assert b.resent == 1 and len(srv.requests) == 2
        finally:
            await b.close()


async def test_an_idempotent_request_is_resent_after_a_lost_connection(fake: FakeServer):
    fake.modes.extend(["drop", "ok"])
    b = OpenAIBackend(fake.url)
    async with Dispatcher([b], max_attempts=1) as d:
        r = await d.submit("f", BODY, idempotent=True)
        assert r["usage"]["completion_tokens"] == 4
    assert b.resent == 1 and len(fake.requests) == 2


async def test_a_refused_connection_says_never_sent(refused_url: str):
    async with Dispatcher([OpenAIBackend(refused_url)], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10)) as d:
        with pytest.raises(BackendUnavailable) as ei:
            await d.submit("f", BODY)
        assert ei.value.never_sent and not d.stats()["backends"][refused_url]["healthy"]


# ------------------------------------------------------------------ 3. health
@pytest.mark.parametrize("routes, used", [((False, True, True), "models"), ((False, False, True), "completion"),
                                         ((False, False, False), "chat")])
async def test_a_backend_without_a_health_route_comes_back(fake: FakeServer, routes, used):
    fake.health_route, fake.models_route, completions = routes
    fake.modes.append("503")
    b = OpenAIBackend(fake.url)
    async with Dispatcher([b], max_attempts=1, health=HealthOptions(backoff=0.02, max_backoff=0.05, error_window=1)) as d:
        with pytest.raises(BackendHTTPError):
            await d.submit("f", BODY)
        assert not d.stats()["backends"][fake.url]["healthy"]
        fake.completions_route = completions
        chat = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        waiting = asyncio.create_task(d.submit("g", BODY if completions else chat))
        await wait_until(lambda: d.stats()["backends"][fake.url]["healthy"], "the backend to return")
        assert (await waiting)["usage"]["completion_tokens"] == 4
    assert b._health_route == used


async def test_one_tenants_5xx_do_not_take_the_backend_down(fake: FakeServer):
    """A flow whose every request gets a 500 fails alone: the backend stays in rotation and the
    other flows are served. A backend that fails most of its replies does leave."""
    fake.fail_prompt = "poison"
    async with Dispatcher([OpenAIBackend(fake.url, max_in_flight=4)], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10)) as d:
        bad = [asyncio.create_task(d.submit("bad", body("poison"))) for _ in range(6)]
        good = [asyncio.create_task(d.submit(f"good{i % 8}", body())) for i in range(64)]
        res = await asyncio.gather(*bad, *good, return_exceptions=True)
        assert all(isinstance(r, BackendHTTPError) and r.status == 500 for r in res[:6])
        assert all(isinstance(r, dict) for r in res[6:])
        s = d.stats()
        assert s["backends"][fake.url]["healthy"] and s["backends"][fake.url]["unhealthy_spells"] == 0
        assert s["flows"]["bad"]["failed"] == 6 and s["flows"]["good0"]["completed"] == 8
        fake.fail_prompt = None
        fake.mode = "500"  # now the backend itself is broken: every flow sees it
        for i in range(20):
            if not d.stats()["backends"][fake.url]["healthy"]:
                break
            with pytest.raises(BackendHTTPError):
                await d.submit(f"good{i % 6}", BODY)
        assert 5 <= i < 19  # down once other flows than the worst one see >= 50% 5xx (and at least five)
        st = d.stats()["backends"][fake.url]
        assert not st["healthy"] and "replies to other flows than the one failing most were 5xx" in st["down_reason"]


async def test_transport_failures_in_a_row_take_a_backend_out(fake: FakeServer):
    fake.mode = "cut"
    async with Dispatcher([OpenAIBackend(fake.url)], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10)) as d:
        for i in range(3):
            assert d.stats()["backends"][fake.url]["healthy"], i
            with pytest.raises(BackendUnavailable):
                await d.submit("f", BODY)
        assert "3 transport failure(s) in a row" in d.stats()["backends"][fake.url]["down_reason"]


async def test_health_checks_back_off_to_a_cap(sched):
    """However long the outage, checks never get further apart than ``max_backoff``, so a
    recovered backend gets traffic within that."""
    b = GateBackend("b", max_in_flight=1)
    b.healthy = False
    async with Dispatcher([b], max_attempts=1, scheduler=sched, health=HealthOptions(backoff=0.001, max_backoff=0.004, transport_failures=1)) as d:
        t = asyncio.create_task(d.submit("f", body()))
        await settle()
        b.fail(0, BackendUnavailable("gone", backend="b"))
        with pytest.raises(BackendUnavailable):
            await t
        await wait_until(lambda: b.health_checks >= 8, "repeated health checks")
        assert d.stats()["backends"]["b"]["check_interval"] == 0.004
        b.healthy = True
        await wait_until(lambda: d.stats()["backends"]["b"]["healthy"], "recovery")
        assert d.stats()["backends"]["b"]["check_interval"] is None
    assert Dispatcher(["http://x"], max_attempts=1).health.max_backoff == 2.0  # the default cap


# ------------------------------------------------------------------ 4. bounded waits
async def test_a_stream_has_a_total_deadline(fake: FakeServer):
    """A stream that keeps sending tokens and keep-alive comments forever ends at its total
    deadline with BackendTimeout; the slot is freed and the backend is not blamed."""
    fake.mode = "forever"
    b = OpenAIBackend(fake.url, stream_timeout=0.3, max_in_flight=1)
    assert OpenAIBackend(fake.url).stream_total == 1800.0  # the default
    async with Dispatcher([b], max_attempts=1) as d:
        got = 0
        with pytest.raises(BackendTimeout, match="total deadline of 0.3 s"):
            async for _ in d.stream("f", BODY):
                got += 1
        assert got > 0
        s = d.stats()
        assert s["flows"]["f"]["in_flight"] == 0 and s["backends"][fake.url]["healthy"]
        fake.mode = "ok"
        await d.submit("f", BODY)


async def test_submit_waits_a_bounded_time_when_no_backend_is_healthy(refused_url: str, sched):
    async with Dispatcher([OpenAIBackend(refused_url)], max_attempts=1, scheduler=sched,
                          unavailable_timeout=0.1, health=HealthOptions(backoff=10, max_backoff=10)) as d:
        with pytest.raises(BackendUnavailable):
            await d.submit("f", BODY)  # the only backend is down now
        meter = d.meter("g")
        with pytest.raises(NoHealthyBackend, match="no backend of pool '\\(default\\)' was healthy for 0.1 s"):
            await d.submit("g", BODY)
        s = d.stats()
        assert s["flows"]["g"]["unavailable"] == 1 and s["flows"]["g"]["waiting"] == 0
        assert d.meter("g") == meter and len(d.scheduler_of(None)) == 0  # uncharged
    assert Dispatcher(["http://x"], max_attempts=1).unavailable_timeout == 30.0
    with pytest.raises(ValueError, match="unavailable_timeout"):
        Dispatcher(["http://x"], max_attempts=1, unavailable_timeout=0)


async def test_stats_is_json_and_one_flow_is_read_alone(sched):
    """``stats()`` is plain JSON (flow ids become its keys); ``flow_stats(flow)`` reads one flow's
    row without building the others."""
    b = GateBackend("b", max_in_flight=1)
    async with Dispatcher([b], max_attempts=1, scheduler=sched) as d:
        ts = [asyncio.create_task(d.submit(i, body())) for i in range(2000)]
        await settle()
        s = json.loads(json.dumps(d.stats()))
        assert len(s["flows"]) == 2000 and s["flows"]["7"]["waiting"] == 1
        assert s["pools"]["null"]["waiting"] == 1999 and s["pools"]["null"]["in_flight"] == 1
        row = d.flow_stats(7)
        assert row is not None and row["waiting"] == 1 and d.flow_stats("nobody") is None
        for t in ts:
            t.cancel()
        await asyncio.gather(*ts, return_exceptions=True)


class CountingDict(dict):  # type: ignore[type-arg]
    walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        CountingDict.walks += 1
        return super().__iter__()

    def items(self):  # type: ignore[no-untyped-def]
        CountingDict.walks += 1
        return super().items()

    def values(self):  # type: ignore[no-untyped-def]
        CountingDict.walks += 1
        return super().values()


async def test_no_rescan_of_all_flows_per_admission_beyond_max_flow_stats(sched):
    """More flows wait than ``max_flow_stats``: admissions never walk the flow table (idle
    flows are kept in their own list, oldest first), and forgetting still works once some go idle."""
    b = GateBackend("b", max_in_flight=1)
    async with Dispatcher([b], max_attempts=1, scheduler=sched, max_flow_stats=10) as d:
        d.tally.rows = CountingDict()
        CountingDict.walks = 0
        ts = [asyncio.create_task(d.submit(i, body())) for i in range(100)]
        await settle()
        assert CountingDict.walks == 0 and len(d.tally.rows) == 100  # nothing idle: nothing forgotten
        for t in ts[50:]:
            t.cancel()
        await asyncio.gather(*ts[50:], return_exceptions=True)
        t = asyncio.create_task(d.submit("new", body()))
        await settle()
        assert CountingDict.walks == 0 and len(d.tally.rows) <= 51  # idle flows forgotten, oldest first
        for x in (*ts[:50], t):
            x.cancel()
        await asyncio.gather(*ts[:50], t, return_exceptions=True)


# ------------------------------------------------------------------ 5. errors, break, SSE, 429
async def test_backend_timeout_is_not_a_timeout_error(fake: FakeServer):
    assert not issubclass(BackendTimeout, TimeoutError) and not issubclass(BackendTimeout, asyncio.TimeoutError)
    fake.mode = "stall"
    async with Dispatcher([OpenAIBackend(fake.url, read_timeout=0.1)], max_attempts=1, health=HealthOptions(backoff=10, max_backoff=10)) as d:
        with pytest.raises(BackendTimeout):
            try:
                async with asyncio.timeout(30):
                    await d.submit("f", BODY)
            except TimeoutError:  # the caller's own timeout: must not see the backend's
                pytest.fail("BackendTimeout was caught as the caller's TimeoutError")


class EventsBackend(GateBackend):
    """Streams one event at once, then waits for the test (``release``/``fail``) or for the end."""

    async def stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.calls.append((endpoint, body, fut))
        try:
            yield {"choices": [{"index": 0, "text": "x"}]}
            reply = await fut
            for ev in reply.get("events", []):
                yield ev
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            raise


async def test_break_frees_the_slot_at_once(sched):
    """``break`` out of ``async for ... in d.stream(...)``, no aclosing, no gc: the next waiting
    request gets the slot on the loop's next step."""
    b = EventsBackend("b", max_in_flight=1)
    async with Dispatcher([b], max_attempts=1, scheduler=sched) as d:
        nxt: asyncio.Task[Any] | None = None
        async for _ev in d.stream("f", body()):
            nxt = asyncio.create_task(d.submit("g", body()))
            await settle()
            assert len(b.calls) == 1  # the stream holds the only slot
            break
        else:
            raise AssertionError("no event")
        await asyncio.sleep(0)
        s = d.stats()
        assert s["flows"]["f"]["in_flight"] == 0 and s["flows"]["f"]["aborted"] == 1
        await settle()
        assert len(b.calls) == 2  # the waiting request got the slot
        b.release(1)
        await nxt
        # ... and aclose()/async with release it too
        async with d.stream("h", body()) as events:
            async for _ev in events:
                break
        assert d.stats()["flows"]["h"]["in_flight"] == 0


def test_sse_parser_is_linear_and_exact():
    """A 32 MB line in 64 KB pieces: each piece is scanned once and kept as it came (no buffer
    that grows by copying); the event comes out whole, joined once."""
    line = b"data: " + json.dumps({"t": "y" * (32 << 20)}).encode() + b"\n\n"
    p = SSEParser()
    out = []
    for i in range(0, len(line), 1 << 16):
        out += p.feed(line[i:i + (1 << 16)])
        assert len(p._line) <= i // (1 << 16) + 1  # pieces, not one re-copied buffer
    assert len(out) == 1 and out[0].size == len(line) - 8 and out[0].join() == line[6:-2] and p.pending == 0
    # every legal shape, fed in one piece and byte by byte, gives the same events
    stream = (b": ping\r\n\r\nevent: message\r\ndata: {\"a\": 1}\r\n\r\ndata: {\"x\": [0,\ndata: 1]}\n\n"
              b"data:2\n\nid: 7\nretry: 5\ndata: [DONE]\n\n")
    whole = [payload_bytes(q) for q in SSEParser().feed(stream)]
    assert whole == [b'{"a": 1}', b'{"x": [0,\n1]}', b"2", b"[DONE]"]
    assert [len(x) if isinstance(x, bytes) else x.size for x in SSEParser().feed(stream)] == [len(x) for x in whole]
    q = SSEParser()
    assert [payload_bytes(x) for i in range(len(stream)) for x in q.feed(stream[i:i + 1])] == whole


async def test_a_32_mb_event_does_not_stall_the_loop():
    with servers_in_a_thread(1) as (srv,):
        srv.mode = "bigline"
        srv.big_payload()
        async with Dispatcher([OpenAIBackend(srv.url)], max_attempts=1) as d:
            with LagProbe() as lag:
                events = [e async for e in d.stream("f", BODY)]
            assert len(events[0]["choices"][0]["text"]) == 32 << 20
    print(f"loop lag on a 32 MB event: {lag.worst * 1000:.1f} ms CPU, {lag.worst_wall * 1000:.1f} ms wall")
    assert lag.worst < 0.05, f"the loop stalled {lag.worst * 1000:.0f} ms (CPU) on one 32 MB event"


async def test_429_carries_status_headers_and_retry_after_and_pauses_one_backend(fake: FakeServer):
    other = FakeServer()
    await other.start()
    try:
        fake.mode, fake.retry_after = "429", "3"
        limited = OpenAIBackend(fake.url, name="limited")
        async with Dispatcher([limited, OpenAIBackend(other.url, name="other")], max_attempts=1) as d:
            with pytest.raises(BackendRateLimited) as ei:
                await d.submit("f", BODY)  # the tie goes to the first backend
            e = ei.value
            assert isinstance(e, BackendHTTPError) and e.status == 429 and e.retry_after == 3.0
            assert e.headers["Retry-After"] == "3" and not e.unhealthy
            st = d.stats()["backends"]
            assert st["limited"]["paused"] and st["limited"]["healthy"] and st["limited"]["rate_limited"] == 1
            for _ in range(3):
                await d.submit("f", BODY)
            assert len(fake.requests) == 1 and len(other.requests) == 3  # paused, not down
    finally:
        await other.stop()
    assert parse_retry_after("120") == 120.0 and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert parse_retry_after("-5") == 0.0 and parse_retry_after(None) is None




# ------------------------------------------------------------------ a flow id of the caller's own type
class _FailingHash:
    """A flow id whose ``__hash__`` raises on its ``k``-th call (and is fine before and after)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.calls = 0

    def __hash__(self) -> int:
        self.calls += 1
        if self.calls == self.k:
            raise RuntimeError(f"hash call #{self.k}")
        return 7

    def __eq__(self, other: object) -> bool:
        return self is other


@pytest.mark.parametrize("k", range(1, 25))
async def test_a_flow_id_whose_hash_fails_later_leaves_nothing_half_done(k: int):
    """Whichever call of its ``__hash__`` raises, a permit of that id gets the error or its turn,
    and the engine is left whole: no slot held, no flow in the core that no queue knows, no
    live request; two other flows then take both slots at once (they would wait forever behind
    a slot held by a request nobody tracks). The id is hashed only on entry (``_Id``)."""
    async with Dispatcher([GateBackend("b", max_in_flight=2)]) as d:
        bad = _FailingHash(k)
        served = False
        try:
            async with d.acquire(bad, cost=10.0):
                served = True
        except RuntimeError as exc:
            assert str(exc) == f"hash call #{k}" and not served
        q = next(iter(d.engine.queues.values()))
        assert (q.n_waiting, len(q.sched), q.in_flight, d.engine.live) == (0, 0, 0, {})

        async def both() -> None:
            async with d.acquire("x", cost=10.0):
                async with d.acquire("y", cost=10.0):
                    pass

        await asyncio.wait_for(both(), 5)
        if served:  # hashed on entry only (the memo's and the stand-ins' lookups and stores)
            assert bad.calls == 4


class _Team:
    """A flow id of a class of the caller's own: equal, with equal hashes, when its name is."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return hash(("team", self.name))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Team) and other.name == self.name

    def __str__(self) -> str:
        return f"team:{self.name}"


async def test_equal_flow_ids_of_a_class_of_ones_own_are_one_flow():
    """Ids made afresh for every call, equal by value, are one flow: one meter (a weight set on
    one instance applies to the others), one row of statistics keyed by the id's ``str``,
    ``flow_stats`` of any equal instance, and ``on_dispatch`` hands back an equal id."""
    seen: list[DispatchRecord] = []
    async with Dispatcher([GateBackend("b", max_in_flight=2)], on_dispatch=seen.append) as d:
        d.set_weight(_Team("a"), 2.0)
        before = d.meter(_Team("a"))
        for _ in range(3):
            async with d.acquire(_Team("a"), cost=100.0):
                pass
        assert d.meter(_Team("a")) == pytest.approx(before + 3 * 100.0 / 2.0)
        assert d.stats()["flows"]["team:a"]["completed"] == 3
        row = d.flow_stats(_Team("a"))
        assert row is not None and row["dispatched"] == 3
        assert d.flow_stats(_Team("nobody")) is None
        assert [r.flow for r in seen] == [_Team("a")] * 3
        assert d.flow_key(_Team("a")) == d.flow_key(_Team("a"))
