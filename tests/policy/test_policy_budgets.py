"""Spending budgets and cached tokens in the engine: the policy fields (bad input named by its
path), the reservation at admission and the settlement from usage, ``budget_exhausted`` with
``Retry-After`` to the UTC period's end (an injected wall clock), the spend file, the
``sfq_spend_total`` series; cached prompt tokens charged at ``cached_input_weight`` (weight 1:
the very same meters as without them), and the cached fraction the estimator learns per flow.
Every engine rule on both twins (``core``)."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path

import pytest
from policy_helpers import Clock, policy
from prometheus_client import generate_latest

from sfq.cost import CostEstimator
from sfq.engine import PolicyEngine
from sfq.errors import PolicyError, Refused
from sfq.policy import Flow, parse_policy
from sfq.policy.spend import MemoryLedger, SpendBook, period_of

A, B = Flow("a", "batch", "p"), Flow("b", "batch", "p")
UNBUDGETED = """
  a: {keys: [ka], classes: [batch]}
  b: {keys: [kb], classes: [batch]}
"""
ORGS = """
  a: {keys: [ka], classes: [batch], budget: {amount: 10, per: day}}
  b: {keys: [kb], classes: [batch]}
"""
# input 0 and output 1e6 per 1M tokens: a request of max_tokens N reserves exactly N
PRICED = """
  p:
    models: [m]
    backends: [{url: "http://127.0.0.1:9", max_in_flight: 64}]
    prices: {input: 0, output: 1000000}
"""
#: 2026-12-31 23:00:00 UTC: an hour before both the day and the month end
NEW_YEARS_EVE = datetime(2026, 12, 31, 23, 0, tzinfo=timezone.utc).timestamp()


class Wall:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def engine(core, clock: Clock, wall: Wall, orgs: str = ORGS, pools: str = PRICED, extra: str = "") -> PolicyEngine:
    pol = policy(pools=pools, orgs=orgs, extra=extra or "cost: {input_weight: 1, output_weight: 2, charge: served}\n")
    return PolicyEngine(pol, clock=clock, scheduler=core, wall_clock=wall)


def submit(e: PolicyEngine, flow: Flow, max_tokens: int, prompt: str = "x" * 40):
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens}
    return e.submit(flow, estimate=e.estimator.estimate(body, flow))


# ---------------------------------------------------------------- the policy file
@pytest.mark.parametrize(("fragment", "path", "problem"), [
    ("prices: {input: -1, output: 1}", "pools.p.prices.input", "must be a number >= 0, got -1"),
    ("prices: {input: .nan, output: 1}", "pools.p.prices.input", "must be a number >= 0, got nan"),
    ("prices: {input: 1, output: '2'}", "pools.p.prices.output", "must be a number >= 0, got '2'"),
    ("prices: {input: 1, output: 1, cached_input: -0.5}", "pools.p.prices.cached_input", "must be a number >= 0"),
    ("prices: {input: 1}", "pools.p.prices.output", "is required"),
    ("prices: {input: 1, output: 1, cache: 1}", "pools.p.prices.cache", "unknown key"),
])
def test_bad_prices_are_refused_naming_the_field(fragment: str, path: str, problem: str) -> None:
    pools = f"""
      p:
        models: [m]
        backends: [{{url: "http://127.0.0.1:9"}}]
        {fragment}
    """
    with pytest.raises(PolicyError) as info:
        policy(pools=pools)
    assert info.value.path == path and problem in str(info.value)


@pytest.mark.parametrize(("budget", "path", "problem"), [
    ("{amount: 300, per: week}", "orgs.a.budget.per", "must be one of day, month (UTC), got 'week'"),
    ("{amount: -5, per: day}", "orgs.a.budget.amount", "must be a number >= 0, got -5"),
    ("{amount: .nan, per: day}", "orgs.a.budget.amount", "must be a number >= 0, got nan"),
    ("{amount: .inf, per: month}", "orgs.a.budget.amount", "must be a number >= 0, got inf"),
    ("{per: day}", "orgs.a.budget.amount", "is required"),
    ("{amount: 1}", "orgs.a.budget.per", "is required"),
    ("300", "orgs.a.budget", "must be a mapping"),
])
def test_bad_budgets_are_refused_naming_the_field(budget: str, path: str, problem: str) -> None:
    with pytest.raises(PolicyError) as info:
        policy(orgs=f"\n  a: {{keys: [ka], classes: [batch], budget: {budget}}}\n")
    assert info.value.path == path and problem in str(info.value)


def test_bad_cost_and_state_fields_are_refused() -> None:
    with pytest.raises(PolicyError, match=r"^cost.cached_input_weight: must be a number >= 0, got -1"):
        policy(extra="cost: {cached_input_weight: -1}\n")
    with pytest.raises(PolicyError, match=r"^state.file: .*redis or file, not both"):
        policy(extra='state: {redis: "redis://127.0.0.1:1/0", file: "/tmp/x"}\n')
    with pytest.raises(PolicyError, match=r"^state.prefix: unknown key"):
        policy(extra='state: {file: "/tmp/x", prefix: "p:"}\n')
    with pytest.raises(PolicyError, match=r"^org_template.budget: unknown key"):
        parse_policy("pools: {p: {models: [m], backends: [{url: 'http://127.0.0.1:9'}]}}\n"
                     "classes: {batch: {}}\norg_template: {classes: [batch], budget: {amount: 1, per: day}}\n")


def test_the_fields_parse_and_default_to_todays_behaviour() -> None:
    p = policy(pools=PRICED, orgs=ORGS)
    assert p.pools["p"].prices is not None and p.pools["p"].prices.cached_input is None
    a = p.orgs["a"].budget
    assert a is not None and (a.amount, a.per) == (10.0, "day") and p.orgs["b"].budget is None
    assert p.cost.cached_input_weight == 1.0 and policy().pools["p"].prices is None
    # the cached price defaults to the input price; currency per 1M tokens
    pr = policy(pools=PRICED.replace("input: 0,", "input: 2.5, cached_input: 1.25,")).pools["p"].prices
    assert pr is not None and pr.cost(1000, 400, 100) == pytest.approx((600 * 2.5 + 400 * 1.25 + 100 * 1e6) / 1e6)


def test_periods_end_at_the_utc_day_and_month() -> None:
    assert period_of("day", NEW_YEARS_EVE) == ("2026-12-31", NEW_YEARS_EVE + 3600)
    assert period_of("month", NEW_YEARS_EVE) == ("2026-12", NEW_YEARS_EVE + 3600)
    feb = datetime(2028, 2, 10, tzinfo=timezone.utc).timestamp()
    assert period_of("month", feb) == ("2028-02", datetime(2028, 3, 1, tzinfo=timezone.utc).timestamp())


# ---------------------------------------------------------------- the budget in the engine
def test_a_request_the_budget_cannot_cover_is_refused_until_the_period_ends(core, clock: Clock) -> None:
    wall = Wall(NEW_YEARS_EVE)
    e = engine(core, clock, wall)
    r1 = submit(e, A, 6)  # reserves 6 of 10
    with pytest.raises(Refused) as info:
        submit(e, A, 5)  # 6 + 5 > 10: never started, whatever r1 ends up spending
    exc = info.value
    assert (exc.reason, exc.http_status, exc.error_code) == ("budget_exhausted", 429, "budget_exhausted")
    assert exc.retry_after == pytest.approx(3600)  # to the UTC day's end
    counts = e.metrics.snapshot()[("a", "batch", "p")]
    assert counts["refused"] == 1 and counts["reasons"] == {"budget_exhausted": 1}
    r2 = submit(e, A, 4)  # 6 + 4 fits exactly
    assert e.spend.ledger.held("a", "2026-12-31") == pytest.approx(10)
    submit(e, B, 1000)  # b has no budget
    assert set(e.poll()) >= {r1, r2}
    e.complete(r1, {"prompt_tokens": 10, "completion_tokens": 2})  # settled: 6 reserved -> 2 spent
    assert e.spend.ledger.spent("a", "2026-12-31") == pytest.approx(2)
    r3 = submit(e, A, 4)  # 2 spent + 4 reserved + 4 = 10
    e.cancel(r3)  # cancelled before it started: given back, nothing spent
    assert r3.hold is not None
    e.spend.release(r3.hold)  # (given back once only)
    assert e.spend.ledger.held("a", "2026-12-31") == pytest.approx(4)
    wall.t += 3600  # a new day (and a new month): the budget starts again
    for _ in range(2):
        submit(e, A, 5)
    text = generate_latest(e.metrics.registry).decode()
    assert 'sfq_spend_total{org="a",pool="p"} 2.0' in text  # what was settled, in currency


def test_a_failed_attempt_spends_what_it_delivered(core, clock: Clock) -> None:
    e = engine(core, clock, Wall(NEW_YEARS_EVE), extra="cost: {charge: served}\nretry: {max_attempts: 1}\n")
    r = submit(e, A, 8)
    e.poll()
    e.delivered(r, 3)
    e.fail(r, RuntimeError("upstream went away"))
    assert r.outcome == "failed"
    assert e.spend.ledger.spent("a", "2026-12-31") == pytest.approx(3)
    assert e.spend.ledger.held("a", "2026-12-31") == 0


def test_an_org_without_a_budget_or_a_pool_without_prices_is_never_refused(core, clock: Clock) -> None:
    e = engine(core, clock, Wall(NEW_YEARS_EVE), pools="""
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9"}]
    """)
    for _ in range(5):
        submit(e, A, 1000)  # a's budget applies to pools with prices only
    assert e.spend.totals == {}


def test_the_spend_file_keeps_the_period_across_restarts(core, clock: Clock, tmp_path: Path) -> None:
    f = tmp_path / "spend.json"
    extra = f'state: {{file: "{f}"}}\n'
    e = engine(core, clock, Wall(NEW_YEARS_EVE), extra=extra)
    r = submit(e, A, 9)
    e.poll()
    e.complete(r, {"prompt_tokens": 1, "completion_tokens": 9})
    e.spend.flush()
    again = engine(core, clock, Wall(NEW_YEARS_EVE + 60), extra=extra)
    assert again.spend.ledger.spent("a", "2026-12-31") == pytest.approx(9)
    with pytest.raises(Refused, match="budget"):
        submit(again, A, 2)
    ledger = MemoryLedger(f)  # a new period of one org forgets that org's old one only
    ledger.settle("c", "2026-12", 0.0, 4.0)
    ledger.keep_only({"a": "2027-01-01"})
    assert (ledger.spent("a", "2026-12-31"), ledger.spent("c", "2026-12")) == (0.0, 4.0)
    f.write_text('{"version": 1, "spent": [["a", "2026-12-31", -3]]}')
    with pytest.raises(ValueError, match=r"state.file: bad entry"):
        MemoryLedger(f)


def test_a_reload_keeps_the_spend_and_takes_the_new_budget(core, clock: Clock) -> None:
    wall = Wall(NEW_YEARS_EVE)
    e = engine(core, clock, wall)
    r = submit(e, A, 8)
    e.poll()
    e.complete(r, {"prompt_tokens": 1, "completion_tokens": 8})
    new, _ = e.reloaded(policy(pools=PRICED, orgs=ORGS.replace("amount: 10", "amount: 20"),
                               extra="cost: {input_weight: 1, output_weight: 2, charge: served}\n"))
    assert new.spend is e.spend
    submit(new, A, 12)  # 8 + 12 = 20
    with pytest.raises(Refused, match="budget"):
        submit(new, A, 1)


def test_the_book_is_bounded_to_the_orgs_of_the_file() -> None:
    pol = parse_policy("pools: {p: {models: [m], backends: [{url: 'http://127.0.0.1:9'}], "
                       "prices: {input: 1, output: 1}}}\nclasses: {batch: {}}\n"
                       "orgs: {a: {classes: [batch], budget: {amount: 1, per: day}}}\n"
                       "org_template: {classes: [batch]}\n")
    book = SpendBook(pol, wall_clock=Wall(NEW_YEARS_EVE))
    for i in range(50):
        hold = book.admit(Flow(f"t{i}", "batch", "p"), None)
        assert hold is not None and not hold.budgeted
        book.used(hold, 10, 0, 10)
        book.settle(hold)
    assert list(book.totals) == [("_other", "p")]  # fifty template orgs: one series


def test_named_orgs_past_max_org_series_share_one_spend_series() -> None:
    """At most ``metrics.max_org_series`` orgs of the file get their own ``sfq_spend_total``
    label, those with a budget first; the rest are summed under ``_other`` (totals exact)."""
    orgs = "".join(f"  o{i}: {{classes: [batch]}}\n" for i in range(6))
    pol = parse_policy("pools: {p: {models: [m], backends: [{url: 'http://127.0.0.1:9'}], "
                       "prices: {input: 1, output: 1}}}\nclasses: {batch: {}}\n"
                       "metrics: {max_org_series: 3}\norgs:\n" + orgs
                       + "  rich: {classes: [batch], budget: {amount: 1000, per: day}}\n")
    book = SpendBook(pol, wall_clock=Wall(NEW_YEARS_EVE))
    for org in [f"o{i}" for i in range(6)] + ["rich"]:
        hold = book.admit(Flow(org, "batch", "p"), None)
        assert hold is not None
        book.used(hold, 1_000_000, 0, 0)  # 1.0 each
        book.settle(hold)
    assert book.totals == {("rich", "p"): 1.0, ("o0", "p"): 1.0, ("o1", "p"): 1.0, ("_other", "p"): 4.0}


# ---------------------------------------------------------------- cached tokens
def _usage(cached: int | None) -> dict[str, object]:
    u: dict[str, object] = {"prompt_tokens": 100, "completion_tokens": 10}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def _meters(core, clock: Clock, weight: str, cached: int | None) -> list[float]:
    e = engine(core, clock, Wall(NEW_YEARS_EVE), orgs=UNBUDGETED, pools="""
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9", max_in_flight: 1}]
        limits: {tokens_per_minute: 100000}
    """, extra=f"cost: {{input_weight: 1, output_weight: 2, charge: served{weight}}}\n")
    out = []
    for i in range(30):
        r = submit(e, A if i % 3 else B, 50, prompt="y" * 400)
        for s in e.poll():
            e.complete(s, _usage(cached))
        out += [e.queues["p"].meter(A), e.queues["p"].meter(B), e.queues["p"].tpm.available(clock())]
        del r
    return out


def test_weight_1_decides_exactly_as_without_cached_tokens(core, clock: Clock) -> None:
    plain = _meters(core, Clock(), "", None)
    assert _meters(core, Clock(), "", 80) == plain  # the same floats, not approximately
    assert _meters(core, Clock(), ", cached_input_weight: 1", 80) == plain
    free = _meters(core, Clock(), ", cached_input_weight: 0", 80)
    assert free != plain
    # at weight 0 the 80 cached tokens of each report leave the token bucket (and the meters) alone
    assert free[-1] - plain[-1] == pytest.approx(30 * 80, rel=0.05)


def test_cached_tokens_are_charged_at_their_weight(core, clock: Clock) -> None:
    e = engine(core, clock, Wall(NEW_YEARS_EVE), orgs=UNBUDGETED,
               extra="cost: {input_weight: 1, output_weight: 2, cached_input_weight: 0.25}\n")
    r = submit(e, A, 50, prompt="y" * 400)
    submit(e, B, 50)  # keeps the busy period open
    e.poll()
    q = e.queues["p"]
    before = q.meter(A) - r.charged
    e.complete(r, _usage(80))
    assert q.meter(A) - before == pytest.approx(20 + 0.25 * 80 + 2 * 10)
    assert e.usage_cost(_usage(80)) == (pytest.approx(20 + 20 + 10), pytest.approx(20 + 20 + 20))
    # and at the pool's prices: the cached price for the cached tokens
    assert e.spend.totals == {("a", "p"): pytest.approx(10.0)}  # input 0 here; 10 output tokens at 1 each


def test_the_estimator_learns_the_cached_fraction_per_flow_with_bounded_memory() -> None:
    est = CostEstimator(1.0, 2.0, cached_input_weight=0.0, min_flow_samples=3, max_flows=10)
    body = {"model": "m", "prompt": [1] * 100, "max_tokens": 10}  # 100 token ids: an exact prompt
    e0 = est.estimate(body, "hot")
    assert e0.charged_prompt == 100 and e0.cost == pytest.approx(100 + 2 * 10)  # nothing learned yet
    for _ in range(3):
        est.observe(est.estimate(body, "hot"), _usage(90), "hot")
        est.observe(est.estimate(body, "cold"), _usage(0), "cold")
    assert est.cached_fraction("m", "hot") == pytest.approx(0.9)
    assert est.cached_fraction("m", "cold") == 0.0
    assert est.estimate(body, "hot").cost == pytest.approx(10 + 2 * 10 * est.ratio("m", "hot"))
    assert est.estimate(body, "cold").cost == pytest.approx(100 + 2 * 10 * est.ratio("m", "cold"))
    assert est.cached_fraction("m", "new") == pytest.approx(0.45)  # the model's, until the flow has its own
    state = est.state()
    again = CostEstimator(1.0, 2.0, cached_input_weight=0.0, min_flow_samples=3)
    again.restore(state)
    assert again.cached_fraction("m", "hot") == pytest.approx(0.9)
    for i in range(50):  # many flows: the per-flow memory stays within max_flows
        est.observe(est.estimate(body, f"f{i}"), _usage(10), f"f{i}")
    assert len(est._flows) <= 10
    bad = {**state, "flows": [{**state["flows"][0], "cached": 1e9}]}
    with pytest.raises(ValueError, match="cached tokens are part of the prompt"):
        again.restore(bad)
    assert not math.isnan(again.cached_fraction("m", "hot"))
