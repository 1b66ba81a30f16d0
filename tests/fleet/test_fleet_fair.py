"""A fleet is as fair as one engine (issue 27): real ``sfq serve`` processes (1, 2 or 3), one
real ``redis-server`` shared by those with ``state: redis``, loopback engines that count every
org's service as they deliver it (prompt + 2 x output tokens), the official ``openai`` client
(``support.fleet``).

Two workloads, each run once through one gateway keeping its state in memory (the reference)
and through several gateways sharing Redis:

* ``equal`` (issue 27's): four equal orgs, A plain answers of 200 tokens, B and C streams, D
  mixed, all honest ``max_tokens``, plus an interactive org (a short stream every 0.25 s, not
  backlogged); one engine;
* ``weighted``: weights 2:1:1, A plain (weight 2), B streams and declares ``max_tokens`` 10x
  what it uses, C mixed and honest, plus the interactive org; two engines of unequal speed
  (2 and 1);
* ``nested``: org -> team shares: acme's teams research (weight 3, streams) and product (plain,
  10x over-declared) split acme's half 3:1 (37.5 / 12.5 %), globex (mixed) has the other half;
  the interactive org; two engines of unequal speed.

=================================  ========  ============  =========  ========
scenario                           gateways  routing       workload   engines
=================================  ========  ============  =========  ========
``equal-1``                        1         (memory)      equal      1
``equal-2-alternating``            2         alternating   equal      1
``equal-2-sticky``                 2         sticky        equal      1
``weighted-1``                     1         (memory)      weighted   2
``weighted-3-alternating``         3         alternating   weighted   2
``weighted-3-sticky``              3         sticky        weighted   2
``weighted-3-redis-lost``          3         alternating   weighted   2  (Redis killed 10 s)
``weighted-3-sticky-redis-lost``   3         sticky        weighted   2  (Redis killed 10 s)
``weighted-3-gateway-killed``      3         alternating   weighted   2  (a gateway killed 3 s)
``four-to-one-8-alternating``      8         alternating   4:1        2
``nested-3-alternating``           3         alternating   nested     2
=================================  ========  ============  =========  ========

Alternating: each org's requests go round-robin over the gateways, per request. Sticky: each
org always to one gateway (the orgs dealt over them in order: equal A, C -> 1 and B, D -> 2;
weighted A -> 1, B -> 2, C -> 3).

Asserted, after a 2 s warm-up, over 5 s of load: every backlogged org's share of the delivered
service within 5 points of its weighted share; with more than one gateway (or Redis), within
3 points of the share the same org got in the same workload's one-gateway run (both measured
here, the reference once per module, cached); and every request got exactly one outcome
(status 200, or an HTTP error with the gateway's message; none without an answer, none
twice) while the engines served each completed request exactly once. The interactive org's
time to first token is reported, not asserted: nothing here is timed.

``SFQ_FLEET_REPORT=path.json`` writes every scenario's report there (the numbers of the run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.fleet import (ALTERNATING, STICKY, Report, Scenario, four_to_one_orgs, interactive_org, issue27_orgs,
                           nested_orgs, run_scenario, weighted_orgs)
from support.processes import RedisServer
from support.workload import OrgLoad

WARMUP, SECONDS = 2.0, 5.0
WITHIN_EXPECTED = 5.0  # points
WITHIN_ONE_GATEWAY = 3.0  # points


def _equal(name: str, gateways: int, routing: str = ALTERNATING, redis: bool | None = None) -> Scenario:
    return Scenario(name, issue27_orgs(tokens=200, clients=4), gateways=gateways, routing=routing, redis=redis,
                    speeds=(1.0,), warmup=WARMUP, seconds=SECONDS)


def _weighted(name: str, gateways: int, routing: str = ALTERNATING) -> Scenario:
    return Scenario(name, weighted_orgs(tokens=200, clients=5), gateways=gateways, routing=routing,
                    speeds=(2.0, 1.0), warmup=WARMUP, seconds=SECONDS)


def _nested(name: str, gateways: int, routing: str = ALTERNATING) -> Scenario:
    return Scenario(name, nested_orgs(tokens=200, clients=5), gateways=gateways, routing=routing,
                    speeds=(2.0, 1.0), warmup=WARMUP, seconds=SECONDS)


SCENARIOS = {s.name: s for s in [
    _equal("equal-1", 1),
    _equal("equal-2-alternating", 2, ALTERNATING),
    _equal("equal-2-sticky", 2, STICKY),
    _weighted("weighted-1", 1),
    _weighted("weighted-3-alternating", 3, ALTERNATING),
    _weighted("weighted-3-sticky", 3, STICKY),
    _nested("nested-3-alternating", 3, ALTERNATING),
]}
#: each scenario's reference: the same workload through one gateway in memory (nested shares'
#: is tests/state/test_ledger.py's, in memory and through Redis alike)
REFERENCE = {name: name.split("-")[0] + "-1" for name in SCENARIOS if not name.startswith("nested")}

_reports: dict[str, Report] = {}


def _report(name: str, request: pytest.FixtureRequest) -> Report:
    if name not in _reports:
        sc = SCENARIOS[name]
        # (a scenario that stops Redis runs its own)
        redis: RedisServer | None = (request.getfixturevalue("redis_server")
                                     if sc.uses_redis and sc.redis_outage is None else None)
        rep = _reports[name] = run_scenario(sc, redis=redis)
        print("\n" + rep.summary())
        out = os.environ.get("SFQ_FLEET_REPORT")
        if out:
            p = Path(out)
            doc = json.loads(p.read_text()) if p.exists() else {}
            doc[name] = rep.as_dict()
            p.write_text(json.dumps(doc, indent=2) + "\n")
    return _reports[name]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_backlogged_org_gets_its_share(name: str, request: pytest.FixtureRequest) -> None:
    rep = _report(name, request)
    failed = [f"outcomes: {p}" for p in rep.outcome_problems()]
    for org, share in rep.shares.items():
        want = rep.expected[org]
        if abs(share - want) * 100 > WITHIN_EXPECTED:
            failed.append(f"{org} got {share:.1%} of the delivered service, its share is {want:.1%} "
                          f"(more than {WITHIN_EXPECTED:g} points off)")
    ref_name = REFERENCE.get(name, name)
    if ref_name != name:
        ref = _report(ref_name, request)
        for org, share in rep.shares.items():
            if abs(share - ref.shares[org]) * 100 > WITHIN_ONE_GATEWAY:
                failed.append(f"{org} got {share:.1%} here and {ref.shares[org]:.1%} through one gateway "
                              f"({ref_name}; more than {WITHIN_ONE_GATEWAY:g} points apart)")
    assert sum(rep.completed.values()) > 0 and all(n > 0 for n in rep.engines_served), rep.summary()
    assert not failed, "\n".join(failed) + "\n" + rep.summary()


#: issue 41's fault: Redis killed for 10 s mid-run (restarted empty), three gateways, the
#: weighted workload on the two unequal engines; 2 s of warm-up, 16 s measured (Redis gone from 4 s to 14 s)
REDIS_LOST = Scenario("weighted-3-redis-lost", weighted_orgs(tokens=200, clients=5), gateways=3, routing=ALTERNATING,
                      speeds=(2.0, 1.0), warmup=WARMUP, seconds=16.0, window=4.0, redis_outage=(4.0, 10.0))


#: the same with each org sticky to one gateway (A, of weight 2, alone on the first): while
#: Redis is lost each gateway orders only its own org, so the weights hold only as far as the
#: slices follow the gateways' demand (the decider's table of their shares; lease 2 s, so that a
#: table comes every second)
REDIS_LOST_STICKY = Scenario("weighted-3-sticky-redis-lost", weighted_orgs(tokens=200, clients=5), gateways=3,
                             routing=STICKY, speeds=(2.0, 1.0), warmup=WARMUP, seconds=16.0, window=4.0,
                             redis_outage=(4.0, 10.0), lease=2.0)


@pytest.mark.parametrize("sc", [REDIS_LOST, REDIS_LOST_STICKY], ids=["alternating", "sticky"])
def test_redis_lost_for_10_s_fails_no_request_breaks_no_limit_and_keeps_the_shares(
        sc: Scenario, request: pytest.FixtureRequest) -> None:
    SCENARIOS[sc.name] = sc
    rep = _report(sc.name, request)
    failed = [f"outcomes: {p}" for p in rep.outcome_problems()]
    errors = {org: errs[:3] for org, errs in rep.errors.items() if errs}
    if errors:
        failed.append(f"requests failed: {errors}")
    for org, share in rep.shares.items():
        want = rep.expected[org]
        if abs(share - want) * 100 > WITHIN_EXPECTED:
            failed.append(f"{org} got {share:.1%} of the delivered service, its share is {want:.1%}")
    if max(rep.engines_peak) > rep.slots:
        failed.append(f"an engine held {rep.engines_peak} requests at once, its max_in_flight is {rep.slots}")
    if rep.health_in_outage != [(200, "degraded")] * sc.gateways:
        failed.append(f"/health in the outage: {rep.health_in_outage} (want 200 degraded from each gateway)")
    assert not failed, "\n".join(failed) + "\n" + rep.summary()


#: issue 41's other fault: one of three gateways SIGKILLed 5 s into the load and started again
#: 3 s later on its port (a load balancer sends its clients elsewhere meanwhile); lease 2 s
GATEWAY_KILLED = Scenario("weighted-3-gateway-killed", weighted_orgs(tokens=200, clients=5), gateways=3,
                          routing=ALTERNATING, speeds=(2.0, 1.0), warmup=WARMUP, seconds=20.0, window=5.0,
                          gateway_kill=(1, 5.0, 3.0), lease=2.0)


def test_a_gateway_killed_costs_only_the_requests_in_its_hands(request: pytest.FixtureRequest) -> None:
    SCENARIOS[GATEWAY_KILLED.name] = GATEWAY_KILLED
    rep = _report(GATEWAY_KILLED.name, request)
    failed = []
    lost = [rid for rid, o in rep.outcomes.items() if o[2] != 200]
    elsewhere = [rid for rid in lost if rep.outcomes[rid][1] != 1]
    if elsewhere:
        failed.append(f"requests failed at gateways that were not killed: "
                      f"{[(rid, rep.outcomes[rid]) for rid in elsewhere[:5]]}")
    late = [rid for rid in lost if rep.sent_at[rid] > rep.killed_at]
    if late:  # sent after it died: a load balancer sends those elsewhere, and they must not fail
        failed.append(f"requests sent after the kill failed: {[(rid, rep.outcomes[rid]) for rid in late[:5]]}")
    if not rep.rerouted:
        failed.append("no request was sent elsewhere while the gateway was down (the fault did not happen?)")
    for org, share in rep.shares.items():
        want = rep.expected[org]
        if abs(share - want) * 100 > WITHIN_EXPECTED:
            failed.append(f"{org} got {share:.1%} of the delivered service, its share is {want:.1%}")
    # from 10 s after the restart (the last window): every org within 5 points of its share
    for org, share in rep.window_shares[-1].items():
        if abs(share - rep.expected[org]) * 100 > WITHIN_EXPECTED:
            failed.append(f"last window: {org} got {share:.1%}, its share is {rep.expected[org]:.1%}")
    assert not failed, "\n".join(failed) + "\n" + rep.summary() + f"; lost {len(lost)} of {rep.killed_in_hands}"


def _over_declared_weighted_sticky() -> Scenario:
    """Issue 41: three gateways, each org sticky to one (the interactive org spread over all
    three), weights 2:1:1, A (weight 2, 16 clients) sending plain requests that declare
    ``max_tokens`` 10x what they use, B streams, C mixed, honest; two engines of unequal speed;
    long requests (2000 tokens), so that a charge at the prior's price is a large part of a
    window."""
    tokens = 2000
    orgs = [OrgLoad("A", "sk-A", clients=16, max_tokens=tokens * 10, use=lambda t: tokens, stream=False, weight=2),
            OrgLoad("B", "sk-B", clients=6, max_tokens=tokens, use=lambda t: tokens, stream=True),
            OrgLoad("C", "sk-C", clients=6, max_tokens=tokens, use=lambda t: tokens, stream="mixed"),
            interactive_org()]
    return Scenario("over-weighted-3-sticky", orgs, gateways=3, routing=STICKY,
                    sticky={"A": 0, "B": 1, "C": 2, "I": None}, speeds=(2.5, 1.0), warmup=10.0, seconds=15.0,
                    window=15.0)


def test_an_over_declaring_org_sticky_to_one_gateway_gets_its_share_in_every_window(
        redis_server: RedisServer) -> None:
    """A's first requests reach its gateway before any usage report: priced at the prior
    (``max_tokens`` at face value, 10x what they use). They waited for their grants while the
    calibration learned; granted at that price, each took A's turns for seconds (A 17 % of the
    service in the first 5 s), then their refunds put A below everyone (84 % in 10-15 s; 62.6 %
    of the window after the warm-up, its share 50 %; the interactive org's TTFT p99 2.7 s). A candidate is charged its price at the grant, as one
    engine charges the estimate at dispatch. Every backlogged org within 5 points of its share
    in the 15-s window after a 10-s warm-up."""
    rep = run_scenario(_over_declared_weighted_sticky(), redis=redis_server)
    print("\n" + rep.summary())
    assert not rep.outcome_problems(), rep.summary()
    failed = [f"{org} got {w[org]:.1%} in window {i} (its share is {rep.expected[org]:.1%})"
              for i, w in enumerate(rep.window_shares) for org in rep.expected
              if abs(w[org] - rep.expected[org]) * 100 > WITHIN_EXPECTED]
    assert not failed, "\n".join(failed) + "\n" + rep.summary()


#: issue 41's scale: eight gateways, weights 4:1 (B over-declaring 10x), requests alternating,
#: two engines of unequal speed
EIGHT = Scenario("four-to-one-8-alternating", four_to_one_orgs(tokens=200, clients=6), gateways=8,
                 routing=ALTERNATING, speeds=(2.0, 1.0), warmup=WARMUP, seconds=9.0)


def test_eight_gateways_keep_four_to_one(request: pytest.FixtureRequest) -> None:
    SCENARIOS[EIGHT.name] = EIGHT
    rep = _report(EIGHT.name, request)
    failed = [f"outcomes: {p}" for p in rep.outcome_problems()]
    a, b = rep.shares["A"], rep.shares["B"]
    if abs(a / b - 4.0) > 0.2:  # 4:1 within 5 %
        failed.append(f"A:B is {a / b:.2f}:1, the weights say 4:1")
    if max(rep.engines_peak) > rep.slots:
        failed.append(f"an engine held {rep.engines_peak} requests at once, its max_in_flight is {rep.slots}")
    assert not failed, "\n".join(failed) + "\n" + rep.summary()
