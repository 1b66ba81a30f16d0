"""What a permit costs: ``acquire`` + release through the one asyncio driver, against the
leanest thing an embedder would write instead (an ``asyncio.Semaphore``), in one run.

Groups (each round runs ``N`` permits in a fresh event loop; divide a round by
``extra_info["requests"]``; ``extra_info["floor"]`` names the group's floor):

acquire-seq    one caller, one permit at a time, nothing else waiting: ``async with
               asyncio.Semaphore(8)`` (the floor), ``Dispatcher.acquire(flow, body)`` +
               ``grant.finish(usage)``, ``Dispatcher.acquire(flow, cost=...)`` (no body),
               ``PolicyDispatcher.acquire(Flow, body)``.
acquire-1000   1,000 flows each wait for one permit of a pool with one slot; each holder
               releases at once, so every release grants the next: the cost per request end
               to end (its task, its submit, its wait, its grant, its release) with 1,000
               waiting (``asyncio.Semaphore(1)`` with 1,000 waiters is the floor).
grant-1000     the grants alone: 1,000 flows already wait (tasks made, requests queued, outside
               the timing) behind one holder; the timing starts as the holder releases and
               ends when the last has held its permit and released it: per grant, the release
               that hands the slot on, the wake-up of the next holder and its ``async with``.

Where the time goes: each group also runs the parts alone (and ``grant-1000`` the leanest
asyncio driver of the same engine, ``lean_driver``: plain futures in a dict). ``async_with`` is an ``async with``
of an object that does nothing (the event loop's share of any permit); ``engine_only`` is the
request engine that the ``Dispatcher`` drives, called directly without asyncio (the same
``submit(cost=, start=True)`` + ``complete``; with 1,000 waiting, 1,000 submits then a
completion and a poll per grant; for the grants alone, only the completions and polls). A permit's time less those two is the asyncio driver's.

Run: ``PYTHONPATH=python python -m pytest benchmarks/bench_acquire.py --benchmark-only``; the
same file runs against an older tree (its ``python/`` on ``PYTHONPATH``) for a side-by-side:
``benchmarks/compare_acquire.sh OLD_TREE`` interleaves the two.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
from typing import Any

import pytest

import sfq
from sfq.backends import Backend
from sfq.dispatch import Dispatcher, PolicyDispatcher
from sfq.engine import PolicyEngine
from sfq.engine.pool import RUNNING
from sfq.policy.config import policy_from_mapping

N = 5_000
WAITING = 1_000
BODY = {"model": "m", "prompt": "Summarise the following paragraph in one line.", "max_tokens": 64}
USAGE = {"prompt_tokens": 12, "completion_tokens": 40, "total_tokens": 52}


class Nothing(Backend):
    """A backend nobody calls: the embedder's own client would (``acquire`` only grants)."""

    async def complete(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover
        raise AssertionError("acquire never calls the backend")

    async def stream(self, endpoint: str, body: dict[str, Any]):  # type: ignore[no-untyped-def]  # pragma: no cover
        raise AssertionError("acquire never calls the backend")
        yield {}


def _policy(slots: int) -> Any:
    return policy_from_mapping({
        "pools": {"p": {"models": ["m"], "backends": [{"url": "http://b", "name": "b", "max_in_flight": slots}]}},
        "classes": {"c": {"max_queue_length": 100_000}},
        "org_template": {"classes": ["c"]},
        "orgs": {},
    })


def _run(factory: Any) -> None:
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(factory())
    finally:
        loop.close()


def _bench(benchmark: Any, fn: Any, n: int, floor: str, rounds: int = 7) -> None:
    benchmark.extra_info["requests"] = n
    benchmark.extra_info["floor"] = floor
    gc.collect()
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)


# ------------------------------------------------------------------ one at a time
@pytest.mark.benchmark(group="acquire-seq")
def test_seq_semaphore(benchmark: Any) -> None:
    async def run() -> None:
        s = asyncio.Semaphore(8)
        for _ in range(N):
            async with s:
                pass

    _bench(benchmark, lambda: _run(run), N, "semaphore")


@pytest.mark.benchmark(group="acquire-seq")
def test_seq_dispatcher_body(benchmark: Any) -> None:
    async def run() -> None:
        async with Dispatcher([Nothing("b", max_in_flight=8)]) as d:
            for _ in range(N):
                async with d.acquire("team-a", BODY) as grant:
                    grant.finish(USAGE)

    _bench(benchmark, lambda: _run(run), N, "semaphore")


@pytest.mark.benchmark(group="acquire-seq")
def test_seq_dispatcher_cost(benchmark: Any) -> None:
    if "cost" not in inspect.signature(Dispatcher.acquire).parameters:  # an older tree: no permit without a body
        pytest.skip("acquire(flow, cost=...) is not in this tree")

    async def run() -> None:
        async with Dispatcher([Nothing("b", max_in_flight=8)]) as d:
            for _ in range(N):
                async with d.acquire("team-a", cost=100.0):
                    pass

    _bench(benchmark, lambda: _run(run), N, "semaphore")


@pytest.mark.benchmark(group="acquire-seq")
def test_seq_policy_dispatcher(benchmark: Any) -> None:
    async def run() -> None:
        async with PolicyDispatcher(_policy(8), backends={"b": Nothing("b", max_in_flight=8)}) as pd:
            flow = sfq.Flow("acme", "c", "p")
            for _ in range(N):
                async with pd.acquire(flow, BODY) as grant:
                    grant.finish(USAGE)

    _bench(benchmark, lambda: _run(run), N, "semaphore")


@pytest.mark.benchmark(group="acquire-seq")
def test_seq_async_with(benchmark: Any) -> None:
    class Nop:
        async def __aenter__(self) -> None:
            return None

        async def __aexit__(self, *exc: object) -> None:
            return None

    async def run() -> None:
        for _ in range(N):
            async with Nop():
                pass

    _bench(benchmark, lambda: _run(run), N, "semaphore")


@pytest.mark.benchmark(group="acquire-seq")
def test_seq_engine_only(benchmark: Any) -> None:
    if "start" not in inspect.signature(PolicyEngine.submit).parameters:
        pytest.skip("submit(start=True) is not in this tree")
    d = Dispatcher([Nothing("b", max_in_flight=8)])
    e = d.engine
    flow = sfq.Flow("team-a", "default", next(iter(e.queues)))

    def run() -> None:
        for _ in range(N):
            r = e.submit(flow, cost=100.0, start=True)
            e.complete(r)

    _bench(benchmark, run, N, "semaphore")


# ------------------------------------------------------------------ 1,000 waiting
@pytest.mark.benchmark(group="acquire-1000")
def test_waiting_semaphore(benchmark: Any) -> None:
    async def run() -> None:
        s = asyncio.Semaphore(1)

        async def one() -> None:
            async with s:
                await asyncio.sleep(0)

        await asyncio.gather(*(one() for _ in range(WAITING)))

    _bench(benchmark, lambda: _run(run), WAITING, "semaphore", rounds=9)


@pytest.mark.benchmark(group="acquire-1000")
def test_waiting_dispatcher(benchmark: Any) -> None:
    async def run() -> None:
        async with Dispatcher([Nothing("b", max_in_flight=1)]) as d:
            async def one(f: int) -> None:
                async with d.acquire(f, BODY) as grant:
                    await asyncio.sleep(0)
                    grant.finish(USAGE)

            await asyncio.gather(*(one(f) for f in range(WAITING)))

    _bench(benchmark, lambda: _run(run), WAITING, "semaphore", rounds=9)


@pytest.mark.benchmark(group="acquire-1000")
def test_waiting_engine_only(benchmark: Any) -> None:
    if "start" not in inspect.signature(PolicyEngine.submit).parameters:
        pytest.skip("submit(start=True) is not in this tree")

    _bench(benchmark, lambda: _engine_drain(*_engine_queued(range(WAITING))), WAITING, "semaphore", rounds=9)


def _engine_queued(flows: range) -> tuple[Any, list[Any]]:
    """The engine a one-slot ``Dispatcher`` drives, a request (``cost=``, ``start=True``) of
    each of ``flows`` submitted to it; and the one of them that runs."""
    e = Dispatcher([Nothing("b", max_in_flight=1)]).engine
    pool = next(iter(e.queues))
    submitted = (e.submit(sfq.Flow(f, "default", pool), cost=100.0, start=True) for f in flows)
    return e, [r for r in submitted if r.state == "running"]


def _engine_drain(e: Any, running: list[Any]) -> None:
    """Complete what runs and poll, until nothing runs: a completion and a poll per grant."""
    while running:
        e.complete(running.pop())
        running.extend(e.poll())


@pytest.mark.benchmark(group="acquire-1000")
def test_waiting_dispatcher_cost(benchmark: Any) -> None:
    if "cost" not in inspect.signature(Dispatcher.acquire).parameters:
        pytest.skip("acquire(flow, cost=...) is not in this tree")

    async def run() -> None:
        async with Dispatcher([Nothing("b", max_in_flight=1)]) as d:
            async def one(f: int) -> None:
                async with d.acquire(f, cost=100.0):
                    await asyncio.sleep(0)

            await asyncio.gather(*(one(f) for f in range(WAITING)))

    _bench(benchmark, lambda: _run(run), WAITING, "semaphore", rounds=9)


# ------------------------------------------------------------------ the grants alone, 1,000 waiting
class _Drain:
    """A loop with ``WAITING`` tasks queued behind one holder (made by ``setup``, untimed);
    ``drain()`` (timed) lets the holder go and runs until every task has held and released."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tasks: list[asyncio.Future[Any]] = []
        self.go: asyncio.Event | None = None
        self.closer: Any = None

    def close(self) -> None:
        if self.loop is not None:
            if self.closer is not None:
                self.loop.run_until_complete(self.closer())
            self.loop.close()
            self.loop = None

    def setup(self, make: Any) -> None:
        self.close()
        gc.collect()
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(make(self))

    def drain(self) -> None:
        assert self.loop is not None and self.go is not None
        self.go.set()
        self.loop.run_until_complete(asyncio.gather(*self.tasks))


def _bench_grants(benchmark: Any, drain: Any, setup: Any) -> None:
    """``drain()`` timed, after an untimed ``setup()`` each round: per grant, ``WAITING`` of them."""
    benchmark.extra_info["requests"] = WAITING
    benchmark.extra_info["floor"] = "semaphore"
    benchmark.pedantic(drain, setup=setup, rounds=9, iterations=1, warmup_rounds=1)


def _bench_drain(benchmark: Any, make: Any) -> None:
    d = _Drain()
    try:
        _bench_grants(benchmark, d.drain, lambda: d.setup(make))
    finally:
        d.close()


async def _until(test: Any) -> None:
    for _ in range(100_000):  # bounded: the tasks queue within a few loop turns
        if test():
            return
        await asyncio.sleep(0)
    raise AssertionError("the waiting tasks did not all queue")


@pytest.mark.benchmark(group="grant-1000")
def test_grant_semaphore(benchmark: Any) -> None:
    async def make(st: _Drain) -> None:
        s = asyncio.Semaphore(1)
        go = st.go = asyncio.Event()

        async def holder() -> None:
            async with s:
                await go.wait()

        async def one() -> None:
            async with s:
                await asyncio.sleep(0)

        st.tasks = [asyncio.ensure_future(holder())] + [asyncio.ensure_future(one()) for _ in range(WAITING)]
        await _until(lambda: len(s._waiters or ()) >= WAITING)  # type: ignore[attr-defined]

    _bench_drain(benchmark, make)


async def _queued_on_dispatcher(st: _Drain, body: bool) -> None:
    """A ``Dispatcher`` with one slot: a holder (flow -1) until ``st.go`` is set, and ``WAITING``
    flows queued behind it, each holding its permit for one loop turn; ``body``: each permit
    with a body and ``finish(usage)``, else ``cost=`` alone."""
    d = Dispatcher([Nothing("b", max_in_flight=1)])
    await d.start()
    st.closer = d.close
    go = st.go = asyncio.Event()

    async def one(f: int) -> None:
        async with (d.acquire(f, BODY) if body else d.acquire(f, cost=100.0)) as grant:
            await (go.wait() if f < 0 else asyncio.sleep(0))
            if body:
                grant.finish(USAGE)

    st.tasks = [asyncio.ensure_future(one(f)) for f in range(-1, WAITING)]
    await _until(lambda: sum(q.n_waiting for q in d.engine.queues.values()) >= WAITING)


@pytest.mark.benchmark(group="grant-1000")
def test_grant_dispatcher_cost(benchmark: Any) -> None:
    if "cost" not in inspect.signature(Dispatcher.acquire).parameters:
        pytest.skip("acquire(flow, cost=...) is not in this tree")
    _bench_drain(benchmark, lambda st: _queued_on_dispatcher(st, False))


@pytest.mark.benchmark(group="grant-1000")
def test_grant_dispatcher_body(benchmark: Any) -> None:
    _bench_drain(benchmark, lambda st: _queued_on_dispatcher(st, True))


async def _queued_on_a_lean_driver(st: _Drain) -> None:
    """The leanest asyncio driver of the same engine an embedder could write (the floor for
    any driver of it): a dict of plain futures by request id; a release completes the request,
    polls the engine and sets the futures of what started. No permit object, no grant, no
    health count, no statistics, no timer, no cancellation handling: what ``Dispatcher``
    adds to a grant is its time less this one's."""
    d = Dispatcher([Nothing("b", max_in_flight=1)])
    e = d.engine
    pool = next(iter(e.queues))
    loop = asyncio.get_running_loop()
    waiters: dict[int, asyncio.Future[None]] = {}
    go = st.go = asyncio.Event()

    async def one(f: int) -> None:
        r = e.submit(sfq.Flow(str(f), "default", pool), cost=100.0, start=True)
        if r.state != RUNNING:
            fut = waiters[r.id] = loop.create_future()
            await fut
        await (go.wait() if f < 0 else asyncio.sleep(0))
        e.complete(r)
        for s in e.poll():
            waiters.pop(s.id).set_result(None)

    st.tasks = [asyncio.ensure_future(one(f)) for f in range(-1, WAITING)]
    await _until(lambda: len(waiters) >= WAITING)


@pytest.mark.benchmark(group="grant-1000")
def test_grant_lean_driver(benchmark: Any) -> None:
    if "start" not in inspect.signature(PolicyEngine.submit).parameters:
        pytest.skip("submit(start=True) is not in this tree")
    _bench_drain(benchmark, _queued_on_a_lean_driver)


@pytest.mark.benchmark(group="grant-1000")
def test_grant_engine_only(benchmark: Any) -> None:
    if "start" not in inspect.signature(PolicyEngine.submit).parameters:
        pytest.skip("submit(start=True) is not in this tree")
    st: dict[str, Any] = {}

    def setup() -> None:
        gc.collect()
        st["e"], st["running"] = _engine_queued(range(-1, WAITING))

    _bench_grants(benchmark, lambda: _engine_drain(st["e"], st["running"]), setup)
