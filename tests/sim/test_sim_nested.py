"""``sfq simulate nested``: a team of ten users against a team of one, flat per-user SFQ
against nested shares (the engine's tree of schedulers), on both cores."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sfq.sim.scenarios import Options, run_scenario


def test_nested_gives_each_team_half_and_flat_gives_the_crowd_ten_elevenths(make: Callable[[], Any]) -> None:
    res = run_scenario("nested", Options(steps=3000, core=make), policies=["sfq"])
    rows = {r["policy"]: r for r in res.results}
    assert set(rows) == {"sfq", "sfq-nested"}
    flat, nested = rows["sfq"], rows["sfq-nested"]
    assert flat["team_share"]["t1"] == pytest.approx(10 / 11, abs=0.03)
    assert nested["team_share"]["t1"] == pytest.approx(0.5, abs=0.03)
    assert nested["team_share"]["t2"] == pytest.approx(0.5, abs=0.03)
    lo, hi = nested["t1_user_share"]
    assert 0.05 - 0.01 <= lo <= hi <= 0.05 + 0.01
    assert nested["throughput"] == pytest.approx(flat["throughput"], rel=0.05)  # the tree costs no service
