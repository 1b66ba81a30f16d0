"""Token buckets and concurrency counters on an injected clock."""

from __future__ import annotations

import math

import pytest

from sfq.policy import Slots, TokenBucket


def test_starts_full_and_refills_continuously() -> None:
    b = TokenBucket(60, now=0.0)  # 1 token per second, capacity 60
    assert b.available(0.0) == 60
    assert all(b.take(1, 0.0) for _ in range(60))
    assert not b.take(1, 0.0)
    assert b.wait(1, 0.0) == pytest.approx(1.0)
    assert b.available(0.5) == pytest.approx(0.5)
    assert not b.take(1, 0.5)
    assert b.take(1, 1.0)
    assert b.available(1000.0) == 60  # never above the capacity


def test_larger_than_the_bucket_waits_for_a_full_bucket_then_goes_into_debt() -> None:
    b = TokenBucket(100, now=0.0)
    assert b.take(30, 0.0)
    assert not b.can_take(500, 0.0)
    assert b.wait(500, 0.0) == pytest.approx(30 / (100 / 60))
    assert b.take(500, 18.0)
    assert b.available(18.0) == pytest.approx(-400)
    assert b.wait(1, 18.0) == pytest.approx(401 / (100 / 60))


def test_corrections_from_usage() -> None:
    b = TokenBucket(1000, now=0.0)
    assert b.take(800, 0.0)
    b.credit(500, 0.0)  # used 300 of the 800 estimated
    assert b.available(0.0) == pytest.approx(700)
    b.credit(10_000, 0.0)
    assert b.available(0.0) == 1000  # capped
    b.debit(1500, 0.0)  # used more than estimated
    assert b.available(0.0) == pytest.approx(-500)


def test_clock_going_backwards_refills_nothing() -> None:
    b = TokenBucket(60, now=100.0)
    assert b.take(60, 100.0)
    assert b.available(50.0) == 0
    assert b.available(101.0) == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan, True, "60"])
def test_bad_capacity(bad: object) -> None:
    with pytest.raises(ValueError, match="per_minute"):
        TokenBucket(bad, 0.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, None])
def test_bad_counts_change_nothing(bad: object) -> None:
    b = TokenBucket(60, 0.0)
    b.take(10, 0.0)
    for op in (b.take, b.credit, b.debit, b.wait):
        with pytest.raises(ValueError):
            op(bad, 0.0)  # type: ignore[arg-type]
    assert b.available(0.0) == 50


def test_slots() -> None:
    s = Slots("orgs.a.max_in_flight", 2)
    s.acquire()
    s.acquire()
    assert s.full
    with pytest.raises(RuntimeError, match="no free slot"):
        s.acquire()
    s.release()
    assert not s.full and s.used == 1
    s.release()
    with pytest.raises(RuntimeError, match="release without acquire"):
        s.release()
    u = Slots("x", None)
    for _ in range(1000):
        u.acquire()
    assert not u.full
    # a request adopted from a policy that allowed more holds its slot past the limit: full
    # until it is back under
    h = Slots("x", 1)
    h.acquire()
    h.hold()
    assert h.full and h.used == 2
    with pytest.raises(RuntimeError, match="no free slot"):
        h.acquire()
    h.release()
    assert h.full and h.used == 1
    h.release()
    assert not h.full and h.used == 0
    h.acquire()
    assert h.full
    # 0: nothing may start (a gateway's part of a global limit smaller than the gateways
    # sharing it, while Redis is lost: sfq.state._local); below 0 is an error
    z = Slots("x", 0)
    assert z.full
    with pytest.raises(RuntimeError, match="no free slot"):
        z.acquire()
    with pytest.raises(ValueError, match="limit must be an integer >= 0 or None, got -1"):
        Slots("x", -1)
