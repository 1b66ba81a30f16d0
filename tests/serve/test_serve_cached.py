"""Cached prompt tokens at their weight, through a real ``sfq serve`` process.

Two orgs of equal weight flood one loopback engine with the same requests (200 prompt tokens,
10 output tokens), but 90 % of org A's prompt comes from the engine's prefix cache and none of
org B's. The engine reports ``usage.prompt_tokens_details.cached_tokens`` and, as a prefix
cache does, spends nothing on cached tokens; it counts each org's *uncached* service (uncached
prompt + 2 x output) as it delivers it. With ``cost.cached_input_weight: 0`` the gateway
charges what the engine really did, so the two orgs get equal uncached service (within 6
points); with the default weight 1 (the control) both pay for their whole prompt, so they
get equal *requests* and A gets far less than half of the engine's real work. Bounded runs
(about 8 s of load each); the measures are shares of work counted at the engine, never times.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from delivered_workload import Fleet, OrgLoad, RunResult, policy_text, run_workload, service, shares
from serve_helpers import GatewayProcess

openai = pytest.importorskip("openai")

SECONDS = 8.0
WARM_UP = 2.0


def _orgs() -> list[OrgLoad]:
    return [OrgLoad("A", "sk-A", clients=8, max_tokens=10, use=lambda t: 10, prompt_chars=800, cached=90),
            OrgLoad("B", "sk-B", clients=8, max_tokens=10, use=lambda t: 10, prompt_chars=800)]


def _run(tmp_path: Path, weight: float | None) -> tuple[RunResult, dict[str, float]]:
    orgs = _orgs()
    fleet = Fleet((1.0,), slots=4, unit=0.002, cached_weight=0.0).start()
    try:
        cfg = tmp_path / f"policy-{weight}.yaml"
        cfg.write_text(policy_text([e.url for e in fleet.engines], orgs, cached_input_weight=weight))
        gw = GatewayProcess(cfg)
        try:
            res = asyncio.run(run_workload(gw.url, orgs, SECONDS, fleet.log))
        finally:
            gw.stop()
    finally:
        fleet.stop()
    assert all(not e for e in res.errors.values()), res.errors
    svc = service(res.log, ["A", "B"], res.start + WARM_UP, res.start + SECONDS)
    return res, shares(svc)


def test_weight_0_gives_orgs_with_different_cache_hit_rates_equal_uncached_service(tmp_path: Path) -> None:
    res, sh = _run(tmp_path, 0.0)
    assert abs(sh["A"] - 0.5) <= 0.06, sh
    assert res.ok["A"] > 2 * res.ok["B"]  # A's requests are cheap: it sends (and is served) many more


def test_weight_1_charges_cached_tokens_like_any_other(tmp_path: Path) -> None:
    res, sh = _run(tmp_path, None)
    assert sh["A"] < 0.3, sh  # equal requests: A's uncached work is 40 units a request, B's 220
    assert res.ok["A"] == pytest.approx(res.ok["B"], rel=0.3)
