"""The slices of the global limits that gateways keep while Redis is lost (docs/gateway.md,
"When Redis is lost"), by the decider's tables of their shares: every table's split adds up to
each limit exactly, and gateways that hold either of the last two tables, each taking the
smaller of the parts the two give it, never take more than the limit together."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from sfq.state._local import SPREAD, Slices, allocate, shares_table

IDS = ["a", "b", "c", "d", "e"]
demands = st.dictionaries(st.sampled_from(IDS), st.floats(0, 100, allow_nan=False), max_size=5)
lives = st.lists(st.sampled_from(IDS), min_size=1, max_size=5, unique=True)


@settings(max_examples=300, deadline=None)
@given(demands, lives, st.integers(0, 300))
@example({"a": 5e-324}, ["a", "b"], 0)  # (a demand so small that SPREAD times it was 0)
def test_a_tables_split_adds_up_to_the_limit(demand: dict[str, float], live: list[str], limit: int) -> None:
    t = shares_table(demand, live)
    assert set(t) == set(live) and abs(sum(t.values()) - 1.0) < 1e-9
    assert min(t.values()) > 0  # every live gateway keeps a part of the rates (SPREAD)
    parts = allocate(limit, t)
    assert sum(parts.values()) == limit and min(parts.values()) >= 0
    if limit >= len(live):  # every live gateway starts something alone, whatever its demand was
        assert min(parts.values()) >= 1


@settings(max_examples=300, deadline=None)
@given(st.lists(demands, min_size=3, max_size=3), lives, st.integers(0, 64), st.data())
def test_gateways_on_either_of_the_last_two_tables_stay_within_the_limit(
        ds: list[dict[str, float]], live: list[str], limit: int, data: st.DataObject) -> None:
    t1, t2, t3 = (shares_table(d, live) for d in ds)
    total = 0
    for i, g in enumerate(sorted(live)):
        pair = data.draw(st.sampled_from([(t1, t2), (t2, t3)]))  # (a gateway that renewed since t3, or not)
        total += Slices(i, len(live), g, pair).count(limit)
    assert total <= limit


def test_the_busier_gateway_gets_the_larger_slice() -> None:
    """Weights 2:1:1 sticky to three gateways (issue 41's unfair case with equal slices): the
    slices follow the demand, with SPREAD of them equal."""
    t = shares_table({"a": 2.0, "b": 1.0, "c": 1.0}, ["a", "b", "c"])
    assert allocate(8, t) == {"a": 4, "b": 2, "c": 2}
    assert abs(t["a"] - (2 + SPREAD * 4 / 3) / (4 * (1 + SPREAD))) < 1e-12
    assert abs(Slices(0, 3, "a", [t, t]).rate(60.0) - 60.0 * t["a"]) < 1e-9
    assert Slices(0, 3, "a", []).count(8) == 3  # without two tables: equal parts by rank


def test_a_gateway_idle_when_the_table_was_made_still_gets_a_slot() -> None:
    """The decider's first table comes before the others' load (4.5 % of the demand here): by the
    shares alone that is none of 4 slots, and its requests would wait for Redis to come back."""
    t = shares_table({"a": 3.0}, ["a", "b"])
    assert t["b"] < 0.05
    assert allocate(4, t) == {"a": 3, "b": 1}
    assert allocate(1, t) == {"a": 1, "b": 0}  # (fewer slots than gateways: by the shares)


def test_leads_that_are_not_what_a_decider_writes_are_skipped_not_raised() -> None:
    """``P leads`` is read back from Redis: garbage there (not JSON, not an object, bad rows, a
    lead past the core's bounds) starts those flows level and leaves the others' leads."""
    from sfq.policy import Flow, parse_policy
    from sfq.state._local import Alone
    from sfq.state.redis_state import _leads_of

    assert _leads_of("not json") == {} and _leads_of("[1, 2]") == {} and _leads_of(None) == {}
    pol = parse_policy("""
pools:
  p: {models: [m], backends: [{url: "http://127.0.0.1:9", max_in_flight: 2}]}
classes: {batch: {weight: 1}}
orgs:
  a: {keys: [ka], classes: [batch]}
  b: {keys: [kb], classes: [batch]}
""")
    alone = Alone.fleet(pol, clock=lambda: 0.0, estimator=None)
    a, b = Flow("a", "batch", "p"), Flow("b", "batch", "p")
    alone.restore({"p": [[list(a), 5.0], [["b"], 1.0], [list(b), "x"], [list(b), float("inf")], [list(b), 1e300],
                         "row"], "q": [[list(a), 1.0]], "p2": "rows"})
    q = alone.queues["p"]
    assert q.lead(a) == 5.0 and q.lead(b) == 0.0
