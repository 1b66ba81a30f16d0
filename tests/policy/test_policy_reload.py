"""A policy reload (``PolicyEngine.reloaded``, ``PolicyDispatcher.reload``): new keys, weights
and limits in force at once; nothing waiting or running is lost; a change that needs a
restart is refused and changes nothing."""

from __future__ import annotations

import textwrap

import pytest
from policy_helpers import Clock

from sfq.errors import PolicyError, Refused
from sfq.engine import PolicyEngine
from sfq.policy import Flow, parse_policy

BASE = """
pools:
  p:
    models: [m]
    backends: [{url: "http://127.0.0.1:9", max_in_flight: 2}]
classes:
  batch: {weight: 1, max_queue_age_seconds: 100}
  interactive: {weight: 4}
orgs:
  a: {keys: [ka], classes: [batch, interactive], max_in_flight: 1}
  b: {keys: [kb], classes: [batch]}
"""


def pol(text: str = BASE, **subs: str):
    for k, v in subs.items():
        text = text.replace(k, v)
    return parse_policy(textwrap.dedent(text))


def test_waiting_and_running_requests_move_over_in_order(core):
    clock = Clock()
    e = PolicyEngine(pol(), clock=clock, scheduler=core)
    fa, fb = Flow("a", "batch", "p"), Flow("b", "batch", "p")
    running = e.submit(fa, cost=1)
    assert e.poll() == [running]
    waiting = [e.submit(f, cost=1) for f in (fa, fb, fb)]
    started = e.poll()  # a is at its max_in_flight 1: one of b's starts, the rest wait
    assert [r.flow for r in started] == [fb]
    clock.advance(30)
    new, ended = e.reloaded(pol(**{"max_in_flight: 1}": "max_in_flight: 2}", "kb]": "kb, kb2]"}))
    assert ended == []
    assert new.classifier.org_of("kb2").name == "b"  # the new key works at once
    assert set(new.live) == set(e.live)  # nothing lost
    # the running ones hold their slots in the new engine: the backend (2) is full
    assert new.queues["p"].in_flight == 2 and new.poll() == []
    new.complete(running, {"prompt_tokens": 1, "completion_tokens": 1})
    nxt = new.poll()
    assert nxt == [waiting[0]]  # arrival order kept, a's new limit (2) lets it go
    assert nxt[0].started_at is not None and nxt[0].started_at - nxt[0].queued_at == 30  # queue age kept
    assert new.stats()["flows"]["a/batch/p"]["completed"] == 1


def test_queue_age_survives_a_reload(core):
    clock = Clock()
    e = PolicyEngine(pol(), clock=clock, scheduler=core)
    fb = Flow("b", "batch", "p")
    blockers = [e.submit(fb, cost=1) for _ in range(2)]
    assert e.poll() == blockers
    w = e.submit(fb, cost=1)
    clock.advance(60)
    new, _ = e.reloaded(pol())
    clock.advance(41)  # 101 s in the queue: past its 100 s age although it moved at 60
    assert new.poll() == [] and new.dropped == [w] and w.reason == "queue_timeout"


def test_a_flow_the_new_policy_drops_is_refused_and_said_so(core):
    clock = Clock()
    e = PolicyEngine(pol(), clock=clock, scheduler=core)
    fa, fai = Flow("a", "batch", "p"), Flow("a", "interactive", "p")
    fb = Flow("b", "batch", "p")
    run = [e.submit(fb, cost=1) for _ in range(2)]
    e.poll()
    wa, wai = e.submit(fa, cost=1), e.submit(fai, cost=1)
    smaller = BASE.replace("  a: {keys: [ka], classes: [batch, interactive], max_in_flight: 1}\n", "").replace(
        "b: {keys: [kb], classes: [batch]}", "b: {keys: [kb], classes: [batch]}\n  c: {keys: [kc], classes: [batch]}")
    new, ended = e.reloaded(pol(smaller))
    assert ended == [wa, wai]
    assert {r.outcome for r in ended} == {"refused"} and {r.reason for r in ended} == {"unauthenticated"}
    with pytest.raises(Refused):
        new.classifier.org_of("ka")
    for r in run:
        new.complete(r)
    assert new.live == {} and new.stats()["flows"]["a/batch/p"]["refused"] == 1


@pytest.mark.parametrize("change, path", [
    ({'"http://127.0.0.1:9"': '"http://127.0.0.1:10"'}, "pools.p.backends"),
    ({"  p:\n": "  q:\n"}, "pools"),
    ({"orgs:": "cost: {input_weight: 3}\norgs:"}, "cost"),
])
def test_a_change_that_needs_a_restart_is_refused(core, change, path):
    clock = Clock()
    e = PolicyEngine(pol(), clock=clock, scheduler=core)
    r = e.submit(Flow("b", "batch", "p"), cost=1)
    with pytest.raises(PolicyError) as info:
        e.reloaded(pol(**change))
    assert info.value.path == path
    assert e.poll() == [r]  # the engine in force is untouched


def test_lowered_limit_holds_new_starts_until_back_under(core):
    clock = Clock()
    text = BASE.replace("b: {keys: [kb], classes: [batch]}", "b: {keys: [kb], classes: [batch], max_in_flight: 2}")
    e = PolicyEngine(pol(text), clock=clock, scheduler=core)
    fb = Flow("b", "batch", "p")
    run = [e.submit(fb, cost=1) for _ in range(2)]
    assert e.poll() == run
    w = e.submit(fb, cost=1)
    new, _ = e.reloaded(pol(text.replace("[batch], max_in_flight: 2}", "[batch], max_in_flight: 1}")))
    new.complete(run[0])
    assert new.poll() == []  # b still has 1 running, its new limit is 1
    new.complete(run[1])
    assert new.poll() == [w]
