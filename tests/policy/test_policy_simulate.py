"""A policy file in the simulator (``sfq simulate teams --config FILE``): the same engine,
deterministic on decode steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sfq.cli import main
from sfq.policy import load_policy, parse_policy
from sfq.sim.adapter import EngineDiscipline
from sfq.sim.teams_config import STEPS_PER_SECOND, run_teams_config, teams_flows

TEAMS = Path(__file__).resolve().parents[2] / "docs" / "policy-teams.yaml"


def test_the_policy_protects_b_and_c_in_the_simulator() -> None:
    doc = run_teams_config(load_policy(TEAMS), steps=4000, compare=("fifo", "prio"))
    rows = {r["policy"]: r["teams"] for r in doc["results"]}
    pol, fifo, prio = rows["policy-file"], rows["fifo"], rows["prio"]
    assert fifo["team-b"]["completed"] == 0  # FIFO: B is hostage to A's dump
    assert pol["team-b"]["completed"] > 0.9 * pol["team-b"]["submitted"]
    assert pol["team-b"]["wait_p95"] < prio["team-b"]["wait_p95"] < fifo["team-b"]["wait_p95"]
    assert prio["team-c"]["completed"] == 0 < pol["team-c"]["completed"]  # strict priority: C waits behind A
    assert pol["team-a"]["cost_share"] > 0.3  # and A still gets a large share
    assert doc == run_teams_config(load_policy(TEAMS), steps=4000, compare=("fifo", "prio"))  # deterministic


def test_org_limit_and_queue_age_hold_in_the_simulator() -> None:
    from sfq.sim import Fleet, Simulation, make_estimator
    from sfq.sim.scenarios import teams_workload

    text = TEAMS.read_text().replace("  batch: {weight: 1}", "  batch: {weight: 1, max_queue_age_seconds: 10}")
    policy = parse_policy(text)
    wl = teams_workload(0, 3000)
    sim_pol = EngineDiscipline(policy, teams_flows(policy, [f.name for f in wl.flows]))
    seen = []
    start = sim_pol.start

    def recording_start(t: int, fits):
        r = start(t, fits)
        seen.append(sim_pol.engine.shared.slots[("org", "team-a")].used)
        return r

    sim_pol.start = recording_start  # type: ignore[method-assign]
    res = Simulation(wl, sim_pol, Fleet(servers=8, kv_budget=8192, max_batch=1), horizon=3000,
                     estimator=make_estimator(1.0, 2.0, 0.5)).run()
    assert max(seen) == 6  # team-a's max_in_flight, never more, though 8 servers were free at first
    # 10 s of queue age = 333 decode steps: most of A's 400 jobs were dropped, never started
    assert sim_pol.dropped["team-a"] > 300
    started = (res.flow == 0) & (res.admit >= 0)
    assert int(started.sum()) + sim_pol.dropped["team-a"] <= 400
    assert STEPS_PER_SECOND == pytest.approx(33.333, rel=1e-3)


def test_the_file_must_name_the_teams() -> None:
    bad = parse_policy(TEAMS.read_text().replace("team-c:", "team-z:"))
    with pytest.raises(ValueError, match="'team-c/batch' needs org 'team-c'"):
        run_teams_config(bad, steps=500)


def test_cli(tmp_path, capsys) -> None:
    assert main(["simulate", "teams", "--config", str(TEAMS), "--steps", "1500", "--json", "-p", "sfq"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in doc["results"]] == ["policy-file", "sfq"]
    assert main(["simulate", "teams", "--config", str(TEAMS), "--steps", "1500", "-p", "fifo"]) == 0
    assert "policy-file  team-b" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(TEAMS.read_text().replace("weight: 6", "weight: -6"))
    assert main(["simulate", "teams", "--config", str(bad)]) == 1
    assert "classes.interactive.weight: must be a number > 0, got -6" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "return", "--config", str(TEAMS)])
