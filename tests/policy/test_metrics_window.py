"""The share window's math (pure functions) and the bounded series of ``PolicyMetrics``, on an
injected clock: backlogged seconds (a request waiting throughout), expected shares among
backlogged flows (what it got for a flow that was not), Jain's index, wait quantiles; deadline
misses per class; at most ``max_org_series`` org labels, the rest under ``_other``, totals exact
and every counter monotonic while orgs change label."""

from __future__ import annotations

import json
import random
from bisect import bisect_left
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sfq.policy import parse_policy
from sfq.policy.metrics import (
    OTHER_ORG,
    WAIT_BUCKETS,
    PolicyMetrics,
    backlogged_mask,
    expected_shares,
    jain,
    wait_quantile,
)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ------------------------------------------------------------------ pure functions
def test_backlogged_mask_marks_every_second_a_span_of_waiting_covers_whole() -> None:
    # window: seconds 100..109 (bit i = second 100 + i)
    assert backlogged_mask([], None, 109.5, 100, 109) == 0
    assert backlogged_mask([(101.2, 101.9)], None, 109.5, 100, 109) == 0  # a moment: no second throughout
    assert backlogged_mask([(101.9, 103.1)], None, 109.5, 100, 109) == 0b100  # only 102 is covered whole
    assert backlogged_mask([(101.0, 103.0)], None, 109.5, 100, 109) == 0b110  # [101, 102] and [102, 103]
    assert backlogged_mask([(90.0, 100.5)], None, 109.5, 100, 109) == 0  # 99 is before the window, 100 not whole
    assert backlogged_mask([(90.0, 101.5)], None, 109.5, 100, 109) == 0b1  # clipped to the window
    assert backlogged_mask([], 107.2, 109.5, 100, 109) == 0b1 << 8  # still waiting: 108; 109 is not over yet
    assert backlogged_mask([], 108.0, 110.0, 100, 109) == 0b11 << 8  # 109 ends now
    assert backlogged_mask([(80.0, 90.0)], None, 109.5, 100, 109) == 0  # before the window
    # two spans with a gap inside a second do not add up to that second
    assert backlogged_mask([(100.2, 101.5), (101.6, 102.8)], None, 109.5, 100, 109) == 0


def test_expected_shares_follow_weights_among_the_backlogged() -> None:
    everywhere = 0b1111
    # weights 1 and 2, both backlogged throughout: a third and two thirds
    e = expected_shares([(1.0, False, everywhere, 10.0, 10.0), (2.0, False, everywhere, 30.0, 30.0)], [10.0] * 4)
    assert e == pytest.approx([1 / 3, 2 / 3])
    # a third flow never backlogged and never served is promised nothing and changes nothing
    e = expected_shares([(1.0, False, everywhere, 10.0, 10.0), (2.0, False, everywhere, 30.0, 30.0),
                         (5.0, False, 0, 0.0, 0.0)], [10.0] * 4)
    assert e == pytest.approx([1 / 3, 2 / 3, 0.0])
    # B backlogged in the last two seconds only, A throughout, each second 10 served between them
    # (A 10, 10, then 5, 5; B 5, 5): A alone is promised all of the first two
    e = expected_shares([(1.0, False, 0b1111, 30.0, 30.0), (1.0, False, 0b1100, 10.0, 10.0)], [10.0] * 4)
    assert e == pytest.approx([(10 + 10 + 5 + 5) / 40, (5 + 5) / 40])
    # each second weighs by what was served in it
    e = expected_shares([(1.0, False, 0b11, 1.0, 1.0), (1.0, False, 0b10, 1.0, 1.0)], [0.0, 2.0])
    assert e == pytest.approx([0.5, 0.5])
    # one flow alone: everything
    assert expected_shares([(3.0, False, 0b1, 5.0, 5.0)], [5.0]) == pytest.approx([1.0])


def test_a_flow_not_backlogged_is_expected_what_it_got_and_the_backlogged_share_the_rest() -> None:
    # A (weight 1) waits throughout both seconds; B (weight 6) never waits a whole second and is
    # served 2 of each second's 10: B is expected its 20 %, A the other 80 %, and both are fair
    e = expected_shares([(1.0, False, 0b11, 16.0, 16.0), (6.0, False, 0, 4.0, 0.0)], [8.0, 8.0])
    assert e == pytest.approx([0.8, 0.2]) and jain([0.8 / e[0], 0.2 / e[1]]) == pytest.approx(1.0)
    # B backlogged in the second second only: there it is promised 6/7 of what the two got (10)
    e = expected_shares([(1.0, False, 0b11, 14.0, 14.0), (6.0, False, 0b10, 6.0, 4.0)], [8.0, 10.0])
    assert e == pytest.approx([(8 + 10 / 7) / 20, (2 + 60 / 7) / 20])
    assert sum(e) == pytest.approx(1.0)


def test_a_strict_class_is_expected_what_it_got_and_the_weighted_share_the_rest() -> None:
    e = expected_shares([(1.0, True, 0b11, 20.0, 0.0), (1.0, False, 0b11, 40.0, 40.0), (3.0, False, 0b11, 40.0, 40.0)],
                        [40.0, 40.0])
    assert e == pytest.approx([0.2, 0.2, 0.6])
    assert sum(e) == pytest.approx(1.0)


def test_with_nothing_served_the_promise_is_by_time() -> None:
    e = expected_shares([(1.0, False, 0b11, 0.0, 0.0), (1.0, False, 0b10, 0.0, 0.0)], [0.0, 0.0])
    assert e == pytest.approx([0.75, 0.25])
    assert expected_shares([(1.0, False, 0, 0.0, 0.0)], [0.0, 0.0]) == [0.0]


def test_jain() -> None:
    assert jain([]) is None
    assert jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0]) == pytest.approx(0.5)
    assert jain([0.0, 0.0]) == 1.0


def test_wait_quantile_interpolates_within_the_bucket() -> None:
    counts = [0] * 20
    assert wait_quantile(counts, 0.5) is None
    counts[1] = 10  # ten waits in (0.001, 0.005]
    assert wait_quantile(counts, 0.5) == pytest.approx(0.003)
    assert wait_quantile(counts, 1.0) == pytest.approx(0.005)
    counts[-1] = 1  # one over the largest bound
    assert wait_quantile(counts, 0.99) == 7200.0


# ------------------------------------------------------------------ the window in PolicyMetrics
def _policy(n_orgs: int = 3) -> Any:
    return parse_policy(_yaml(n_orgs))


def _serve(m: PolicyMetrics, clock: Clock, org: str, cost: float, seconds: float = 1.0) -> None:
    """One request of ``org``: queued, started, served ``cost`` after ``seconds``."""
    k = (org, "batch", "main")
    m.queued(k)
    m.started(k, 0.01, cost, False)
    clock.t += seconds
    m.attempt_ended(k, served_cost=cost)
    m.ended(k, "completed")


def test_shares_and_expectations_over_the_window() -> None:
    clock = Clock()
    m = PolicyMetrics(clock=clock, window_seconds=10)
    m.policy = _policy()
    a, b = ("o0", "batch", "main"), ("o1", "batch", "main")  # weights 1 and 2
    m.queued(a, 5)
    m.queued(b, 5)
    for _ in range(4):  # both backlogged: b is served twice what a is
        for k, cost in ((a, 10.0), (b, 20.0)):
            m.started(k, 0.5, cost, False)
            m.attempt_ended(k, served_cost=cost)
        clock.t += 1.0
    st = m.stats()["pools"]["main"]
    assert set(st["orgs"]) == {"o0", "o1"}
    assert st["orgs"]["o0"]["share"] == pytest.approx(1 / 3) and st["orgs"]["o1"]["share"] == pytest.approx(2 / 3)
    assert st["orgs"]["o0"]["expected_share"] == pytest.approx(1 / 3)
    assert st["jain"] == pytest.approx(1.0)
    assert st["orgs"]["o1"]["waiting"] == 1 and st["orgs"]["o1"]["wait_p50"] == pytest.approx(0.5, abs=0.25)
    # 20 s later nothing is in the window: no share, but the totals stay
    for k in (a, b):
        m.left_queue(k)
    clock.t += 20.0
    st = m.stats()["pools"]["main"]
    assert st["served_cost"] == 0.0 and st["jain"] is None
    assert st["orgs"]["o0"]["expected_share"] == 0.0 and st["orgs"]["o0"]["wait_p50"] is None


def _second(m: PolicyMetrics, clock: Clock, start: float, events: list[tuple[float, str, Any, float]]) -> None:
    """Play ``events`` ``(offset in the second, what, flow, value)`` from ``start``, in order."""
    for at, what, k, v in events:
        clock.t = start + at
        if what == "queued":
            m.queued(k, int(v))
        elif what == "started":
            m.started(k, v, 1.0, False)
        else:
            m.attempt_ended(k, served_cost=v)
            m.ended(k, "completed")


def test_an_org_that_waits_only_a_moment_is_expected_what_it_got() -> None:
    """o1 (weight 2) sends one request a second, which waits 50 ms for a slot and runs 0.75 s;
    o0 (weight 1) has requests waiting all the time. o1 is never kept waiting a whole second:
    it asks for less than its weight's share and gets all it asks, so it is expected what it got
    and Jain's index is 1 (counting a second in which it had a request waiting or running at any
    moment as backlogged, it would be expected 2/3 and the index would be 0.66)."""
    clock = Clock()
    m = PolicyMetrics(clock=clock, window_seconds=10)
    m.policy = _policy()
    a, b = ("o0", "batch", "main"), ("o1", "batch", "main")
    m.queued(a, 100)
    for s in range(10):
        _second(m, clock, 1000.0 + s, [(0.1, "queued", b, 1), (0.15, "started", b, 0.05), (0.2, "started", a, 0.2),
                                       (0.8, "ended", a, 30.0), (0.9, "ended", b, 10.0)])
    clock.t = 1010.0
    st = m.stats()["pools"]["main"]
    o0, o1 = st["orgs"]["o0"], st["orgs"]["o1"]
    assert o1["share"] == pytest.approx(0.25) and o1["expected_share"] == pytest.approx(0.25)
    assert o0["share"] == pytest.approx(0.75) and o0["expected_share"] == pytest.approx(0.75)
    assert st["jain"] == pytest.approx(1.0)
    # the same, every request of o1 already running (it never waits at all): the same figures
    m2 = PolicyMetrics(clock=clock, window_seconds=10)
    m2.policy = _policy()
    m2.queued(a, 100)
    for s in range(10):
        clock.t = 1100.0 + s + 0.1
        m2.began(b, 1.0)
        _second(m2, clock, 1100.0 + s, [(0.2, "started", a, 0.2), (0.8, "ended", a, 30.0), (0.9, "ended", b, 10.0)])
    clock.t = 1110.0
    st = m2.stats()["pools"]["main"]
    assert st["orgs"]["o1"]["expected_share"] == pytest.approx(0.25) and st["jain"] == pytest.approx(1.0)


def test_an_org_kept_waiting_whole_seconds_is_expected_its_weights_share() -> None:
    """o1 (weight 2) has a request waiting from 1000.0 to 1003.0 while only o0 (weight 1) is
    served, 30 a second: in those three seconds o1 is promised 2/3 of the service, and Jain's
    index says it was not served so. In the second after, o1 is not backlogged any more."""
    clock = Clock()
    m = PolicyMetrics(clock=clock, window_seconds=10)
    m.policy = _policy()
    a, b = ("o0", "batch", "main"), ("o1", "batch", "main")
    m.queued(a, 100)
    m.queued(b)
    for s in range(3):
        _second(m, clock, 1000.0 + s, [(0.2, "started", a, 0.2), (0.8, "ended", a, 30.0)])
    _second(m, clock, 1003.0, [(0.0, "started", b, 3.0), (0.2, "started", a, 0.2), (0.5, "ended", b, 10.0),
                               (0.8, "ended", a, 30.0)])
    clock.t = 1004.0
    st = m.stats()["pools"]["main"]
    total = 130.0
    o1 = st["orgs"]["o1"]
    assert o1["share"] == pytest.approx(10 / total)
    assert o1["expected_share"] == pytest.approx((2 / 3 * 90 + 10) / total)  # its weight's share while it waited
    assert st["orgs"]["o0"]["expected_share"] == pytest.approx((1 / 3 * 90 + 30) / total)
    assert st["jain"] == pytest.approx(jain([(120 / total) / (60 / total), (10 / total) / (70 / total)]))
    assert st["jain"] < 0.6


#: a class row's time-to-first-token figures when the gateway counted none of its requests
NO_TTFT = {"attainment": None, "attainment_requests": 0, "ttft_p50": None, "ttft_p99": None}


def test_deadline_misses_per_class_in_stats_and_series() -> None:
    """``sfq_deadline_missed_total`` and ``/stats``' classes: a request whose deadline or queue
    age ran out counts once, refused in the queue or failed after it started; a refusal for
    another reason does not. Each class shows its weight (a strict one none), and each org its
    classes."""
    clock = Clock()
    m = PolicyMetrics(clock=clock)
    m.policy = parse_policy("""\
pools:
  main: {models: [m], backends: [{url: "http://127.0.0.1:1"}]}
classes:
  system: {strict: true, max_in_flight: 1, max_queue_length: 4}
  interactive: {weight: 6}
  batch: {weight: 1, max_queue_age_seconds: 5}
orgs:
  product: {keys: [kp], classes: [interactive, system]}
  analytics: {keys: [ka], classes: [batch, interactive]}
""")
    batch, inter, system = ("analytics", "batch", "main"), ("product", "interactive", "main"), \
        ("product", "system", "main")
    for reason in ("queue_timeout", "deadline"):  # ran out in the queue
        m.queued(batch)
        m.left_queue(batch)
        m.timeout(batch)
        m.ended(batch, "refused", reason)
    m.queued(inter)
    m.started(inter, 0.1, 1.0, False)
    m.attempt_ended(inter, timeout=True)
    m.ended(inter, "failed", "deadline")  # ran out while running
    m.ended(batch, "refused", "rate_limited")  # not a miss
    m.began(system, 1.0)
    m.attempt_ended(system, served_cost=1.0)
    m.ended(system, "completed")
    st = m.stats()["pools"]["main"]
    assert st["classes"] == {
        "batch": {"weight": 1.0, "strict": False, "waiting": 0, "in_flight": 0, "deadline_missed": 2,
                  "deadline_seconds": None, "ttft_objective_seconds": None, **NO_TTFT,
                  "requests": {"completed": 0, "failed": 0, "cancelled_before_start": 0,
                               "cancelled_during_execution": 0, "refused": 3, "joined": 0}},
        "interactive": {"weight": 6.0, "strict": False, "waiting": 0, "in_flight": 0, "deadline_missed": 1,
                        "deadline_seconds": None, "ttft_objective_seconds": None, **NO_TTFT,
                        "requests": {"completed": 0, "failed": 1, "cancelled_before_start": 0,
                                     "cancelled_during_execution": 0, "refused": 0, "joined": 0}},
        "system": {"weight": None, "strict": True, "waiting": 0, "in_flight": 0, "deadline_missed": 0,
                   "deadline_seconds": None, "ttft_objective_seconds": None, **NO_TTFT,
                   "requests": {"completed": 1, "failed": 0, "cancelled_before_start": 0,
                                "cancelled_during_execution": 0, "refused": 0, "joined": 0}}}
    assert st["orgs"]["product"]["classes"] == ["interactive", "system"]
    assert st["orgs"]["analytics"]["classes"] == ["batch"]
    missed = {tuple(sorted(dict(k[1]).items())): v for k, v in _samples(m).items()
              if k[0] == "sfq_deadline_missed_total"}
    assert missed == {(("class", "batch"), ("org", "analytics"), ("pool", "main")): 2.0,
                      (("class", "interactive"), ("org", "product"), ("pool", "main")): 1.0}
    assert m.snapshot()[batch]["deadline_missed"] == 2


def test_objective_attainment_counts_answers_within_the_objective_and_deadline_misses_over_the_window() -> None:
    """``first_token``: per class and pool, the part of the requests counted in the window whose
    first token came within the class's ``ttft_objective_seconds``, a request that ended for its
    deadline without an answer (``None``) a miss; p50/p99 over the answered ones; a class without
    an objective has none (not 100 %); ``sfq_time_to_first_token_seconds`` has a bucket at the
    objective, and ``sfq_objective_attainment`` is the window's figure."""
    clock = Clock()
    m = PolicyMetrics(clock=clock, window_seconds=10)
    m.policy = parse_policy("""\
pools:
  main: {models: [m], backends: [{url: "http://127.0.0.1:1"}]}
classes:
  interactive: {weight: 6, ttft_objective_seconds: 0.3}
  batch: {weight: 1}
orgs:
  product: {keys: [kp], classes: [interactive]}
  analytics: {keys: [ka], classes: [batch]}
""")
    inter, batch = ("product", "interactive", "main"), ("analytics", "batch", "main")
    for t in (0.1, 0.2, 0.3, 0.5):  # 0.3 is within (<=), 0.5 is not
        m.first_token(inter, t)
    m.first_token(inter, None)  # dropped for its deadline: a miss
    for t in (0.1, 5.0):
        m.first_token(batch, t)
    m.ended(inter, "completed")
    m.ended(batch, "completed")
    classes = m.stats()["pools"]["main"]["classes"]
    c = classes["interactive"]
    assert c["ttft_objective_seconds"] == 0.3
    assert c["attainment"] == pytest.approx(3 / 5) and c["attainment_requests"] == 5
    assert 0.1 <= c["ttft_p50"] <= 0.3 and 0.3 < c["ttft_p99"] <= 0.5  # (interpolated in buckets, as wait_p50)
    b = classes["batch"]
    assert b["ttft_objective_seconds"] is None and b["attainment"] is None  # no objective: none, not 100 %
    assert b["attainment_requests"] == 2 and b["ttft_p99"] is not None
    samples = _samples(m)
    lab = (("class", "interactive"), ("pool", "main"))
    assert samples["sfq_time_to_first_token_seconds_bucket", (*lab[:1], ("le", "0.3"), *lab[1:])] == 3.0
    assert samples["sfq_time_to_first_token_seconds_count", lab] == 4.0  # answered ones (the miss had no token)
    assert samples["sfq_time_to_first_token_seconds_sum", lab] == pytest.approx(1.1)
    assert samples["sfq_objective_attainment", lab] == pytest.approx(0.6)
    assert ("sfq_objective_attainment", (("class", "batch"), ("pool", "main"))) not in samples
    assert not any(k[0] == "sfq_time_to_first_token_seconds_bucket" and ("le", "0.3") in k[1]
                   and ("class", "batch") in k[1] for k in samples)  # the default buckets there
    # the window slides: 11 s later nothing is counted; the histogram keeps counting since the start
    clock.t += 11
    m.first_token(inter, 0.2)
    c = m.stats()["pools"]["main"]["classes"]["interactive"]
    assert c["attainment"] == 1.0 and c["attainment_requests"] == 1
    assert m.stats()["pools"]["main"]["classes"]["batch"]["attainment_requests"] == 0
    assert _samples(m)["sfq_time_to_first_token_seconds_count", lab] == 5.0
    # only misses in the window: attainment 0, no quantile
    clock.t += 11
    m.first_token(inter, None)
    c = m.stats()["pools"]["main"]["classes"]["interactive"]
    assert (c["attainment"], c["attainment_requests"], c["ttft_p50"], c["ttft_p99"]) == (0.0, 1, None, None)


def test_window_seconds_and_max_org_series_are_checked() -> None:
    with pytest.raises(ValueError, match="window_seconds .* got 0.5"):
        PolicyMetrics(window_seconds=0.5)
    with pytest.raises(ValueError, match="max_org_series .* got 0"):
        PolicyMetrics(max_org_series=0)
    m = PolicyMetrics()
    with pytest.raises(ValueError, match="got True"):
        m.configure(True, 5)  # type: ignore[arg-type]
    assert (m.window, m.max_org_series) == (60.0, 1000)  # unchanged


# ------------------------------------------------------------------ bounded series
def _samples(m: PolicyMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in fam.samples}


def _orgs(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in samples.items():
        if n == name:
            org = dict(labels)["org"]
            out[org] = out.get(org, 0.0) + v
    return out


def test_orgs_that_sent_nothing_have_no_series() -> None:
    m = PolicyMetrics(clock=Clock())
    m.policy = _policy(10_000)
    text = generate_latest(m.registry).decode()
    assert 'org="' not in text
    assert m.stats()["pools"]["main"]["orgs"] == {}


def test_at_most_n_org_labels_the_rest_summed_totals_exact_and_stable() -> None:
    clock = Clock()
    m = PolicyMetrics(clock=clock, window_seconds=10, max_org_series=3)
    m.policy = _policy(8)
    for i in range(8):  # o0 served most, o7 least
        for _ in range(8 - i):
            _serve(m, clock, f"o{i}", 10.0, 0.1)
    first = _samples(m)
    completed = _orgs({k: v for k, v in first.items() if ("outcome", "completed") in k[1]}, "sfq_requests_total")
    assert set(completed) == {"o0", "o1", "o2", OTHER_ORG}  # the best served three, and the rest summed
    assert sum(completed.values()) == sum(8 - i for i in range(8))  # exact
    assert completed[OTHER_ORG] == sum(8 - i for i in range(3, 8))
    assert _orgs(first, "sfq_served_cost_total")[OTHER_ORG] == 10.0 * sum(8 - i for i in range(3, 8))
    share = _orgs(first, "sfq_share")
    assert set(share) == {"o0", "o1", "o2", OTHER_ORG} and sum(share.values()) == pytest.approx(1.0)
    assert set(_orgs(first, "sfq_queue_length")) == {"o0", "o1", "o2", OTHER_ORG}
    assert set(_orgs(first, "sfq_org_weight")) == {"o0", "o1", "o2"}
    assert not any(("org", "o0") in k[1] for k in first if k[0].startswith("sfq_queue_wait_seconds"))
    st = m.stats()["pools"]["main"]["orgs"]
    assert set(st) == {"o0", "o1", "o2", OTHER_ORG} and st[OTHER_ORG]["weight"] is None
    assert st[OTHER_ORG]["requests"]["completed"] == completed[OTHER_ORG]
    # a second scrape at once, o7 now served the most: nothing moves (no flapping)
    for _ in range(30):
        _serve(m, clock, "o7", 10.0, 0.01)
    second = _samples(m)
    assert {o for o in _orgs(second, "sfq_requests_total")} == {"o0", "o1", "o2", OTHER_ORG}
    assert sum(_orgs(second, "sfq_attempts_total").values()) == sum(8 - i for i in range(8)) + 30
    _monotonic(first, second)


def test_an_org_that_changes_label_keeps_every_counter_monotonic() -> None:
    """Once per window the choice is made again: o9, now served far more than o2, takes its
    place. o2's series stops where it was; its later requests count under _other; every event is
    counted in exactly one series, and no series ever goes down."""
    clock = Clock()
    m = PolicyMetrics(clock=clock, window_seconds=10, max_org_series=3)
    m.policy = _policy(10)
    for org in ("o0", "o1", "o2", "o9"):
        _serve(m, clock, org, 10.0, 0.1)
    first = _samples(m)
    assert set(_orgs(first, "sfq_attempts_total")) == {"o0", "o1", "o2", OTHER_ORG}
    clock.t += 11.0  # past the window: the next read chooses again
    for org, n in (("o0", 5), ("o1", 5), ("o2", 1), ("o9", 20)):
        for _ in range(n):
            _serve(m, clock, org, 10.0, 0.01)
    second = _samples(m)
    attempts = _orgs(second, "sfq_attempts_total")
    assert set(attempts) == {"o0", "o1", "o2", "o9", OTHER_ORG}  # o9 in, o2 out: its counters show a last time
    assert attempts["o2"] == 2 and "o2" not in _orgs(second, "sfq_queue_length")
    assert attempts["o9"] == 0  # it counted under _other until now: that stays there
    assert attempts[OTHER_ORG] == 1 + 20
    assert _orgs(second, "sfq_requests_total")[OTHER_ORG] == 21  # completed, under _other
    _serve(m, clock, "o2", 10.0, 0.01)
    _serve(m, clock, "o9", 10.0, 0.01)
    third = _samples(m)
    _monotonic(second, third)
    attempts = _orgs(third, "sfq_attempts_total")
    assert "o2" not in attempts  # its series ended
    assert attempts["o9"] == 1 and attempts[OTHER_ORG] == 22  # o2's new request under _other
    # every event in exactly one series: the increases add up to what happened
    assert sum(attempts.values()) + 2 - sum(_orgs(second, "sfq_attempts_total").values()) == 2  # (o2's 2 ended)
    # o2 back on its own label later: its series goes on from where it stopped
    clock.t += 11.0
    for _ in range(50):
        _serve(m, clock, "o2", 10.0, 0.01)
    fourth = _samples(m)
    assert _orgs(fourth, "sfq_attempts_total")["o2"] == 2  # where it stopped (its 51 since: under _other)
    _monotonic(third, {k: v for k, v in fourth.items() if dict(k[1]).get("org") != "o2"})


def _template_policy() -> Any:
    return parse_policy(_yaml(2) + "org_template: {classes: [batch]}\n")


def test_idle_orgs_of_the_template_are_forgotten_and_other_stays_monotonic() -> None:
    """Orgs made from the template (names an embedder made up) are forgotten once idle past
    the window (and a minute): an org under ``_other`` leaves its counts there (``_other``
    never goes down); a labelled one's series end, as a demoted org's do (nothing is counted
    twice: ``increase()`` over every label stays exact); the orgs the file names, a flow with
    work live and a flow idle for less are kept; a forgotten org that comes back is a new one."""
    clock = Clock()
    m = PolicyMetrics(clock=clock, window_seconds=10, max_org_series=3)
    m.policy = _template_policy()
    for org, n in (("o0", 5), ("t-big", 4), ("t-mid", 3), ("t-a", 1), ("t-b", 1), ("t-c", 1)):
        for _ in range(n):
            _serve(m, clock, org, 10.0, 0.1)
    live = ("t-live", "batch", "main")
    m.queued(live)
    m.ended(("t-refused", "batch", "main"), "refused", "rate_limited")  # refused, never queued
    first = _samples(m)
    completed = _orgs({k: v for k, v in first.items() if ("outcome", "completed") in k[1]}, "sfq_requests_total")
    assert set(completed) == {"o0", "t-big", "t-mid", OTHER_ORG} and completed[OTHER_ORG] == 3
    assert m.forget_idle() == 0  # idle, but not for long enough
    clock.t += 59.0
    _serve(m, clock, "t-a", 10.0, 0.1)  # t-a active again: kept
    clock.t += 2.0  # the others: idle for more than a minute (the window is 10 s)
    assert m.forget_idle() == 5  # t-big, t-mid (labelled), t-b, t-c (under _other), t-refused
    assert sorted(k[0] for k in m.flows) == ["o0", "t-a", "t-live"]
    second = _samples(m)
    completed = _orgs({k: v for k, v in second.items() if ("outcome", "completed") in k[1]}, "sfq_requests_total")
    assert "t-big" not in completed and "t-mid" not in completed  # their series ended (as a demoted org's)
    assert completed[OTHER_ORG] + completed.get("t-a", 0) == 4  # t-a's 2 and what t-b and t-c left under _other
    assert sum(completed.values()) == 5 + 4 + 3 + 4 - (4 + 3)  # every request, but those of the ended series
    _monotonic(first, {k: v for k, v in second.items() if dict(k[1]).get("org") not in ("t-big", "t-mid")})
    refused = _orgs({k: v for k, v in second.items() if ("outcome", "refused") in k[1]}, "sfq_requests_total")
    assert refused[OTHER_ORG] == 1  # t-refused's refusal stays counted
    assert m.policy.org("t-big") is not None and "t-big" not in m._assigned  # (its place was given back)
    # t-big comes back: a new org (the places it left went to t-a and t-live), its request counted once
    _serve(m, clock, "t-big", 10.0, 0.1)
    third = _samples(m)
    assert set(_orgs(third, "sfq_attempts_total")) == {"o0", "t-a", OTHER_ORG}
    assert sum(_orgs(third, "sfq_attempts_total").values()) == sum(_orgs(second, "sfq_attempts_total").values()) + 1
    _monotonic(second, third)
    # the orgs the file names are never forgotten; nor is a flow with work waiting
    clock.t += 3600.0
    m.left_queue(live)
    assert m.forget_idle() == 2 and sorted(k[0] for k in m.flows) == ["o0", "t-live"]  # (t-live just went idle)
    clock.t += 3600.0
    assert m.forget_idle() == 1 and [k[0] for k in m.flows] == ["o0"]
    fourth = _samples(m)
    assert set(_orgs(fourth, "sfq_attempts_total")) == {"o0", OTHER_ORG}
    _monotonic(third, {k: v for k, v in fourth.items() if dict(k[1]).get("org") not in ("t-a", "t-live")})


def _monotonic(before: dict[tuple[str, tuple[tuple[str, str], ...]], float],
               after: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> None:
    """No counter present in both readings went down."""
    for key, v in before.items():
        if key[0].endswith("_total") and key in after:
            assert after[key] >= v - 1e-9, (key, v, after[key])


def test_the_metrics_section_is_validated_naming_the_field() -> None:
    from sfq.errors import PolicyError

    base = """\
pools:
  main: {models: [m], backends: [{url: "http://127.0.0.1:1"}]}
classes:
  batch: {weight: 1}
orgs:
  o: {keys: [k], classes: [batch]}
"""
    p = parse_policy(base + "metrics: {window_seconds: 30, max_org_series: 50}\n")
    assert (p.metrics.window_seconds, p.metrics.max_org_series) == (30.0, 50)
    assert (parse_policy(base).metrics.window_seconds, parse_policy(base).metrics.max_org_series) == (60.0, 1000)
    for bad, message in (("{window_seconds: 0}", "metrics.window_seconds: must be a number >= 1, got 0"),
                         ("{window_seconds: .nan}", "metrics.window_seconds: must be a number >= 1, got nan"),
                         ("{max_org_series: 0}", "metrics.max_org_series: must be an integer >= 1, got 0"),
                         ("{max_org_series: 2.5}", "metrics.max_org_series: must be an integer >= 1, got 2.5"),
                         ("{windows: 5}", "metrics.windows: unknown key"),
                         ("[60]", "metrics: must be a mapping")):
        with pytest.raises(PolicyError) as e:
            parse_policy(base + f"metrics: {bad}\n")
        assert message in str(e.value), (bad, str(e.value))


def test_the_engine_gives_its_clock_policy_and_queues_to_the_metrics_and_a_reload_resets_the_settings() -> None:
    """Through the engine (both cores): no series before a request; the oldest waiting request's
    age from the engine's own queues; a reload puts the new file's settings in force and the
    counts go on."""
    from sfq.engine import PolicyEngine

    clock = Clock()
    p = _policy(3)
    eng = PolicyEngine(p, clock=clock)
    m = eng.metrics
    assert isinstance(m, PolicyMetrics) and m.flows == {} and m.policy is p
    eng.submit(eng.classify("k0", None, "m"), cost=5.0)
    clock.t += 2.5
    st = m.stats()["pools"]["main"]["orgs"]["o0"]
    assert st["waiting"] == 1 and st["oldest_wait_seconds"] == pytest.approx(2.5)
    json.dumps(m.stats(), allow_nan=False)  # plain JSON, both views
    json.dumps(eng.stats(), allow_nan=False)
    new = parse_policy(_yaml(3) + "metrics: {window_seconds: 5}\n")
    eng2, ended = eng.reloaded(new)
    assert ended == [] and eng2.metrics is m and m.window == 5.0 and m.policy is new
    assert m.stats()["pools"]["main"]["orgs"]["o0"]["oldest_wait_seconds"] == pytest.approx(2.5)


def _yaml(n_orgs: int) -> str:
    orgs = "\n".join(f"  o{i}: {{keys: [k{i}], classes: [batch], weight: {1 + (i == 1)}}}" for i in range(n_orgs))
    return f"""\
pools:
  main: {{models: [m], backends: [{{url: "http://127.0.0.1:1"}}]}}
classes:
  batch: {{weight: 1}}
orgs:
{orgs}
"""


def test_the_window_trims_only_what_left_it_and_stays_bounded() -> None:
    """Random arrivals, starts, ends and clock steps against a log of every event that is
    never trimmed: the window's figures (each org's served cost, each flow's backlogged
    seconds (a request waiting throughout), its waits) match the log's over the last
    ``window_seconds`` at every step, and a flow keeps at most a window's worth of records and
    spans."""
    rnd = random.Random(31)
    clock = Clock()
    w = 5
    m = PolicyMetrics(clock=clock, window_seconds=w)
    m.policy = _policy()
    keys = [("o0", "batch", "main"), ("o1", "batch", "main"), ("o2", "batch", "main")]
    served: dict[Any, list[tuple[int, float]]] = {k: [] for k in keys}  # (second, cost)
    waits: dict[Any, list[tuple[int, float]]] = {k: [] for k in keys}  # (second, wait)
    spans: dict[Any, list[list[float]]] = {k: [] for k in keys}  # every span of waiting, closed
    since: dict[Any, float | None] = dict.fromkeys(keys)
    waiting = dict.fromkeys(keys, 0)
    running = dict.fromkeys(keys, 0)

    def idle(k: Any) -> None:
        if waiting[k] == 0 and since[k] is not None:
            spans[k].append([since[k], clock.t])
            since[k] = None

    for _ in range(3000):
        k = rnd.choice(keys)
        op = rnd.random()
        if op < 0.3:
            m.queued(k)
            waiting[k] += 1
            since[k] = clock.t if since[k] is None else since[k]
        elif op < 0.55 and waiting[k]:
            wait = rnd.choice((0.001, 0.02, 0.3, 4.0))
            m.started(k, wait, 1.0, False)
            waiting[k] -= 1
            running[k] += 1
            waits[k].append((int(clock.t), wait))
            idle(k)
        elif op < 0.8 and running[k]:
            cost = float(rnd.randint(1, 50))
            m.attempt_ended(k, served_cost=cost)
            running[k] -= 1
            served[k].append((int(clock.t), cost))
        elif op < 0.85 and waiting[k]:
            m.left_queue(k)
            waiting[k] -= 1
            idle(k)
        else:
            clock.t += rnd.choice((0.0, 0.2, 0.7, 1.0, 3.5, 9.0))
        top = int(clock.t)
        lo = top - w + 1
        st = m.stats()["pools"]["main"]["orgs"]
        for k in keys:
            org = k[0]
            want = sum(c for s, c in served[k] if lo <= s <= top)
            if org in st:
                assert st[org]["served_cost"] == pytest.approx(want)
            else:
                assert want == 0
            fc = m.flows.get(k)
            if fc is None:
                continue
            assert (backlogged_mask(fc.spans, fc.since, clock.t, lo, top)
                    == backlogged_mask(spans[k], since[k], clock.t, lo, top))
            in_window = [x for s, x in waits[k] if lo <= s <= top]
            got = [0] * (len(WAIT_BUCKETS) + 1)
            for sec, _, wc in fc.recent:
                if wc is not None and lo <= sec <= top:
                    got = [a + b for a, b in zip(got, wc)]
            assert sum(got) == len(in_window)
            assert got == [sum(1 for x in in_window if bisect_left(WAIT_BUCKETS, x) == i) for i in range(len(got))]
            assert len(fc.recent) <= w and len(fc.spans) <= w + 2
