"""Team budgets (``orgs.NAME.teams.TEAM.budget``) in the engine, on both twins (``core``).

A request of a team with a budget reserves in its team's budget and in its org's (when the org
has one), both or neither; it is refused (429 ``budget_exhausted``) naming the budget that
cannot cover it, with ``Retry-After`` to the end of that budget's period (the later end when
both refuse); its usage settles both; a team's spend counts toward its org's. The wall clock is
injected: 2026-12-15 23:00 UTC is an hour before the day ends and 16 days and an hour before
the month does, so the two periods' ends tell which budget refused.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
from policy_helpers import Clock, policy

from sfq.engine import PolicyEngine, Request
from sfq.errors import PolicyError, Refused
from sfq.policy import Flow, parse_policy
from sfq.policy.report import policy_tables
from sfq.policy.spend import MemoryLedger

# input 0 and output 1e6 per 1M tokens: a request of max_tokens N reserves exactly N
PRICED = """
  p:
    models: [m]
    backends: [{url: "http://127.0.0.1:9", max_in_flight: 64}]
    prices: {input: 0, output: 1000000}
"""
#: org acme: 8 per UTC month; its team research: 5 per UTC day; its team product: no budget
ACME = """
  acme:
    classes: [batch]
    budget: {amount: 8, per: month}
    teams:
      research: {keys: [k-research], budget: {amount: 5, per: day}}
      product: {keys: [k-product]}
"""
RESEARCH = Flow("acme", "batch", "p", team="research")
PRODUCT = Flow("acme", "batch", "p", team="product")
MID_DECEMBER = datetime(2026, 12, 15, 23, 0, tzinfo=timezone.utc).timestamp()
DAY_END = 3600.0  # seconds from MID_DECEMBER to the end of its UTC day
MONTH_END = datetime(2027, 1, 1, tzinfo=timezone.utc).timestamp() - MID_DECEMBER
DAY, MONTH = "2026-12-15", "2026-12"


class Wall:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def engine(core, wall: Wall | None = None, orgs: str = ACME, extra: str = "") -> PolicyEngine:
    return PolicyEngine(policy(pools=PRICED, orgs=orgs, extra=extra), clock=Clock(), scheduler=core,
                        wall_clock=wall or Wall(MID_DECEMBER))


def submit(e: PolicyEngine, flow: Flow, max_tokens: int) -> Request:
    body = {"model": "m", "prompt": "x" * 40, "max_tokens": max_tokens}
    return e.submit(flow, estimate=e.estimator.estimate(body, flow))


def refused(e: PolicyEngine, flow: Flow, max_tokens: int) -> Refused:
    with pytest.raises(Refused) as info:
        submit(e, flow, max_tokens)
    assert (info.value.reason, info.value.http_status) == ("budget_exhausted", 429)
    return info.value


def held(e: PolicyEngine) -> tuple[float, float]:
    """(the org's reservations this month, research's today)."""
    return e.spend.ledger.held("acme", MONTH), e.spend.ledger.held("acme", DAY, "research")


# ---------------------------------------------------------------- the policy file
def test_a_team_budget_parses_and_shows_in_check_config() -> None:
    acme = policy(pools=PRICED, orgs=ACME).orgs["acme"]
    rb = acme.teams["research"].budget
    assert rb is not None and (rb.amount, rb.per) == (5.0, "day") and acme.teams["product"].budget is None
    budgets = next(rows for title, _, rows in policy_tables(policy(pools=PRICED, orgs=ACME))
                   if title.startswith("Budgets"))
    assert budgets == [["acme", "8", "per UTC month"], ["acme.teams.research", "5", "per UTC day (and org acme's)"]]


@pytest.mark.parametrize(("budget", "path", "problem"), [
    ("{amount: 5, per: week}", "orgs.acme.teams.research.budget.per", "must be one of day, month (UTC), got 'week'"),
    ("{amount: -1, per: day}", "orgs.acme.teams.research.budget.amount", "must be a number >= 0, got -1"),
    ("{amount: .nan, per: day}", "orgs.acme.teams.research.budget.amount", "must be a number >= 0, got nan"),
    ("{per: day}", "orgs.acme.teams.research.budget.amount", "is required"),
    ("{amount: 5}", "orgs.acme.teams.research.budget.per", "is required"),
    ("{amount: 5, per: day, hard: true}", "orgs.acme.teams.research.budget.hard", "unknown key"),
    ("5", "orgs.acme.teams.research.budget", "must be a mapping"),
])
def test_a_bad_team_budget_is_refused_naming_its_path(budget: str, path: str, problem: str) -> None:
    with pytest.raises(PolicyError) as info:
        policy(pools=PRICED, orgs=ACME.replace("{amount: 5, per: day}", budget))
    assert info.value.path == path and problem in str(info.value)


def test_team_budgets_are_refused_in_the_template_and_kept_by_a_shared_ledger() -> None:
    base = ("pools: {p: {models: [m], backends: [{url: 'http://127.0.0.1:9'}], prices: {input: 1, output: 1}}}\n"
            "classes: {batch: {}}\n")
    with pytest.raises(PolicyError, match=r"^org_template.teams: unknown key"):
        parse_policy(base + "org_template: {classes: [batch], teams: {t: {budget: {amount: 1, per: day}}}}\n")
    # several gateways keep teams and their budgets in Redis (tests/state/test_state_budgets.py)
    assert policy(pools=PRICED, orgs=ACME, extra='state: {redis: "redis://127.0.0.1:1/0"}\n').orgs["acme"].teams
    # one gateway's spend file is no shared ledger: teams and their budgets are kept in it
    assert policy(pools=PRICED, orgs=ACME, extra='state: {file: "/tmp/sfq-spend.json"}\n').orgs["acme"].teams


# ---------------------------------------------------------------- the rule
def test_the_team_budget_refuses_while_the_org_has_room(core) -> None:
    e = engine(core)
    submit(e, RESEARCH, 3)
    submit(e, RESEARCH, 2)  # research: 5 of 5; acme: 5 of 8
    exc = refused(e, RESEARCH, 1)
    assert "team 'research' of org 'acme' has spent its budget of 5 for this UTC day (2026-12-15)" in str(exc)
    assert "budget of 8" not in str(exc)
    assert exc.retry_after == pytest.approx(DAY_END)  # the team's period, not the org's month
    assert held(e) == (pytest.approx(5), pytest.approx(5))  # neither reserved the refused request
    submit(e, PRODUCT, 3)  # the sibling team without a budget: only the org's, 8 of 8 now
    counts = e.metrics.snapshot()[RESEARCH.flat]  # (the metrics' flows are (org, class, pool))
    assert counts["refused"] == 1 and counts["reasons"] == {"budget_exhausted": 1}


def test_the_org_budget_refuses_while_the_team_has_room(core) -> None:
    e = engine(core)
    submit(e, PRODUCT, 6)  # acme: 6 of 8 (product has no budget of its own)
    exc = refused(e, RESEARCH, 3)  # research has 5 left today, but acme only 2 this month
    assert "org 'acme' has spent its budget of 8 for this UTC month (2026-12)" in str(exc)
    assert "team" not in str(exc)
    assert exc.retry_after == pytest.approx(MONTH_END)
    assert held(e) == (pytest.approx(6), 0.0)  # the team's part was not reserved either
    submit(e, RESEARCH, 2)  # fits both: 8 of 8, 2 of 5
    assert held(e) == (pytest.approx(8), pytest.approx(2))
    refused(e, PRODUCT, 1)


def test_both_exhausted_retry_after_the_later_period_end(core) -> None:
    # the team's budget per month and the org's per day: both full, the month's end is the later
    e = engine(core, orgs=ACME.replace("amount: 8, per: month", "amount: 5, per: day")
               .replace("amount: 5, per: day}}", "amount: 5, per: month}}"))
    submit(e, RESEARCH, 5)
    exc = refused(e, RESEARCH, 1)
    assert "team 'research'" in str(exc) and "org 'acme' has spent its budget of 5 for this UTC day" in str(exc)
    assert exc.retry_after == pytest.approx(MONTH_END)
    exc = refused(e, PRODUCT, 1)  # the sibling waits for the org's day only
    assert exc.retry_after == pytest.approx(DAY_END)


def test_usage_settles_both_and_a_cancel_gives_both_back(core) -> None:
    e = engine(core)
    r1 = submit(e, RESEARCH, 4)
    assert r1 in e.poll()
    r2 = submit(e, RESEARCH, 1)  # waits: the pool's one request runs
    assert held(e) == (pytest.approx(5), pytest.approx(5))
    e.complete(r1, {"prompt_tokens": 10, "completion_tokens": 2})  # 4 reserved -> 2 spent, in both
    ledger = e.spend.ledger
    assert (ledger.spent("acme", MONTH), ledger.spent("acme", DAY, "research")) == (pytest.approx(2), pytest.approx(2))
    assert held(e) == (pytest.approx(1), pytest.approx(1))
    e.cancel(r2)
    assert held(e) == (0.0, 0.0)  # given back to both, nothing spent
    assert ledger.spent("acme", MONTH) == pytest.approx(2)
    submit(e, RESEARCH, 3)  # 2 spent + 3 = 5: the team's room is back, exactly
    refused(e, RESEARCH, 1)
    stats = e.spend.stats()["acme"]
    assert (stats["spent"], stats["reserved"]) == (pytest.approx(2), pytest.approx(3))
    assert stats["teams"]["research"]["period"] == DAY and stats["teams"]["research"]["reserved"] == pytest.approx(3)
    assert "product" not in stats["teams"]


def test_a_team_budget_applies_in_an_org_without_one(core) -> None:
    e = engine(core, orgs=ACME.replace("    budget: {amount: 8, per: month}\n", ""))
    submit(e, RESEARCH, 5)
    exc = refused(e, RESEARCH, 1)
    assert "team 'research'" in str(exc) and exc.retry_after == pytest.approx(DAY_END)
    for _ in range(3):
        submit(e, PRODUCT, 100)  # no budget holds product
    assert set(e.spend.stats()) == {"acme"} and "amount" not in e.spend.stats()["acme"]


def test_a_new_day_renews_the_team_but_not_the_org(core) -> None:
    wall = Wall(MID_DECEMBER)
    e = engine(core, wall)
    r = submit(e, RESEARCH, 5)
    e.poll()
    e.complete(r, {"prompt_tokens": 1, "completion_tokens": 5})
    refused(e, RESEARCH, 1)
    wall.t += DAY_END  # the 16th: research starts again, acme's month goes on (5 of 8 spent)
    submit(e, RESEARCH, 3)
    exc = refused(e, RESEARCH, 1)
    assert "org 'acme'" in str(exc) and exc.retry_after == pytest.approx(MONTH_END - DAY_END)


def test_the_spend_file_keeps_the_team_spend_across_restarts(core, tmp_path: Path) -> None:
    f = tmp_path / "spend.json"
    extra = f'state: {{file: "{f}"}}\n'
    e = engine(core, extra=extra)
    r = submit(e, RESEARCH, 4)
    e.poll()
    e.complete(r, {"prompt_tokens": 1, "completion_tokens": 4})
    e.spend.flush()
    saved = json.loads(f.read_text())
    assert saved["spent"] == [["acme", MONTH, 4.0]] and saved["teams"] == [["acme", "research", DAY, 4.0]]
    again = engine(core, Wall(MID_DECEMBER + 60), extra=extra)
    assert again.spend.ledger.spent("acme", DAY, "research") == pytest.approx(4)
    exc = refused(again, RESEARCH, 2)  # 4 + 2 > 5
    assert "team 'research'" in str(exc)
    submit(again, PRODUCT, 4)  # 4 + 4 = 8: the team's spend counted toward the org's
    refused(again, PRODUCT, 1)
    # a file written before team budgets (no "teams") still loads; a bad team row is named
    f.write_text('{"version": 1, "spent": [["acme", "2026-12", 1]]}')
    assert MemoryLedger(f).spent("acme", MONTH) == 1.0
    for bad in ('[["acme", "", "2026-12-15", 1]]', '[["acme", "research", 1]]'):
        f.write_text('{"version": 1, "spent": [], "teams": %s}' % bad)
        with pytest.raises(ValueError, match=r"state.file: bad entry"):
            MemoryLedger(f)


def test_a_reload_takes_the_new_team_budget_and_keeps_the_spend(core) -> None:
    e = engine(core)
    r = submit(e, RESEARCH, 5)
    e.poll()
    e.complete(r, {"prompt_tokens": 1, "completion_tokens": 5})
    refused(e, RESEARCH, 1)
    new, _ = e.reloaded(policy(pools=PRICED, orgs=ACME.replace("amount: 5, per: day", "amount: 7, per: day")))
    submit(new, RESEARCH, 2)  # 5 + 2 = 7
    refused(new, RESEARCH, 1)  # (and the org is at 7 + 1 = 8: the team refuses first)
