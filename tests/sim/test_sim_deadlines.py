"""``sfq simulate deadlines``: an interactive class with a TTFT objective and deadlines beside a
batch flood, under fifo, strict priority, sfq, sfq with deadlines (EDF inside the flow) and sfq
with deadlines and the pool's ``limits.headroom`` (the engine's own, K slots kept).

The assertions are on the seeded numbers (simulated steps, not wall time), with margins: the
ordering the mechanisms imply, not the values of one seed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sfq.sim.scenarios import Options, ScenarioResult, run_scenario


def _rows(res: ScenarioResult) -> dict[str, dict[str, Any]]:
    return {r["policy"]: r for r in res.results}


@pytest.fixture(scope="module")
def runs() -> list[ScenarioResult]:
    return [run_scenario("deadlines", Options(seed=seed, steps=6000)) for seed in (0, 1, 2)]


def test_the_scenario_runs_every_policy_and_reports_each_class(runs: list[ScenarioResult]) -> None:
    rows = _rows(runs[0])
    assert list(rows) == ["fifo", "prio", "sfq", "sfq-edf", "sfq-edf-headroom-3", "sfq-edf-headroom-5"]
    assert runs[0].params["headroom"] == [3, 5]
    assert rows["sfq-edf-headroom-3"]["headroom"] == 3 and rows["sfq-edf"]["headroom"] == 0
    for r in rows.values():
        for cls in ("interactive", "batch"):
            c = r["classes"][cls]
            assert c["requests"] > 0 and 0.0 <= c["attainment"] <= 1.0 and 0.0 <= c["in_time"] <= 1.0
    assert rows["fifo"]["batch_vs_fifo"] == 1.0
    assert rows["sfq"]["dropped"] == 0 and rows["sfq-edf"]["dropped"] > 0  # only the deadlines drop


def test_the_headroom_rows_follow_the_option_and_the_policy_list() -> None:
    res = run_scenario("deadlines", Options(seed=0, steps=1500, headroom=(2,)), policies=["sfq"])
    assert [r["policy"] for r in res.results] == ["fifo", "sfq", "sfq-edf", "sfq-edf-headroom-2"]
    with pytest.raises(ValueError, match="headroom"):
        run_scenario("deadlines", Options(seed=0, steps=100, headroom=(32,)))
    with pytest.raises(ValueError, match="headroom"):
        Options(headroom=(0,))


def test_the_scenario_is_deterministic_from_its_seed(runs: list[ScenarioResult]) -> None:
    again = run_scenario("deadlines", Options(seed=0, steps=6000))
    assert json.dumps(again.document(), sort_keys=True) == json.dumps(runs[0].document(), sort_keys=True)
    other = run_scenario("deadlines", Options(seed=7, steps=6000))
    assert other.document()["results"] != runs[0].document()["results"]


def test_the_order_of_the_results_is_the_one_the_mechanisms_imply(runs: list[ScenarioResult]) -> None:
    for res in runs:
        rows = _rows(res)
        inter = {p: r["classes"]["interactive"] for p, r in rows.items()}
        # FIFO queues the interactive class behind the whole flood: worst by far
        for p in ("prio", "sfq", "sfq-edf"):
            assert inter[p]["attainment"] >= inter["fifo"]["attainment"] + 0.5
            assert inter[p]["ttft_p99"] * 10 < inter["fifo"]["ttft_p99"]
        # sfq keeps the quiet class close to strict priority without a strict class
        assert inter["sfq"]["attainment"] >= inter["prio"]["attainment"] - 0.1
        # EDF inside the flow: more requests start before their own deadline than in arrival order
        assert inter["sfq-edf"]["in_time"] >= inter["sfq"]["in_time"] + 0.01
        assert inter["sfq-edf"]["in_time"] >= inter["prio"]["in_time"]
        # the batch class keeps (nearly) all of FIFO's service: every policy is work conserving
        for p in ("prio", "sfq", "sfq-edf"):
            assert rows[p]["batch_vs_fifo"] >= 0.95
        # headroom K: a burst finds K slots at once. The interactive class's attainment rises
        # above sfq-edf's (no lower with K = 3; with K = 5 at least 3 points higher and 97 %) and its p99
        # falls; the batch class pays about the K slots kept idle (K / 32 of the engine, less
        # what the interactive class runs in them), never more
        h3, h5 = inter["sfq-edf-headroom-3"], inter["sfq-edf-headroom-5"]
        assert h3["attainment"] >= inter["sfq-edf"]["attainment"]
        assert h5["attainment"] >= inter["sfq-edf"]["attainment"] + 0.03 and h5["attainment"] >= 0.97
        assert h5["ttft_p99"] < inter["sfq-edf"]["ttft_p99"] and h5["in_time"] >= 0.99
        for k in (3, 5):
            b = rows[f"sfq-edf-headroom-{k}"]["batch_vs_fifo"]
            assert 1 - k / 32 - 0.02 <= b <= 1 - k / 32 + 0.05, (k, b)


def test_on_more_engines_the_flood_grows_and_the_interactive_tenant_does_not() -> None:
    one = _rows(run_scenario("deadlines", Options(seed=0, steps=3000, headroom=(2,)), policies=["sfq"]))
    res = run_scenario("deadlines", Options(seed=0, steps=3000, servers=2, headroom=(2,)), policies=["sfq"])
    assert res.params["servers"] == 2 and res.params["batch_rate"] == 0.30
    two = _rows(res)
    for p in ("fifo", "sfq-edf-headroom-2"):
        # the same interactive arrivals (the quiet tenant stays quiet), twice the batch arrivals
        assert two[p]["classes"]["interactive"]["requests"] == one[p]["classes"]["interactive"]["requests"]
        b1, b2 = one[p]["classes"]["batch"]["requests"], two[p]["classes"]["batch"]["requests"]
        assert 1.8 * b1 <= b2 <= 2.2 * b1, (b1, b2)
    # still a flood (twice the fleet's capacity): FIFO starves the interactive class, and K slots
    # kept of 64 cost about K / 64 of the batch class's service
    assert two["fifo"]["classes"]["interactive"]["attainment"] < 0.5
    assert 1 - 2 / 64 - 0.02 <= two["sfq-edf-headroom-2"]["batch_vs_fifo"] <= 1 - 2 / 64 + 0.02
