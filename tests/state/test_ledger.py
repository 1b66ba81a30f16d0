"""One fairness suite over both ledgers: the engine's meters in memory (one dispatcher) and in
Redis (two dispatchers sharing a real redis-server, requests alternating between them or
sticky per org), as one suite runs over both scheduler twins.

Every request goes through a :class:`~sfq.dispatch.PolicyDispatcher` to a loopback engine
that counts each org's service *as it delivers it* (prompt + 2 x output tokens, the policy's
cost), so the shares asserted are the work done, not what a gateway believes. The same
charges (at dispatch, as a stream delivers, at settlement) must reach either ledger: the
meters are compared between them, and the shares are held to the same bounds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import pytest
from state_helpers import LIMIT, RedisServer
from support.workload import FakeEngine, service
from support.workload import shares as share_of

from sfq.dispatch import PolicyDispatcher
from sfq.policy import Flow, parse_policy

UNIT = 0.0004  # seconds of engine time per unit of service (one prompt token, half an output token)


def _policy(url: str, orgs: dict[str, float], *, redis: str | None, prefix: str, slots: int = 2,
            charge: str = "served") -> Any:
    org_lines = "\n".join(f"  {o}: {{keys: [k-{o}], classes: [batch], weight: {w}}}" for o, w in orgs.items())
    state = f'state: {{redis: "{redis}", prefix: "{prefix}", lease_seconds: 5}}' if redis else ""
    return parse_policy(f"""
pools:
  p:
    models: [m]
    backends: [{{url: "{url}", max_in_flight: {slots}}}]
classes:
  batch: {{weight: 1}}
orgs:
{org_lines}
cost: {{input_weight: 1, output_weight: 2, charge: {charge}}}
{state}
""")


@pytest.fixture(params=["memory", "redis"])
def ledger(request: pytest.FixtureRequest, redis_server: RedisServer, prefix: str) -> dict[str, Any]:
    """Where the meters live: ``memory`` (one dispatcher) or ``redis`` (two dispatchers sharing
    the test module's redis-server)."""
    if request.param == "memory":
        return {"kind": "memory", "redis": None, "prefix": prefix, "gateways": 1}
    return {"kind": "redis", "redis": redis_server.url, "prefix": prefix, "gateways": 2}


class Fleet:
    """The engine and the ledger's dispatchers, started and closed together."""

    def __init__(self, ledger: dict[str, Any], orgs: dict[str, float], **kw: Any) -> None:
        self.ledger, self.orgs, self.kw = ledger, orgs, kw
        # on the test's own loop: it counts each org's service as it delivers it (the shares
        # asserted), 4 output tokens an event
        self.engine = FakeEngine("e", 1.0, slots=kw.get("slots", 2), unit=UNIT, chunk=4, log=[], done=[])
        self.pds: list[PolicyDispatcher] = []

    async def __aenter__(self) -> Fleet:
        await self.engine.start()
        pol = _policy(self.engine.url, self.orgs, redis=self.ledger["redis"], prefix=self.ledger["prefix"], **self.kw)
        self.pds = [PolicyDispatcher(pol) for _ in range(self.ledger["gateways"])]
        for pd in self.pds:
            await pd.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for pd in self.pds:
            await pd.close()
        await self.engine.stop()

    async def one(self, org: str, gateway: int, *, use: int, max_tokens: int, stream: bool) -> None:
        pd = self.pds[gateway % len(self.pds)]
        body = {"model": "m", "prompt": f"org={org} use={use} " + "p" * 40, "max_tokens": max_tokens}
        if not stream:
            await pd.submit(f"k-{org}", body)
            return
        async with pd.stream(f"k-{org}", {**body, "stream": True}) as events:
            async for _ in events:
                pass

    async def flood(self, org: str, *, clients: int, until: float, use: int, max_tokens: int, stream: bool,
                    sticky: int | None = None) -> int:
        """``clients`` closed loops of ``org`` until ``until``; requests alternate between the
        dispatchers (or all go to dispatcher ``sticky``). Returns the requests completed."""
        done = 0

        async def loop(c: int) -> None:
            nonlocal done
            i = c
            while time.monotonic() < until:
                await self.one(org, i if sticky is None else sticky, use=use, max_tokens=max_tokens, stream=stream)
                done += 1
                i += 1

        await asyncio.wait_for(asyncio.gather(*(loop(c) for c in range(clients))), until - time.monotonic() + LIMIT)
        return done


def shares(log: Sequence[tuple[float, str, float]], orgs: Sequence[str], t0: float, t1: float) -> dict[str, float]:
    """Each org's share of the service the engine delivered in ``[t0, t1)``."""
    return share_of(service(log, orgs, t0, t1))


def expected(orgs: dict[str, float]) -> dict[str, float]:
    w = sum(orgs.values())
    return {o: x / w for o, x in orgs.items()}


async def test_plain_streamed_and_over_declared_requests_share_by_delivered_cost(ledger: dict[str, Any]) -> None:
    orgs = {"a": 1.0, "b": 1.0, "c": 1.0}
    async with Fleet(ledger, orgs) as f:
        t0 = time.monotonic()
        end = t0 + 4.0
        await asyncio.gather(
            f.flood("a", clients=4, until=end, use=40, max_tokens=40, stream=False),
            f.flood("b", clients=4, until=end, use=40, max_tokens=40, stream=True),
            f.flood("c", clients=4, until=end, use=40, max_tokens=400, stream=False))  # declares 10x
        got = shares(f.engine.log, list(orgs), t0 + 1.0, end)
    worst = max(abs(got[o] - e) for o, e in expected(orgs).items())
    assert worst <= 0.07, (ledger["kind"], got)


async def test_weights_hold_with_orgs_sticky_to_one_gateway(ledger: dict[str, Any]) -> None:
    orgs = {"a": 2.0, "b": 1.0, "c": 1.0}
    async with Fleet(ledger, orgs) as f:
        t0 = time.monotonic()
        end = t0 + 4.0
        # a reaches only gateway 0, b and c only gateway 1 (sticky load balancing)
        await asyncio.gather(
            f.flood("a", clients=4, until=end, use=40, max_tokens=40, stream=True, sticky=0),
            f.flood("b", clients=4, until=end, use=40, max_tokens=40, stream=True, sticky=1),
            f.flood("c", clients=4, until=end, use=40, max_tokens=40, stream=False, sticky=1))
        got = shares(f.engine.log, list(orgs), t0 + 1.0, end)
    worst = max(abs(got[o] - e) for o, e in expected(orgs).items())
    assert worst <= 0.07, (ledger["kind"], got)


async def test_an_org_that_goes_quiet_and_comes_back_banks_nothing(ledger: dict[str, Any]) -> None:
    orgs = {"a": 1.0, "b": 1.0}
    async with Fleet(ledger, orgs) as f:
        t0 = time.monotonic()
        back = t0 + 2.5

        async def b() -> None:
            await f.flood("b", clients=4, until=t0 + 1.0, use=40, max_tokens=40, stream=True)
            await asyncio.sleep(back - time.monotonic())  # quiet while a has the fleet alone
            await f.flood("b", clients=4, until=back + 1.5, use=40, max_tokens=40, stream=True)

        await asyncio.gather(f.flood("a", clients=4, until=back + 1.5, use=40, max_tokens=40, stream=False), b())
        alone = shares(f.engine.log, list(orgs), t0 + 1.3, back)
        after = shares(f.engine.log, list(orgs), back + 0.1, back + 1.5)
    assert alone["a"] > 0.9, (ledger["kind"], alone)  # nobody waits while the fleet is idle
    # b comes back level: no burst for the second it was away (SFQ's no-banking rule)
    assert after["b"] <= 0.58, (ledger["kind"], after)


async def _meters(f: Fleet, flows: Sequence[Flow]) -> dict[str, float]:
    """Each flow's meter as it would rejoin, ``max(S, v)``, and ``v`` itself (cost units / weight)."""
    if f.ledger["kind"] == "memory":
        q = f.pds[0].engine.queues["p"]
        v = float(q.sched.virtual_time)
        return {"v": v, **{fl.org: max(q.meter(fl), v) for fl in flows}}
    # several gateways: the meters are the fleet's decider's (one of the gateways: docs/design.md §5a.1)
    deciders = [pd.state.decider("p") for pd in f.pds]
    live = [q for q in deciders if q is not None]
    assert len(live) == 1, "exactly one gateway decides the fleet's order"
    q = live[0]
    v = float(q.sched.virtual_time)
    return {"v": v, **{fl.org: max(q.meter(fl), v) for fl in flows}}


@pytest.mark.parametrize("charge", ["served", "settle"])
async def test_both_ledgers_hold_the_same_meters(redis_server: RedisServer, prefix: str, charge: str) -> None:
    """The same requests, one at a time, give the same meters in memory and through Redis (the
    fleet's decider's queue): the charge at dispatch, a stream's delivered tokens and the
    settlement reach either alike (a long request of ``z`` keeps the busy period open, so nothing is forgotten)."""
    orgs = {"a": 2.0, "b": 1.0, "z": 1.0}
    flows = [Flow(o, "batch", "p") for o in ("a", "b")]
    seen = []
    for led in ({"kind": "memory", "redis": None, "prefix": prefix, "gateways": 1},
                {"kind": "redis", "redis": redis_server.url, "prefix": prefix + "r:", "gateways": 2}):
        async with Fleet(led, orgs, slots=4, charge=charge) as f:
            hold = asyncio.create_task(f.one("z", 0, use=4000, max_tokens=4000, stream=True))
            await asyncio.sleep(0.1)
            i = 0
            for org, use, mt, stream in [("a", 40, 400, False), ("b", 30, 30, True), ("a", 12, 12, True),
                                         ("b", 50, 500, False), ("a", 8, 80, True), ("b", 20, 20, False)]:
                await f.one(org, i, use=use, max_tokens=mt, stream=stream)
                i += 1
            await asyncio.sleep(0.1)  # the last corrections ride on a round trip
            seen.append(await _meters(f, flows))
            hold.cancel()
            with pytest.raises(asyncio.CancelledError):
                await hold
    mem, red = seen
    assert mem["a"] != mem["b"] and mem["v"] > 0, mem
    for o in mem:
        assert abs(mem[o] - red[o]) <= 1e-3 * max(1.0, abs(mem[o])), (charge, mem, red)


async def test_an_over_declaring_org_that_came_first_does_not_own_the_fleet(ledger: dict[str, Any]) -> None:
    """``a`` declares 10x the output it uses and has the fleet alone for a moment: its charges
    at dispatch set ``v`` for everyone who joins; the refunds at settlement must not take it
    below that ``v`` (the refund floor), or it would win every turn until served that gap."""
    orgs = {"a": 1.0, "b": 1.0, "c": 1.0}
    async with Fleet(ledger, orgs, slots=4) as f:
        t0 = time.monotonic()
        end = t0 + 4.0

        async def late(org: str, stream: bool) -> None:
            await asyncio.sleep(0.3)
            await f.flood(org, clients=4, until=end, use=40, max_tokens=40, stream=stream)

        await asyncio.gather(f.flood("a", clients=8, until=end, use=40, max_tokens=2000, stream=False),
                             late("b", True), late("c", False))
        windows = [shares(f.engine.log, list(orgs), t, t + 0.75) for t in (t0 + 0.75, t0 + 1.5, t0 + 2.25, t0 + 3.0)]
    assert max(w["a"] for w in windows) <= 1 / 3 + 0.15, (ledger["kind"], windows)


def _nested_policy(url: str, *, redis: str | None, prefix: str) -> Any:
    state = f'state: {{redis: "{redis}", prefix: "{prefix}", lease_seconds: 5}}' if redis else ""
    return parse_policy(f"""
pools:
  p:
    models: [m]
    backends: [{{url: "{url}", max_in_flight: 2}}]
classes:
  batch: {{weight: 1}}
orgs:
  acme:
    classes: [batch]
    teams:
      research: {{keys: [k-research], weight: 3}}
      product: {{keys: [k-product], weight: 1}}
  globex: {{keys: [k-globex], classes: [batch]}}
cost: {{input_weight: 1, output_weight: 2, charge: served}}
{state}
""")


async def test_nested_shares_hold_through_the_ledger(ledger: dict[str, Any]) -> None:
    """Org -> team shares with several gateways as with one: acme and globex split the
    engine 1:1, and acme's half goes 3:1 to research and product, each team's requests
    reaching the gateways alternately (streamed and plain, one team over-declaring)."""
    f = Fleet(ledger, {"research": 1.0, "product": 1.0, "globex": 1.0})
    await f.engine.start()
    pol = _nested_policy(f.engine.url, redis=ledger["redis"], prefix=ledger["prefix"])
    f.pds = [PolicyDispatcher(pol) for _ in range(ledger["gateways"])]
    for pd in f.pds:
        await pd.start()
    try:
        t0 = time.monotonic()
        end = t0 + 4.0
        await asyncio.gather(
            f.flood("research", clients=4, until=end, use=40, max_tokens=40, stream=True),
            f.flood("product", clients=4, until=end, use=40, max_tokens=400, stream=False),
            f.flood("globex", clients=4, until=end, use=40, max_tokens=40, stream=False))
        got = shares(f.engine.log, ["research", "product", "globex"], t0 + 1.0, end)
    finally:
        await f.__aexit__()
    want = {"research": 0.375, "product": 0.125, "globex": 0.5}
    worst = max(abs(got[o] - e) for o, e in want.items())
    assert worst <= 0.07, (ledger["kind"], got)
    if ledger["kind"] == "redis":
        assert sum(pd.state.decider("p") is not None for pd in f.pds) <= 1
