"""Overhead of the dispatch adapter itself (``sfq.dispatch.Dispatcher``), measured through an
in-process backend that answers at once, so only sfq's own work is on the clock: the cost
estimate, the scheduler's enqueue and dispatch, placement, the event-loop hand-offs, the
completion bookkeeping and the estimator's calibration.

Groups (each round runs ``N`` requests in a fresh event loop; divide a round by
``extra_info["requests"]``):

dispatcher-seq   one caller, one request at a time: ``await d.submit(...)`` in a loop, against
                 ``direct`` (the same loop calling the backend without sfq). The difference of the
                 medians, per request, is the latency sfq adds to a request.
dispatcher-conc  100 callers (100 flows) at once against two backends that yield to the loop once
                 before answering, ``max_in_flight=32`` each: requests overlap, 36 queue in sfq and
                 every completion dispatches the next one (futures, wake-ups): requests per second
                 through the dispatcher on one core, against ``direct`` with the same callers.
dispatcher-stats one ``d.stats()`` call with 50,000 flows known (each served once): a JSON snapshot
                 with a row per flow, so its cost grows with the flows (``extra_info["requests"]``
                 is 1); ``d.flow_stats(flow)`` reads one flow's row alone.
dispatcher-admit admissions of new flows while 2,000 flows wait and ``max_flow_stats`` is 1,000
                 (more flows wait than are kept idle): per admission, no rescan of all flows.

``core`` is the scheduler under the dispatcher: ``compiled`` (``sfq.Scheduler``) or ``reference``.
Run: ``PYTHONPATH=python python -m pytest benchmarks/bench_dispatcher.py --benchmark-only``.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

import sfq
from sfq.backends import Backend
from sfq.cost import CostEstimator
from sfq.dispatch import Dispatcher

N_SEQ = 5_000
N_CONC = 20_000
CALLERS = 100
BODY = {"model": "m", "prompt": "Summarise the following paragraph in one line.", "max_tokens": 64}
REPLY = {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 12, "completion_tokens": 40, "total_tokens": 52}}


class InstantBackend(Backend):
    """Answers every request at once with the same reply (no I/O, no suspension)."""

    async def complete(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        return REPLY

    async def stream(self, endpoint: str, body: dict[str, Any]):  # pragma: no cover - not benchmarked
        yield REPLY


class YieldingBackend(InstantBackend):
    """Answers at once but yields to the event loop first, as any real I/O would: requests
    overlap, so ``max_in_flight`` binds and requests queue in sfq."""

    async def complete(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0)
        return REPLY


CORES = {"compiled": sfq.Scheduler, "reference": sfq.ReferenceScheduler}


@pytest.fixture(params=sorted(CORES))
def core(request):
    if request.param == "compiled" and sfq.CORE != "compiled":
        pytest.skip("the compiled core is not loaded")
    return CORES[request.param]


def _run(coro_factory) -> None:
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(coro_factory())
    finally:
        loop.close()


def _bench(benchmark, fn, n: int, rounds: int) -> None:
    benchmark.extra_info["requests"] = n
    gc.collect()
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)


# ------------------------------------------------------------------ one caller, sequential
@pytest.mark.benchmark(group="dispatcher-seq")
def test_seq_direct(benchmark):
    async def run() -> None:
        b = InstantBackend("b")
        for _ in range(N_SEQ):
            await b.complete("completions", BODY)

    _bench(benchmark, lambda: _run(run), N_SEQ, rounds=7)


@pytest.mark.benchmark(group="dispatcher-seq")
def test_seq_dispatcher(benchmark, core):
    async def run() -> None:
        async with Dispatcher([InstantBackend("b", max_in_flight=64)], estimator=CostEstimator(),
                              scheduler=core) as d:
            for _ in range(N_SEQ):
                await d.submit("team-a", BODY)

    _bench(benchmark, lambda: _run(run), N_SEQ, rounds=7)


# ------------------------------------------------------------------ many callers at once
@pytest.mark.benchmark(group="dispatcher-conc")
def test_conc_direct(benchmark):
    async def run() -> None:
        b = YieldingBackend("b")

        async def caller() -> None:
            for _ in range(N_CONC // CALLERS):
                await b.complete("completions", BODY)

        await asyncio.gather(*(caller() for _ in range(CALLERS)))

    _bench(benchmark, lambda: _run(run), N_CONC, rounds=5)


@pytest.mark.benchmark(group="dispatcher-conc")
def test_conc_dispatcher(benchmark, core):
    async def run() -> None:
        async with Dispatcher([YieldingBackend("b1", max_in_flight=32), YieldingBackend("b2", max_in_flight=32)],
                              estimator=CostEstimator(), scheduler=core) as d:
            async def caller(flow: int) -> None:
                for _ in range(N_CONC // CALLERS):
                    await d.submit(flow, BODY)

            await asyncio.gather(*(caller(f) for f in range(CALLERS)))
            s = d.stats()
            assert sum(f["completed"] for f in s["flows"].values()) == N_CONC

    _bench(benchmark, lambda: _run(run), N_CONC, rounds=5)


# ------------------------------------------------------------------ many flows
class HeldBackend(InstantBackend):
    """Never answers until the dispatcher closes: every later request waits in sfq."""

    async def complete(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.Event().wait()
        return REPLY


N_STATS_FLOWS = 50_000
N_ADMIT = 2_000


@pytest.mark.benchmark(group="dispatcher-stats")
def test_stats_with_many_flows(benchmark, quick):
    n = 1_000 if quick else N_STATS_FLOWS
    loop = asyncio.new_event_loop()
    d = Dispatcher([InstantBackend("b", max_in_flight=64)], estimator=CostEstimator(), max_flow_stats=2 * n)

    async def fill() -> None:
        await d.start()
        for f in range(n):
            await d.submit(f, BODY)

    try:
        loop.run_until_complete(fill())
        benchmark.extra_info["requests"] = 1
        benchmark.extra_info["flows"] = n
        benchmark.pedantic(d.stats, rounds=5, iterations=1, warmup_rounds=1)
        assert len(d.stats()["flows"]) == n
    finally:
        loop.run_until_complete(d.close())
        loop.close()


@pytest.mark.benchmark(group="dispatcher-admit")
def test_admit_beyond_max_flow_stats(benchmark, core):
    def run() -> None:
        async def go() -> None:
            d = Dispatcher([HeldBackend("b", max_in_flight=1)], estimator=CostEstimator(), scheduler=core,
                           max_flow_stats=1_000, close_grace=0.001)
            await d.start()
            waiting = [asyncio.ensure_future(d.submit(("w", f), BODY)) for f in range(2_000)]
            await asyncio.sleep(0)
            t = [asyncio.ensure_future(d.submit(("new", f), BODY)) for f in range(N_ADMIT)]
            await asyncio.sleep(0)
            for x in (*waiting, *t):
                x.cancel()
            await asyncio.gather(*waiting, *t, return_exceptions=True)
            await d.close()

        _run(go)

    _bench(benchmark, run, 2_000 + N_ADMIT, rounds=5)
