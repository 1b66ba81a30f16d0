"""Fair shares of *delivered* service through a real ``sfq serve`` process.

Four orgs with equal weights, the official ``openai`` client, two loopback engines of unequal
speed that serve 4 requests at a time each and report usage honestly (``delivered_workload``);
service is prompt + 2 x output tokens as the engines delivered them. Plain and streamed
requests, chat and completions, in both cases:

1. org D declares ``max_tokens`` 40 times what it uses, org C keeps one request waiting, org
   B is interactive (a request every 0.25 s): each backlogged org (A, C, D) gets its fair
   share within 5 points, Jain's index >= 0.98, and D is never starved;
2. org D trains its estimate low (uses 10 of its 400 tokens), then uses all 400: from then on
   every org's share stays within 5 points of a quarter;
3. org A sends plain requests declaring ``max_tokens`` 10 times what it uses and its clients
   send first, on slower engines (a request's service takes longer than the warm-up): every
   backlogged org gets its fair share within 5 points after the warm-up (issue 27: A filled
   both engines alone, moving v by its estimates, and its refunds then put it that far below
   everyone who had joined meanwhile).

The runs are bounded (about 12 s, 16 s and 16 s of load); nothing here is timed: the measures
are shares of the work done, read at the engines.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from delivered_workload import (
    Fleet,
    OrgLoad,
    RunResult,
    jain,
    least_window_share,
    over_declared_orgs,
    plain_over_declared_orgs,
    policy_text,
    run_workload,
    service,
    shares,
    trained_low_orgs,
)
from serve_helpers import GatewayProcess

openai = pytest.importorskip("openai")

SPEEDS = (2.0, 1.0)  # two engines of unequal speed


def run_case(tmp_path: Path, orgs: list[OrgLoad], seconds: float, unit: float) -> tuple[RunResult, Fleet]:
    fleet = Fleet(SPEEDS, unit=unit).start()
    try:
        cfg = tmp_path / "policy.yaml"
        cfg.write_text(policy_text([e.url for e in fleet.engines], orgs))
        gw = GatewayProcess(cfg)
        try:
            res = asyncio.run(run_workload(gw.url, orgs, seconds, fleet.log))
        finally:
            gw.stop()
    finally:
        fleet.stop()
    return res, fleet


def _report(svc: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1%}" for k, v in shares(svc).items())


def test_an_over_declared_max_tokens_costs_its_owner_nothing(tmp_path: Path) -> None:
    orgs = over_declared_orgs()
    seconds = 12.0
    res, fleet = run_case(tmp_path, orgs, seconds, unit=0.002)
    assert all(not e for e in res.errors.values()), res.errors
    assert all(e.served > 0 for e in fleet.engines)  # both engines, fast and slow, served
    assert res.ok["B"] > 0 and res.ok["C"] > 0
    backlogged = [o.name for o in orgs if o.backlogged]
    t0, t1 = res.start + 2.0, res.start + seconds  # after the warm-up, while every org is backlogged
    svc = service(res.log, backlogged, t0, t1)
    sh = shares(svc)
    for org, s in sh.items():
        assert abs(s - 1 / 3) <= 0.05, f"{org} got {s:.1%} of the delivered service ({_report(svc)})"
    assert jain(list(svc.values())) >= 0.98, _report(svc)
    window = sum(svc.values()) / 20
    least = least_window_share(res.log, backlogged, "D", window, t0, t1)
    assert least >= 1 / 3 / 2, f"D's least share over a twentieth of the run: {least:.1%} ({_report(svc)})"


def test_an_estimate_trained_low_buys_no_extra_service(tmp_path: Path) -> None:
    switch, seconds = 4.0, 16.0
    orgs = trained_low_orgs(switch)
    # a faster engine: the window after the switch holds many requests' worth of service (an
    # estimate trained low may buy at most one request's worth per backend slot, 8 here)
    res, fleet = run_case(tmp_path, orgs, seconds, unit=0.001)
    assert all(not e for e in res.errors.values()), res.errors
    names = [o.name for o in orgs]
    small = [t for t, org, out in fleet.done if org == "D" and out == 10 and t < res.start + switch]
    assert len(small) >= 20  # enough for the estimator to learn D's own ratio (min_flow_samples)
    svc = service(res.log, names, res.start + switch, res.start + seconds)
    for org, s in shares(svc).items():
        assert abs(s - 0.25) <= 0.05, f"{org} got {s:.1%} of the delivered service after D's switch ({_report(svc)})"
    assert jain(list(svc.values())) >= 0.98, _report(svc)


def test_an_over_declaring_org_that_sends_first_does_not_own_the_fleet(tmp_path: Path) -> None:
    orgs = plain_over_declared_orgs()
    seconds = 16.0
    # slower engines: one of A's requests is 0.6 s of service on the fast engine, 1.2 s on the
    # slow one, so the dispatches A made alone at the start weigh well past the warm-up
    res, fleet = run_case(tmp_path, orgs, seconds, unit=0.01)
    assert all(not e for e in res.errors.values()), res.errors
    assert all(e.served > 0 for e in fleet.engines)
    assert res.ok["B"] > 0
    backlogged = [o.name for o in orgs if o.backlogged]
    svc = service(res.log, backlogged, res.start + 2.0, res.start + seconds)
    for org, s in shares(svc).items():
        assert abs(s - 1 / 3) <= 0.05, f"{org} got {s:.1%} of the delivered service after the warm-up ({_report(svc)})"
