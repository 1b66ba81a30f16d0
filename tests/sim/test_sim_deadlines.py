"""``sfq simulate deadlines``: an interactive class with a TTFT objective and deadlines beside a
batch flood, under fifo, strict priority, sfq and sfq with deadlines (EDF inside the flow).

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
    assert list(rows) == ["fifo", "prio", "sfq", "sfq-edf"]
    for r in rows.values():
        for cls in ("interactive", "batch"):
            c = r["classes"][cls]
            assert c["requests"] > 0 and 0.0 <= c["attainment"] <= 1.0 and 0.0 <= c["in_time"] <= 1.0
    assert rows["fifo"]["batch_vs_fifo"] == 1.0
    assert rows["sfq"]["dropped"] == 0 and rows["sfq-edf"]["dropped"] > 0  # only the deadlines drop


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
