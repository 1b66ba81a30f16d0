"""A pool with no backend in rotation answers its waiting requests after
``unavailable_timeout`` (counted from each request's arrival or the outage's start, whichever
is later), instead of letting them wait for a backend that may never come back."""

from __future__ import annotations

import pytest
from policy_helpers import Clock, policy

from sfq.engine import PolicyEngine
from sfq.policy import Flow

POOL = """
  p:
    models: [m]
    backends: [{url: "http://127.0.0.1:9", max_in_flight: 1}, {url: "http://127.0.0.1:10", max_in_flight: 1}]
"""
CLASSES = """
  batch: {weight: 1}
"""


def test_waiting_requests_are_answered_when_the_pool_stays_down(clock: Clock, core) -> None:
    e = PolicyEngine(policy(pools=POOL, classes=CLASSES), clock=clock, scheduler=core)
    q = e.queues["p"]
    q.unavailable_timeout = 10.0
    f = Flow("a", "batch", "p")
    for b in q.backends:
        q.set_healthy(b, False)
    q.set_available(False)
    early = e.submit(f, cost=1)
    assert e.poll() == []
    assert e.wake_at() == pytest.approx(clock.t + 10)
    clock.advance(6)
    late = e.submit(f, cost=1)  # arrives during the outage: its own 10 s
    clock.advance(4)
    assert e.poll() == [] and e.dropped == [early]
    assert early.outcome == "refused" and early.reason == "unavailable"
    assert late.outcome is None and e.wake_at() == pytest.approx(clock.t + 6)
    q.set_available(True)  # a backend is back in rotation: no more drops
    for b in q.backends:
        q.set_healthy(b, True)
    assert e.wake_at() is None
    clock.advance(100)
    assert e.poll() == [late]


def test_a_saturated_pool_is_not_down(clock: Clock, core) -> None:
    e = PolicyEngine(policy(pools=POOL, classes=CLASSES), clock=clock, scheduler=core)
    q = e.queues["p"]
    f = Flow("a", "batch", "p")
    for b in q.backends:
        q.set_healthy(b, False)  # out of rotation for placement (saturated) ...
    q.set_available(True)  # ... but in rotation: requests keep waiting
    r = e.submit(f, cost=1)
    clock.advance(3600)
    assert e.poll() == [] and e.dropped == [] and r.outcome is None


async def test_a_pool_whose_only_backend_is_dead_answers_at_once() -> None:
    """End to end: the only backend refuses connections and leaves rotation; from then on a
    request of its pool is answered NoHealthyBackend at once (with a Retry-After), not after a
    wait for a backend that may never come back, and nothing is sent."""
    import random
    import socket

    from sfq.backends.health import HealthOptions
    from sfq.errors import BackendError, NoHealthyBackend
    from sfq.dispatch import PolicyDispatcher
    from sfq.policy import parse_policy

    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    text = f"""
pools:
  p:
    models: [m]
    backends: [{{url: "{dead}", max_in_flight: 2}}]
classes:
  batch: {{weight: 1}}
orgs:
  a: {{keys: [ka], classes: [batch]}}
retry: {{max_attempts: 1}}
"""
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    pd = PolicyDispatcher(parse_policy(text), rng=random.Random(1), health=HealthOptions(backoff=5.0, max_backoff=5.0))
    async with pd:
        with pytest.raises(BackendError):
            await pd.submit("ka", body)  # refused: the backend leaves rotation
        assert not pd.engine.pool_available("p")
        with pytest.raises(NoHealthyBackend) as info:
            await pd.submit("ka", body)
        assert info.value.retry_after is not None and info.value.retry_after > 0
        row = pd.stats()["flows"]["a/batch/p"]
        assert row["refused"] == 1 and row["reasons"].get("unavailable") == 1 and row["attempts"] == 1
        assert pd.stats()["backends"][dead]["healthy"] is False
