"""Deadlines inside fair shares (docs/design.md §5d, docs/policy.md "Deadlines and service
levels"): EDF inside a flow, SFQ between flows unchanged, never a start after a deadline, a
class's default deadline and objective, and the early refusal of a deadline that cannot be met.
Random programs on an injected clock, on both twins of the core."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_helpers import Clock, policy

import sfq
from sfq.engine import PolicyEngine, Request
from sfq.errors import PolicyError, Refused
from sfq.policy import Flow, parse_policy

TWINS = [sfq.ReferenceScheduler] + ([sfq.Scheduler] if sfq.CORE == "compiled" else [])
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                            HealthCheck.too_slow])

# three flows in one pool: org b weighs 2; small_cost null: a flow's requests without a deadline go FIFO
DEADLINE_POLICY = """
pools:
  p:
    models: [m]
    backends: [{url: "http://127.0.0.1:9", max_in_flight: 2}]
classes:
  batch: {weight: 1, small_cost: null}
  interactive: {weight: 3, small_cost: null, max_queue_age_seconds: 30}
orgs:
  a: {keys: [ka], classes: [batch, interactive]}
  b: {keys: [kb], classes: [batch], weight: 2}
"""
FLOWS = [Flow("a", "batch", "p"), Flow("a", "interactive", "p"), Flow("b", "batch", "p")]
#: the same, and the interactive class refuses deadlines it cannot meet
REFUSING = DEADLINE_POLICY.replace("max_queue_age_seconds: 30}", "max_queue_age_seconds: 30, refuse_unmeetable: true}")

# an op: ("submit", flow index, cost, deadline in seconds from now or None) | ("poll",) |
# ("complete", which running) | ("tick", seconds)
Op = tuple[Any, ...]


def ops(*, ticks: bool, cost: Any = None, busy: bool = False) -> st.SearchStrategy[list[Op]]:
    """Random programs; ``busy``: mostly submissions, with deadlines, so that flows back up."""
    if busy:  # mostly the interactive flow, with near deadlines
        submit = st.tuples(st.just("submit"), st.sampled_from([1, 1, 1, 0, 2]), st.sampled_from([3, 10, 40]),
                           st.floats(0.5, 15.0))
    else:
        submit = st.tuples(st.just("submit"), st.integers(0, len(FLOWS) - 1),
                           cost if cost is not None else st.sampled_from([1, 3, 10, 40]),
                           st.one_of(st.none(), st.floats(0.5, 60.0)))
    rest: list[st.SearchStrategy[Op]] = [st.tuples(st.just("poll")), st.tuples(st.just("complete"), st.integers(0, 3))]
    if ticks:
        rest.append(st.tuples(st.just("tick"), st.sampled_from([0.25, 1.0, 5.0, 20.0])))
    return st.lists(st.one_of(*[submit] * (10 if busy else 1), *rest), min_size=20 if busy else 0, max_size=80)


class Run:
    """One program through one engine: every start and drop, in order, with what the tests need."""

    def __init__(self, make: Any, text: str = DEADLINE_POLICY, *, costs: dict[int, float] | None = None) -> None:
        self.clock = Clock(0.0)
        self.e = PolicyEngine(parse_policy(text), clock=self.clock, scheduler=make)
        self.q = self.e.queues["p"]
        self.costs = costs
        self.reqs: list[Request] = []  # accepted, in submission order
        self.index: dict[int, int] = {}  # request id -> its submission number
        self.running: list[Request] = []
        self.trace: list[tuple[Any, ...]] = []  # what both twins must decide alike
        self.refused: list[Refused] = []

    def submit(self, i: int, cost: float, dl: float | None) -> None:
        f = FLOWS[i]
        c = self.costs[i] if self.costs is not None else cost
        before = (len(self.e.live), self.q.n_waiting, self.q.meter(f), self.q.sched.virtual_time)
        try:
            r = self.e.submit(f, cost=c, deadline=None if dl is None else self.clock.t + dl)
        except Refused as exc:
            assert exc.reason == "deadline_unmeetable" and f.cls == "interactive" and dl is not None
            assert exc.retry_after is not None and exc.retry_after > 0 and exc.http_status == 429
            assert (len(self.e.live), self.q.n_waiting, self.q.meter(f), self.q.sched.virtual_time) == before
            self.refused.append(exc)
            self.trace.append(("refused", i, exc.reason, exc.retry_after))
            return
        self.index[r.id] = len(self.reqs)
        self.reqs.append(r)

    def poll(self) -> list[Request]:
        """One start at a time (``next_start``), each checked against the flow's waiting set."""
        out = []
        while True:
            before = self.waiting()
            r = self.e.next_start()
            for d in self.e.dropped:
                self.trace.append(("dropped", self.index[d.id], d.reason))
                assert d.reason in ("deadline", "queue_timeout") and self.clock.t >= d.drop_at
            self.e.dropped = []
            if r is None:
                return out
            self.check_edf(r, before)
            assert r.started_at is not None and r.started_at < r.drop_at  # never started after its deadline
            assert r.deadline is None or r.started_at < r.deadline
            self.running.append(r)
            out.append(r)
            self.trace.append(("start", self.index[r.id], r.backend, self.q.meter(r.flow),
                               float(self.q.sched.virtual_time), r.start_tag))

    def waiting(self) -> dict[Flow, list[Request]]:
        by: dict[Flow, list[Request]] = defaultdict(list)
        for r in self.reqs:
            if r.state == "waiting":
                by[r.flow].append(r)
        return by

    def check_edf(self, r: Request, before: dict[Flow, list[Request]]) -> None:
        """(c): the request started is, among its flow's requests still in time, the nearest
        deadline (ties: the first queued), or with none, the first queued (FIFO, small_cost null)."""
        live = [x for x in before[r.flow] if x.drop_at > self.clock.t]
        assert r in live
        with_dl = [x for x in live if x.deadline is not None]
        want = (min(with_dl, key=lambda x: (x.drop_at, self.index[x.id])) if with_dl
                else min(live, key=lambda x: self.index[x.id]))
        assert r is want, (r, want)

    def complete(self, k: int) -> None:
        if self.running:
            self.e.complete(self.running.pop(k % len(self.running)))

    def play(self, program: list[Op]) -> Run:
        for op in program:
            if op[0] == "submit":
                self.submit(op[1], op[2], op[3])
            elif op[0] == "poll":
                self.poll()
            elif op[0] == "complete":
                self.complete(op[1])
            else:
                self.clock.t += op[1]
        return self

    def drain(self) -> None:
        """Everything left ends: every accepted request ends exactly once."""
        while True:
            self.poll()
            if not self.running:
                if not self.e.has_waiting():
                    break
                self.clock.t += 100.0
                continue
            self.complete(0)
        assert not self.e.live
        assert all(r.outcome is not None for r in self.reqs)


# ------------------------------------------------------------------ (b), (c) and the twins
#: 8 attempts of 1 s (a measured pool), then both slots taken: requests back up, refusals happen
WARM_UP: list[Op] = [op for _ in range(8) for op in (("submit", 0, 1, None), ("poll",), ("tick", 1.0), ("complete", 0))]
WARM_UP += [("submit", 2, 1, None), ("submit", 2, 1, None), ("poll",)]


@pytest.mark.parametrize("text", [DEADLINE_POLICY, REFUSING], ids=["plain", "refusing"])
@SETTINGS
@given(program=ops(ticks=True), busy=ops(ticks=True, busy=True))
def test_edf_inside_a_flow_never_late_and_the_twins_agree(text: str, program: list[Op], busy: list[Op]) -> None:
    """(b) a request is never started at or after its deadline (or queue age): it is dropped with
    its reason; (c) inside its flow the nearest deadline goes first, ties in queue order, the
    requests without one after, FIFO; every accepted request ends once; a refusal
    (``deadline_unmeetable``, where the class asks for it) leaves nothing behind; both twins
    decide every start, drop, refusal and meter alike."""
    if text is REFUSING:  # a measured pool first (8 attempts of 1 s), flows that back up: refusals
        program = [*WARM_UP, *busy, *program]
    traces = []
    for make in TWINS:
        run = Run(make, text).play(program)
        run.drain()
        traces.append(run.trace)
    assert all(t == traces[0] for t in traces)


# ------------------------------------------------------------------ (a) the flows' shares
def _flow_seq(run: Run) -> list[tuple[Any, ...]]:
    """Per start: the flow, its meter after the charge and v (not which request of the flow)."""
    return [(run.reqs[t[1]].flow, t[3], t[4]) for t in run.trace if t[0] == "start"]


@SETTINGS
@given(program=ops(ticks=False), costs=st.tuples(*[st.sampled_from([1, 3, 10, 40])] * len(FLOWS)))
def test_equal_costs_in_a_flow_the_order_inside_changes_no_flow_decision(program: list[Op],
                                                                         costs: tuple[float, ...]) -> None:
    """(a), equal costs: every request of a flow costs the same. Then whatever the order inside
    each flow (deadlines drawn at random give random orders; none at all gives FIFO), the flows
    chosen, each meter after each charge and v are the same, start by start, on both twins. (No
    clock moves here, so nothing runs out of time: which requests exist is the same.)"""
    cost = dict(enumerate(costs))
    fifo = [op if op[0] != "submit" else (*op[:3], None) for op in program]
    for make in TWINS:
        edf_run, fifo_run = Run(make, costs=cost).play(program), Run(make, costs=cost).play(fifo)
        assert _flow_seq(edf_run) == _flow_seq(fifo_run)


SCALE = 2**20
BIG_POOL = DEADLINE_POLICY.replace("max_in_flight: 2", "max_in_flight: 100000")


@SETTINGS
@given(jobs=st.lists(st.tuples(st.integers(0, len(FLOWS) - 1), st.sampled_from([1, 2, 5, 16, 40]),
                               st.one_of(st.none(), st.floats(1.0, 1000.0))), min_size=1, max_size=60),
       f=st.integers(0, len(FLOWS) - 1))
def test_unequal_costs_other_flows_are_untouched_and_a_flow_within_c_max(jobs: list[tuple[int, float, float | None]],
                                                                       f: int) -> None:
    """(a), unequal costs, over a busy period in which every request is queued before the first
    start (no flow rejoins): reordering flow ``f``'s requests (deadlines, against FIFO) leaves
    every other flow's starts exactly as they were (the same requests, in the same order, at the
    same start tags), and ``f``'s service up to any virtual time ``V`` (its charges of starts
    with a start tag below ``V``, over its weight) differs by less than its largest charge."""
    for make in TWINS:
        runs = []
        for with_deadlines in (True, False):
            run = Run(make, BIG_POOL)
            for i, c, dl in jobs:
                run.submit(i, c, dl if (i == f and with_deadlines) else None)
            run.poll()
            runs.append(run)
        edf, fifo = runs
        others = [[(t[1], t[5]) for t in r.trace if t[0] == "start" and r.reqs[t[1]].flow != FLOWS[f]] for r in runs]
        assert others[0] == others[1]
        # in the core's sub-units (docs/design.md §6), exact: each start's charge is the meter
        # right after it less its start tag (a charge made as an entry plus a correction may
        # differ from ceil(cost * 2**20 / weight) by a sub-unit of rounding)
        mine = [[(round(t[5] * SCALE), round(t[3] * SCALE) - round(t[5] * SCALE)) for t in r.trace
                 if t[0] == "start" and r.reqs[t[1]].flow == FLOWS[f]] for r in runs]
        c_max = max((c for m in mine for _, c in m), default=0)
        tags = sorted({round(t[5] * SCALE) for r in runs for t in r.trace if t[0] == "start"})
        for v in [*tags, math.inf]:
            got = [sum(c for t, c in m if t < v) for m in mine]
            assert abs(got[0] - got[1]) < c_max or got[0] == got[1], (v, got, c_max)


# ------------------------------------------------------------------ rules, one at a time
def test_deadlines_first_nearest_first_ties_in_queue_order(clock: Clock, core) -> None:
    pol = policy(pools="""
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9", max_in_flight: 1}]
    """)
    e = PolicyEngine(pol, clock=clock, scheduler=core)
    f = Flow("a", "batch", "p")
    first = e.submit(f, cost=1)
    assert e.poll() == [first]
    plain = [e.submit(f, cost=c) for c in (1, 5000, 1)]  # no deadline: the size buckets (small first)
    late = e.submit(f, cost=1, deadline=clock.t + 50)
    near = e.submit(f, cost=1, deadline=clock.t + 10)
    tie = e.submit(f, cost=9000, deadline=clock.t + 10)  # as near: after `near`, queued later
    order = []
    for _ in range(6):
        e.complete(next(r for r in [first, *order] if r.state == "running"))
        order += e.poll()
    assert order == [near, tie, late, plain[0], plain[2], plain[1]]


def test_a_strict_class_stays_first_come_first_served(clock: Clock, core) -> None:
    pol = policy(pools="""
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9", max_in_flight: 1}]
    """, classes="""
      system: {strict: true, max_in_flight: 1, max_queue_length: 10}
    """, orgs="""
      a: {keys: [ka], classes: [system]}
    """)
    e = PolicyEngine(pol, clock=clock, scheduler=core)
    f = Flow("a", "system", "p")
    rs = [e.submit(f, cost=1, deadline=clock.t + d) for d in (50, 10, 30)]
    started = []
    for _ in rs:
        started += e.poll()
        e.complete(started[-1])
    assert started == rs


def test_a_class_default_deadline(clock: Clock, core) -> None:
    pol = policy(pools="""
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9", max_in_flight: 1}]
    """, classes="""
      batch: {weight: 1, deadline_seconds: 10, ttft_objective_seconds: 2}
    """)
    e = PolicyEngine(pol, clock=clock, scheduler=core)
    f = Flow("a", "batch", "p")
    busy = e.submit(f, cost=1)
    assert busy.deadline == clock.t + 10  # the class's default: it also ends a running request then
    assert e.poll() == [busy]
    own = e.submit(f, cost=1, deadline=clock.t + 30)  # a deadline of its own stands (longer or shorter)
    dflt = e.submit(f, cost=1)
    assert own.deadline == clock.t + 30 and dflt.deadline == clock.t + 10
    clock.advance(10)
    assert e.poll() == [] and e.dropped == [dflt]
    assert dflt.outcome == "refused" and dflt.reason == "deadline"
    e.complete(busy)
    assert e.poll() == [own]


# ------------------------------------------------------------------ the policy file
@pytest.mark.parametrize("key", ["deadline_seconds", "ttft_objective_seconds"])
@pytest.mark.parametrize("value", ["0", "-1", ".nan", ".inf", '"5"', "true", "[1]"])
def test_bad_objectives_are_refused_naming_the_key_and_value(key: str, value: str) -> None:
    with pytest.raises(PolicyError) as info:
        policy(classes=f"""
          batch: {{weight: 1, {key}: {value}}}
        """)
    msg = str(info.value)
    assert f"classes.batch.{key}" in msg and "must be a number > 0" in msg
    shown = {"0": "0", "-1": "-1", ".nan": "nan", ".inf": "inf", '"5"': "'5'", "true": "True", "[1]": "a list"}[value]
    assert shown in msg


def test_objectives_are_checked_together_and_kept() -> None:
    with pytest.raises(PolicyError) as info:
        policy(classes="""
          batch: {weight: 1, deadline_seconds: 5, ttft_objective_seconds: 8}
        """)
    assert "classes.batch.ttft_objective_seconds" in str(info.value) and "(5)" in str(info.value)
    with pytest.raises(PolicyError) as info:
        policy(classes="""
          batch: {weight: 1, refuse_unmeetable: "yes"}
        """)
    assert "classes.batch.refuse_unmeetable: must be true or false, got 'yes'" in str(info.value)
    with pytest.raises(PolicyError) as info:
        policy(classes="""
          batch: {strict: true, max_in_flight: 1, max_queue_length: 5, refuse_unmeetable: true}
        """)
    assert "classes.batch.refuse_unmeetable: a strict class is first come first served" in str(info.value)
    c = policy(classes="""
      batch: {weight: 1, deadline_seconds: 30, ttft_objective_seconds: 2.5, refuse_unmeetable: true}
    """).classes["batch"]
    assert (c.deadline_seconds, c.ttft_objective_seconds, c.refuse_unmeetable) == (30.0, 2.5, True)
    d = policy().classes["batch"]
    assert (d.deadline_seconds, d.ttft_objective_seconds, d.refuse_unmeetable) == (None, None, False)


# ------------------------------------------------------------------ refusing early
REFUSE = """
pools:
  p:
    models: [m]
    backends: [{url: "http://127.0.0.1:9", max_in_flight: 2}]
classes:
  batch: {weight: 1, small_cost: null, refuse_unmeetable: true}
  other: {weight: 1, small_cost: null}
orgs:
  a: {keys: [ka], classes: [batch, other]}
  b: {keys: [kb], classes: [batch]}
"""


def _measure(e: PolicyEngine, clock: Clock, f: Flow, n: int = 8, held: float = 1.0) -> None:
    """``n`` attempts of ``held`` seconds each, one after the other: the pool's measured service."""
    for _ in range(n):
        r = e.submit(f, cost=1)
        assert e.poll() == [r]
        clock.advance(held)
        e.complete(r)


def test_unmeetable_is_refused_at_once_with_a_retry_after(clock: Clock, core) -> None:
    e = PolicyEngine(parse_policy(REFUSE), clock=clock, scheduler=core)
    a = Flow("a", "batch", "p")
    assert e.queues["p"].service(a, clock.t) is None  # nothing measured: nothing refused
    _measure(e, clock, Flow("a", "other", "p"))
    assert e.queues["p"].service(a, clock.t) == (2.0, 2.0)  # 2 slots, cost 1 a second each
    keep = [e.submit(a, cost=1, deadline=clock.t + 100) for _ in range(2)]
    e.poll()  # both slots busy: nothing starts at once now
    # 10 ahead, all due at +5, each of cost 1: served alone at 2 a second, the 10th may start at
    # +4.5 (9 served before it), an 11th at +5
    ahead = [e.submit(a, cost=1, deadline=clock.t + 5) for _ in range(10)]
    q = e.queues["p"]
    before = (len(e.live), e.submitted, q.n_waiting, q.meter(a))
    with pytest.raises(Refused) as info:  # as near as they are, and queued after them: its start, +5
        e.submit(a, cost=1, deadline=clock.t + 5)
    assert info.value.reason == "deadline_unmeetable" and info.value.http_status == 429
    assert info.value.retry_after == pytest.approx(0.5)  # its start (+5) - its deadline (+5) + one start's gap
    assert (len(e.live), e.submitted - 1, q.n_waiting, q.meter(a)) == before  # nothing left behind
    ok = e.submit(a, cost=1, deadline=clock.t + 5.1)  # starts at +5: in time, just
    near = e.submit(a, cost=1, deadline=clock.t + 1)  # nearer than all of them: nothing is ahead of it
    b = e.submit(Flow("b", "batch", "p"), cost=1, deadline=clock.t + 0.1)  # another flow: its own position
    assert ok.state == near.state == b.state == "waiting"
    assert e.metrics.snapshot()[("a", "batch", "p")]["reasons"] == {"deadline_unmeetable": 1}
    del keep, ahead


def test_unmeetable_counts_only_requests_that_can_still_start(clock: Clock, core) -> None:
    e = PolicyEngine(parse_policy(REFUSE), clock=clock, scheduler=core)
    a, o = Flow("a", "batch", "p"), Flow("a", "other", "p")
    _measure(e, clock, o, n=6)  # 6 ended attempts: too few to predict from
    busy = [e.submit(o, cost=1) for _ in range(2)]
    assert e.poll() == busy
    clock.advance(1.0)
    doomed = [e.submit(a, cost=1, deadline=clock.t + 0.2) for _ in range(10)]  # accepted: nothing predicted
    for r in busy:
        e.complete(r)  # 8 samples of 1 s: cost 2 a second
    q = e.queues["p"]
    assert q.unmeetable(a, 1.0, clock.t + 0.2, clock.t) is None  # a slot is free: it may start at once
    q.pause_backend("http://127.0.0.1:9", 60)  # (an upstream 429: no slot free now)
    # served at 2 a second: the first of the doomed starts at once and holds the flow 0.5 s; the
    # other 9 run out of time by then and free their turns, so a request due later starts at +0.5
    r = e.submit(a, cost=1, deadline=clock.t + 0.8)
    assert r.state == "waiting"
    with pytest.raises(Refused) as info:  # due with them (queued after): its turn, +0.5, is past +0.2
        e.submit(a, cost=1, deadline=clock.t + 0.2)
    assert info.value.reason == "deadline_unmeetable"
    assert info.value.retry_after == pytest.approx(0.3 + 0.5)  # how late (+0.5 - 0.2), plus its own 0.5 s
    assert all(d.state == "waiting" for d in doomed)


def test_a_class_that_does_not_opt_in_is_never_refused(clock: Clock, core) -> None:
    e = PolicyEngine(parse_policy(REFUSE), clock=clock, scheduler=core)
    o = Flow("a", "other", "p")
    _measure(e, clock, o)
    rs = [e.submit(o, cost=1, deadline=clock.t + 0.01) for _ in range(50)]
    assert all(r.state in ("waiting", "running") for r in rs)


# ------------------------------------------------------------------ the predicted wait (GET /stats)
def test_predicted_wait_is_none_before_data_0_with_a_free_slot_then_the_flows_work_at_its_fair_rate(
        clock: Clock, core) -> None:
    """``predicted_wait``: the model of ``unmeetable`` for a new request arriving now, in every
    class (not only those that refuse): ``None`` before 8 attempts ended, 0 while a slot is free,
    then the flow's requests ahead (those with a deadline nearest first, then the others in queue
    order) served at its fair part of the measured service, those out of time skipped."""
    e = PolicyEngine(parse_policy(REFUSE), clock=clock, scheduler=core)
    a, b, o = Flow("a", "other", "p"), Flow("b", "batch", "p"), Flow("a", "batch", "p")
    q = e.queues["p"]
    assert e.predicted_wait("a", "other", "p") is None and q.predicted_wait(a, clock.t) is None  # nothing measured
    _measure(e, clock, a, n=7)
    assert e.predicted_wait("a", "other", "p") is None  # 7 attempts: not yet
    _measure(e, clock, a, n=1)
    assert e.predicted_wait("a", "other", "p") == 0.0  # measured (cost 2 a second), and a slot is free
    busy = [e.submit(o, cost=1) for _ in range(2)]
    assert e.poll() == busy
    assert e.predicted_wait("a", "other", "p") == 0.0  # no slot free, nothing of its flow ahead: its turn is next
    waiting = [e.submit(a, cost=1) for _ in range(4)]
    # a alone in the core: all of the 2 a second; 4 ahead of cost 1: its turn at +2
    assert e.predicted_wait("a", "other", "p") == pytest.approx(2.0)
    for _ in range(2):
        e.submit(b, cost=1)
    # b competes now (weight 1 each): a gets 1 a second, its turn at +4; b's 2 at 1 a second, +2
    assert e.predicted_wait("a", "other", "p") == pytest.approx(4.0)
    assert e.predicted_wait("b", "batch", "p") == pytest.approx(2.0)
    # a request with a deadline goes before those without; one out of time by its turn frees it
    e.submit(a, cost=1, deadline=clock.t + 0.5)
    e.submit(a, cost=1, deadline=clock.t + 0.5)  # its turn would be at +1: out of time, skipped
    assert e.predicted_wait("a", "other", "p") == pytest.approx(5.0)
    assert q.predicted_wait(a, clock.t, clock.t + 0.5) == pytest.approx(1.0)  # due with them: behind both
    assert q.predicted_wait(a, clock.t, clock.t + 0.1) == 0.0  # nearer than all: nothing ahead of it
    assert e.predicted_wait("a", "nope", "p") is None and e.predicted_wait("a", "other", "nope") is None
    del busy, waiting


def test_predicted_wait_is_none_for_a_strict_class(clock: Clock, core) -> None:
    e = PolicyEngine(policy(classes="""
      system: {strict: true, max_in_flight: 1, max_queue_length: 4}
      batch: {weight: 1}
    """, orgs="""
      a: {keys: [ka], classes: [batch, system]}
    """), clock=clock, scheduler=core)
    _measure(e, clock, Flow("a", "batch", "p"))
    assert e.predicted_wait("a", "system", "p") is None
    assert e.predicted_wait("a", "batch", "p") == 0.0


# ------------------------------------------------------------------ how often it is right
def test_how_often_the_early_refusal_is_right() -> None:
    """A seeded simulation (deadline_sim.py) of a flood beside a flow within its share. The
    shadow run refuses nothing and records each request's prediction at arrival, then what
    became of it: a request predicted unmeetable that started in time is a defect (it would have
    been refused and would have made it). The run that refuses: the requests started in time,
    and those that waited until their deadline to be dropped. Bounds around the figures of
    benchmarks/README.md ("Deadlines"), which has them over more seeds."""
    from deadline_sim import simulate

    for seed in range(2):
        shadow = simulate(seed=seed, n=1500, refuse=False)
        real = simulate(seed=seed, n=1500, refuse=True)
        assert shadow.predicted_unmeetable > 200 and 0.1 < shadow.defect_rate < 0.3  # measured 21-24 %
        assert shadow.caught > 0.25 * shadow.missed  # measured 31-34 % of the misses seen at arrival
        assert set(real.refused_by) == {"flood"}  # a flow within its share is never refused
        assert real.in_time >= 0.97 * shadow.in_time  # measured -1.0 % and +0.1 %: the refused made room
        assert real.missed <= 0.7 * shadow.missed  # a third fewer wait until their deadline to be dropped
        assert real.refused + real.missed <= shadow.missed + 0.03 * shadow.submitted


def test_stats_give_each_class_its_service_levels(clock: Clock, core) -> None:
    pol = policy(classes="""
      batch: {weight: 1, deadline_seconds: 30, ttft_objective_seconds: 2, refuse_unmeetable: true}
      bulk: {weight: 1}
    """, orgs="""
      a: {keys: [ka], classes: [batch, bulk]}
    """)
    e = PolicyEngine(pol, clock=clock, scheduler=core)
    want = {"batch": {"strict": False, "deadline_seconds": 30.0, "ttft_objective_seconds": 2.0,
                      "refuse_unmeetable": True},
            "bulk": {"strict": False, "deadline_seconds": None, "ttft_objective_seconds": None,
                     "refuse_unmeetable": False}}
    assert e.stats()["classes"] == want
    assert e.metrics.stats()["classes"] == want  # GET /stats


def test_check_config_names_each_bad_objective_and_lists_the_good_ones(tmp_path, capsys) -> None:
    from sfq.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(DEADLINE_POLICY.replace("batch: {weight: 1, small_cost: null}",
                                           "batch: {weight: 1, small_cost: null, deadline_seconds: 0, "
                                           "ttft_objective_seconds: .nan, refuse_unmeetable: 1}"))
    assert main(["check-config", str(bad), "--plain"]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert "classes.batch.deadline_seconds: must be a number > 0, got 0" in text
    assert "classes.batch.ttft_objective_seconds: must be a number > 0, got nan" in text
    assert "classes.batch.refuse_unmeetable: must be true or false, got 1" in text
    good = tmp_path / "good.yaml"
    good.write_text(DEADLINE_POLICY.replace("max_queue_age_seconds: 30}", "max_queue_age_seconds: 30, "
                                            "deadline_seconds: 20, ttft_objective_seconds: 1.5, "
                                            "refuse_unmeetable: true}"))
    assert main(["check-config", str(good), "--plain"]) == 0
    text = capsys.readouterr().out
    assert "Deadlines and service levels" in text
    row = next(line for line in text.splitlines() if line.lstrip().startswith("interactive") and "20 s" in line)
    assert "1.5 s" in row and "yes" in row
