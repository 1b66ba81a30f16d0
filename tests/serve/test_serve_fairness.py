"""The fair-share figures of a real ``sfq serve`` (``GET /stats``, ``sfq_share``,
``sfq_expected_share``, ``sfq_fairness_jain``), with the official ``openai`` client against
loopback upstreams (``support.workload``'s engine, ``serve_helpers``' upstream).

Nothing here is timed: the shares are of the work done, read after the load ran.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import GatewayProcess, Upstream, make_client, policy_yaml, wait_until
from support.workload import Fleet, OrgLoad, policy_text, run_workload, service, shares

openai = pytest.importorskip("openai")


def _stats(gw: GatewayProcess, query: str = "") -> dict[str, Any]:
    status, body = gw.get("/stats" + query)
    assert status == 200, body
    out: dict[str, Any] = json.loads(body)
    return out


def test_two_orgs_of_weight_1_and_2_flooding_get_a_third_and_two_thirds(tmp_path: Path) -> None:
    """Orgs A (weight 1) and B (weight 2) flood one pool (8 clients each, 4 slots). Read while
    both are backlogged, past the warm-up (a 4 s window ending 6 s into an 8 s load),
    ``/stats`` and ``/metrics`` say A was served about a third and B two thirds, that the
    weights promised exactly that, and Jain's index is about 1; the served cost they report is
    what the engine delivered."""
    orgs = [OrgLoad("A", "sk-A", clients=8, weight=1), OrgLoad("B", "sk-B", clients=8, weight=2)]
    fleet = Fleet((1.0,), slots=4, unit=0.002).start()
    try:
        cfg = tmp_path / "policy.yaml"
        cfg.write_text(policy_text([e.url for e in fleet.engines], orgs) + "metrics: {window_seconds: 4}\n")
        gw = GatewayProcess(cfg)
        try:
            async def read_during() -> tuple[dict[str, Any], str]:
                await asyncio.sleep(6.0)
                st = await asyncio.to_thread(_stats, gw)
                return st, (await asyncio.to_thread(gw.get, "/metrics"))[1].decode()

            async def both() -> tuple[Any, tuple[dict[str, Any], str]]:
                return await asyncio.gather(run_workload(gw.url, orgs, 8.0, fleet.log), read_during())

            res, (st, text) = asyncio.run(both())
            assert all(not e for e in res.errors.values()), res.errors
            after = _stats(gw)
            after_text = gw.get("/metrics")[1].decode()
        finally:
            gw.stop()
    finally:
        fleet.stop()
    assert st["window_seconds"] == 4 and set(st["pools"]) == {"main"}
    pool = st["pools"]["main"]
    a, b = pool["orgs"]["A"], pool["orgs"]["B"]
    assert set(pool["orgs"]) == {"A", "B"}  # no _other: nothing beyond max_org_series
    assert (a["weight"], b["weight"]) == (1.0, 2.0)
    assert abs(a["share"] - 1 / 3) < 0.05 and abs(b["share"] - 2 / 3) < 0.05, (a, b)
    assert abs(a["expected_share"] - 1 / 3) < 0.01 and abs(b["expected_share"] - 2 / 3) < 0.01, (a, b)
    assert pool["jain"] > 0.98 and pool["served_cost"] == pytest.approx(a["served_cost"] + b["served_cost"])
    assert a["waiting"] + b["waiting"] > 0 and pool["waiting"] == a["waiting"] + b["waiting"]
    assert a["oldest_wait_seconds"] is not None and a["wait_p99"] >= a["wait_p50"] > 0
    # the same figures as series
    series = _parse(text)
    assert series["sfq_share", (("org", "A"), ("pool", "main"))] == pytest.approx(a["share"], abs=0.03)
    assert series["sfq_expected_share", (("org", "B"), ("pool", "main"))] == pytest.approx(b["expected_share"],
                                                                                            abs=0.01)
    assert series["sfq_fairness_jain", (("pool", "main"),)] > 0.98
    assert series["sfq_org_weight", (("org", "B"),)] == 2.0
    # every request was counted: what each org completed, and the cost served since the start is
    # what the engine delivered (prompt + 2 x output, the policy's cost)
    delivered = service(res.log, ["A", "B"])
    for org in ("A", "B"):
        assert after["pools"]["main"]["orgs"][org]["requests"]["completed"] == res.ok[org]
        assert series_total(after_text, org) == pytest.approx(delivered[org], rel=0.01), (org, delivered)
    assert shares(delivered)["A"] < 0.45  # (the run as a whole was fair too)


def _parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def series_total(text: str, org: str) -> float:
    """``sfq_served_cost_total`` of ``org``, over its classes."""
    return sum(v for (name, labels), v in _parse(text).items()
               if name == "sfq_served_cost_total" and ("org", org) in labels)


def test_one_org_alone_is_promised_everything_and_idle_orgs_are_absent(tmp_path: Path, upstream: Upstream,
                                                                        refused_url: str) -> None:
    """Before any request no org has figures or series; one org alone is promised (and gets)
    the whole pool; ``?pool=`` narrows, an unknown pool is a 404."""
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(upstream.url, refused_url))
    gw = GatewayProcess(cfg)
    try:
        before = _stats(gw)
        assert before["window_seconds"] == 60.0  # the default
        assert before["pools"]["main"]["orgs"] == {} and before["pools"]["main"]["jain"] is None
        assert "sfq_share{" not in gw.get("/metrics")[1].decode()
        c = make_client(gw, "sk-b")
        for _ in range(3):
            c.completions.create(model="m", prompt="alone", max_tokens=4)
        st = _stats(gw, "?pool=main")
        status, missing = gw.get("/stats?pool=nope")
    finally:
        gw.stop()
    assert set(st["pools"]) == {"main"}  # ?pool= narrows
    b = st["pools"]["main"]["orgs"]["team-b"]
    assert set(st["pools"]["main"]["orgs"]) == {"team-b"}  # team-a and limited sent nothing: absent
    assert b["expected_share"] == pytest.approx(1.0) and b["share"] == pytest.approx(1.0)
    assert b["served_cost"] == pytest.approx(3 * (len("alone") + 2 * 4))  # usage x the policy's weights
    assert b["requests"]["completed"] == 3 and st["pools"]["main"]["jain"] == pytest.approx(1.0)
    assert status == 404 and b"unknown_pool" in missing
