"""Chaos: random faults (5xx, resets, stalls, cut streams, absurd usage, an outage, callers that
give up) across three loopback backends and eight flows, for a bounded time with a fixed seed.

Asserted: every request ends with exactly one outcome, the dispatcher's counters agree with
the callers', no slot leaks, the healthy flows keep at least half the throughput they have
without faults, and the event loop never runs more than 50 ms (CPU time of its thread)
without coming back to a probe task. The servers run on another thread's loop, so the probe
measures the dispatcher alone, and the objects that exist before the test (the test
runner's, every imported module's) are frozen out of the garbage collector's walks
(``gc.freeze``): a full collection of the whole test process takes ~60 ms here, which is the
test runner's heap, not the dispatcher's work.
"""

from __future__ import annotations

import asyncio
import gc
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from dispatch_helpers import FakeServer, LagProbe, servers_in_a_thread

from sfq.backends import OpenAIBackend
from sfq.backends.health import HealthOptions
from sfq.cost import CostEstimator
from sfq.dispatch import Dispatcher
from sfq.errors import BackendError, NoHealthyBackend

SEED = 20261201
PHASE = 1.5  # seconds of load per phase
HEALTHY = [f"team{i}" for i in range(7)]
BAD = "tenant-500"  # every request of this flow gets a 500
#: per request (a stall holds its slot for the read timeout, so it is the costliest fault)
FAULTS = [("slow", 880), ("500", 30), ("drop", 30), ("stall", 5), ("cut", 30), ("absurd", 25)]
CLIENTS = 3  # concurrent callers per healthy flow: more than the fleet's slots, so slots are the limit
DELAY = 0.01  # a served request takes this long ("slow"; a stream, this per event): the fleet, not the
#               machine's CPU, sets the throughput, so the two phases compare


def chaos_modes(rng: random.Random) -> Any:
    modes, weights = zip(*FAULTS)

    def pick(body: dict[str, Any]) -> str:
        return rng.choices(modes, weights)[0]

    return pick


async def run_phase(servers: list[FakeServer], rng: random.Random, faults: bool) -> dict[str, Any]:
    for srv in servers:
        srv.chaos = chaos_modes(random.Random(rng.random())) if faults else (lambda body: "slow")
        srv.delay = DELAY
        srv.fail_prompt = "poison"
        srv.outage = False
    backends = [OpenAIBackend(s.url, name=f"b{i}", max_in_flight=4, read_timeout=0.2, stream_timeout=2.0)
                for i, s in enumerate(servers)]
    est = CostEstimator(1.0, 1.0, prior_ratio=0.5)
    outcomes: Counter[str] = Counter()
    started: Counter[str] = Counter()
    done: Counter[str] = Counter()
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + PHASE

    async def one(d: Dispatcher, flow: str, i: int) -> None:
        prompt = "poison" if flow == BAD else "x" * rng.randint(1, 400)
        body = {"model": "m", "prompt": prompt, "max_tokens": rng.randint(1, 6)}
        streaming = i % 3 == 0
        give_up = faults and rng.random() < 0.05
        started[flow] += 1
        try:
            if streaming:
                coro: Any = _consume(d.stream(flow, {**body, "stream": True}))
            else:
                coro = d.submit(flow, body)
            if give_up:
                await asyncio.wait_for(coro, rng.uniform(0.0, 0.05))
            else:
                await coro
            outcomes["ok"] += 1
            done[flow] += 1
        except asyncio.TimeoutError:
            outcomes["gave up"] += 1
        except NoHealthyBackend:
            outcomes["unavailable"] += 1
        except BackendError as exc:
            outcomes[type(exc).__name__] += 1

    async def client(d: Dispatcher, flow: str) -> None:
        i = 0
        while loop.time() < stop_at:
            await one(d, flow, i)
            i += 1

    async def outage(srv: FakeServer) -> None:
        await asyncio.sleep(PHASE * 0.3)
        srv.outage = True
        await asyncio.sleep(PHASE * 0.3)
        srv.outage = False

    async with Dispatcher(backends, estimator=est, unavailable_timeout=5.0,
                          max_attempts=1, health=HealthOptions(backoff=0.05, max_backoff=0.2)) as d:  # (retries: test_dispatch_retry.py)
        with LagProbe() as lag:
            tasks = [loop.create_task(client(d, f)) for f in HEALTHY for _ in range(CLIENTS)]
            tasks.append(loop.create_task(client(d, BAD)))
            if faults:
                tasks.append(loop.create_task(outage(servers[2])))
            await asyncio.wait_for(asyncio.gather(*tasks), PHASE + 30)
        s = d.stats()
        flows = {f: s["flows"][f] for f in s["flows"]}
        leaks = [(n, b["in_flight"]) for n, b in s["backends"].items() if b["in_flight"]]
        pools = s["pools"]
        in_flight = d._running()
    return {"outcomes": outcomes, "started": started, "done": done, "flows": flows, "leaks": leaks,
            "pools": pools, "in_flight": in_flight, "lag": lag, "estimator": est}


async def _consume(stream: Any) -> None:
    async for _ in stream:
        pass


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def test_chaos_every_request_ends_once_and_healthy_flows_keep_their_throughput(frozen_heap: None):
    rng = random.Random(SEED)
    with servers_in_a_thread(3) as servers:
        base = await run_phase(servers, rng, faults=False)
        chaos = await run_phase(servers, rng, faults=True)
    for run in (base, chaos):
        # exactly one outcome per request, seen by the caller and by the dispatcher alike
        assert sum(run["outcomes"].values()) == sum(run["started"].values())
        for flow, st in run["flows"].items():
            ended = (st["completed"] + st["failed"] + st["cancelled"] + st["aborted"] + st["rejected"]
                     + st["unavailable"])
            assert ended == run["started"][flow], (flow, st)
            assert st["waiting"] == st["held"] == st["in_flight"] == 0, (flow, st)
            assert st["completed"] == run["done"][flow]
        # no slot leaks
        assert run["leaks"] == [] and run["in_flight"] == 0
        assert all(p["waiting"] == p["held"] == p["in_flight"] == 0 for p in run["pools"].values())
        # the loop never stalled
        assert run["lag"].worst < 0.05, f"the loop ran {run['lag'].worst * 1000:.0f} ms without yielding"
        # the bad tenant failed alone
        assert run["done"][BAD] == 0 and run["flows"][BAD]["failed"] >= run["started"][BAD] * 0.9
    faults = chaos["outcomes"]
    assert {"BackendHTTPError", "BackendUnavailable", "gave up"} <= set(faults), faults  # faults did happen
    healthy_base = sum(base["done"][f] for f in HEALTHY)
    healthy_chaos = sum(chaos["done"][f] for f in HEALTHY)
    assert healthy_base > 0 and healthy_chaos >= healthy_base / 2, (healthy_chaos, healthy_base, faults)
    # absurd usage reports did not poison the estimates
    e = chaos["estimator"].estimate({"model": "m", "prompt": "x" * 400, "max_tokens": 6})
    assert e.prompt_tokens <= 1.5 * 400  # the fake server reports one token per character
    print(f"\nhealthy completions: {healthy_base} without faults, {healthy_chaos} with; outcomes {dict(faults)}; "
          f"loop lag {chaos['lag'].worst * 1000:.1f} ms CPU / {chaos['lag'].worst_wall * 1000:.1f} ms wall")
