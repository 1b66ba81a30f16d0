"""``pools.<p>.limits.headroom`` (a prototype, issue 42): the last free slots are kept for flows
with nothing running or below their part of the slots not kept; off by default."""

from __future__ import annotations

import pytest
from policy_helpers import Clock, policy

from sfq.engine import PolicyEngine
from sfq.policy import Flow
from sfq.policy.config import PolicyError


def _engine(clock: Clock, core, headroom: int | None) -> PolicyEngine:
    limits = "" if headroom is None else f", limits: {{headroom: {headroom}}}"
    pol = policy(pools=f"""
      p: {{models: [m], backends: [{{url: "http://127.0.0.1:9", max_in_flight: 6}}]{limits}}}
    """, orgs="""
      a: {keys: [ka], classes: [batch]}
      b: {keys: [kb], classes: [batch]}
      q: {keys: [kq], classes: [batch]}
    """)
    return PolicyEngine(pol, clock=clock, scheduler=core)


def _flood(e: PolicyEngine) -> None:
    for _ in range(10):
        e.submit(Flow("a", "batch", "p"), cost=10.0)
        e.submit(Flow("b", "batch", "p"), cost=10.0)


def test_without_headroom_the_flood_takes_every_slot(clock: Clock, core) -> None:
    e = _engine(clock, core, None)
    _flood(e)
    assert len(e.poll()) == 6
    e.submit(Flow("q", "batch", "p"), cost=1.0)
    assert e.poll() == []  # the quiet flow waits for a slot to free


def test_headroom_keeps_the_last_slots_for_a_flow_with_nothing_running(clock: Clock, core) -> None:
    e = _engine(clock, core, 2)
    _flood(e)
    started = e.poll()
    assert len(started) == 4 and {r.flow.org for r in started} == {"a", "b"}  # 2 each: (6 - 2) / 2
    q = e.submit(Flow("q", "batch", "p"), cost=1.0)
    assert e.poll() == [q]  # at once, in a slot kept
    q2 = e.submit(Flow("q", "batch", "p"), cost=1.0)
    assert e.poll() == [q2]  # 1 running < (6 - 2) / 3 flows
    e.complete(q)
    e.complete(q2)
    nxt = e.poll()  # q has nothing left: a and b, at their part (2 each), may not take the kept slots
    assert nxt == []
    e.complete(started[0])  # a slot of the flood's frees: its flow is below its part again
    again = e.poll()
    assert len(again) == 1 and again[0].flow.org == started[0].flow.org
    assert e.stats()["pools"]["p"]["waiting"] == 20 - 5


def test_headroom_must_be_a_positive_integer() -> None:
    with pytest.raises(PolicyError, match="headroom"):
        policy(pools="""
          p: {models: [m], backends: [{url: "http://127.0.0.1:9"}], limits: {headroom: -1}}
        """)
