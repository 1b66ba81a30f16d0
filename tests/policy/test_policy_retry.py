"""The retry planner: safety, attempts, backoff with full jitter and Retry-After, the budget,
the deadline; Idempotency-Key joining."""

from __future__ import annotations

import random

import aiohttp
import pytest

from sfq.errors import BackendError, BackendHTTPError, BackendTimeout, BackendUnavailable
from sfq.policy import IdempotencyIndex, RetryPlanner, RetrySpec, retry_after_of, retry_safe


def _refused() -> BackendUnavailable:
    err = BackendUnavailable("cannot connect", backend="b")
    try:
        raise err from aiohttp.ClientConnectorError(None, OSError(111, "refused"))  # type: ignore[arg-type]
    except BackendUnavailable as e:
        return e


def _reset() -> BackendUnavailable:
    try:
        raise BackendUnavailable("connection lost", backend="b") from ConnectionResetError()
    except BackendUnavailable as e:
        return e


def test_only_where_safe() -> None:
    assert retry_safe(BackendHTTPError("busy", status=429))
    assert retry_safe(BackendHTTPError("unavailable", status=503))
    assert retry_safe(_refused())
    assert retry_safe(_reset())  # a connection error: clients retry it
    assert retry_safe(BackendHTTPError("boom", status=500))
    assert retry_safe(BackendHTTPError("timeout", status=408))
    assert retry_safe(BackendHTTPError("conflict", status=409))
    assert not retry_safe(BackendHTTPError("not found", status=404))
    assert not retry_safe(BackendHTTPError("bad", status=400))
    assert not retry_safe(BackendTimeout("slow"))
    assert not retry_safe(ValueError("not a backend error"))
    # an Idempotency-Key makes any backend failure safe to repeat
    assert retry_safe(BackendHTTPError("boom", status=500), "key-1")
    assert retry_safe(_reset(), "key-1")
    assert not retry_safe(ValueError("x"), "key-1")


def test_retry_after_sources() -> None:
    e = BackendHTTPError("busy", status=429)
    assert retry_after_of(e) is None
    e.retry_after = 3  # type: ignore[attr-defined]
    assert retry_after_of(e) == 3
    e2 = BackendHTTPError("busy", status=429)
    e2.headers = {"Retry-After": "7"}  # type: ignore[attr-defined]
    assert retry_after_of(e2) == 7
    e3 = BackendHTTPError("busy", status=429)
    e3.headers = {"Retry-After": "Wed, 21 Oct 2015 07:28:10 GMT"}  # type: ignore[attr-defined]
    assert retry_after_of(e3, now_wall=1445412480.0) == pytest.approx(10.0)
    e4 = BackendHTTPError("busy", status=429)
    e4.headers = {"Retry-After": "soon"}  # type: ignore[attr-defined]
    assert retry_after_of(e4) is None


def planner(**kw: object) -> RetryPlanner:
    return RetryPlanner(RetrySpec(**kw), random.Random(7))  # type: ignore[arg-type]


def test_max_attempts_counts_the_first_try() -> None:
    p = planner(max_attempts=3, budget_per_flow_percent=100)
    p.first_attempt("f", 0.0)
    assert p.plan("f", 1, 0.0, safe=True).retry
    p.retry_ended("f")
    assert p.plan("f", 2, 0.0, safe=True).retry
    p.retry_ended("f")
    d = p.plan("f", 3, 0.0, safe=True)
    assert not d.retry and d.reason == "max_attempts"
    assert p.plan("f", 1, 0.0, safe=False).reason == "not_safe"


def test_full_jitter_within_the_exponential_cap() -> None:
    p = planner(base_seconds=0.5, max_seconds=4)
    for tries, cap in ((1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (9, 4.0)):
        draws = [p.backoff(tries) for _ in range(300)]
        assert all(0 <= d <= cap for d in draws)
        assert max(draws) > cap * 0.8 and min(draws) < cap * 0.2  # spread over the whole range
    assert planner(backoff="exponential", base_seconds=1, max_seconds=5).backoff(3) == 4
    assert planner(backoff="constant", base_seconds=2).backoff(5) == 2


def test_honours_retry_after() -> None:
    p = planner(base_seconds=0.5, max_seconds=1)
    p.first_attempt("f", 0.0)
    d = p.plan("f", 1, 0.0, safe=True, retry_after=12.0)
    assert d.retry and d.delay == 12.0


def test_never_past_the_deadline() -> None:
    p = planner(backoff="constant", base_seconds=2)
    p.first_attempt("f", 0.0)
    d = p.plan("f", 1, 10.0, safe=True, deadline=11.0)
    assert not d.retry and d.reason == "deadline"
    d = p.plan("f", 1, 10.0, safe=True, deadline=20.0, retry_after=15.0)
    assert not d.retry and d.reason == "deadline"
    assert p.plan("f", 1, 10.0, safe=True, deadline=12.5).retry


def test_budget_percent_of_the_last_minute_and_always_one() -> None:
    p = planner(budget_per_flow_percent=10, max_attempts=5)
    for _ in range(20):
        p.first_attempt("f", 0.0)
    # one retry may always wait or run
    assert p.plan("f", 1, 0.0, safe=True).retry
    # a second while the first is outstanding: (1+1) retries of 22 attempts <= 10%
    assert p.plan("f", 1, 0.0, safe=True).retry
    # a third: 3 retries of 23 attempts > 10%
    d = p.plan("f", 1, 0.0, safe=True)
    assert not d.retry and d.reason == "budget"
    assert p.share("f", 0.0) == (2, 22)
    # another flow has its own budget
    p.first_attempt("g", 0.0)
    assert p.plan("g", 1, 0.0, safe=True).retry
    # a minute later the window has forgotten them, but the two are still outstanding
    assert p.share("f", 61.0) == (0, 0)
    assert not p.plan("f", 1, 61.0, safe=True).retry
    p.retry_ended("f")
    p.retry_ended("f")
    assert p.plan("f", 1, 61.0, safe=True).retry  # none outstanding: one is allowed


def test_the_window_counts_what_a_minute_holds() -> None:
    """The budget's window (a list whose head moves, compacted as it goes) counts exactly the
    attempts and retries of the last minute, over thousands of attempts at uneven rates."""
    rng = random.Random(7)
    p = planner(budget_per_flow_percent=30, max_attempts=5)
    seen: list[tuple[float, bool]] = []
    now = 0.0
    for _ in range(5_000):
        now += rng.choice((0.001, 0.01, 0.5, 3.0, 40.0))
        if rng.random() < 0.7:
            p.first_attempt("f", now)
            seen.append((now, False))
        elif p.plan("f", 1, now, safe=True).retry:
            seen.append((now, True))
            p.retry_ended("f")
        window = [r for t, r in seen if t > now - 60.0]
        assert p.share("f", now) == (sum(window), len(window))
    assert len(p._flows["f"].events) <= 2 * len(window) + 32  # what left the window is let go


def test_budget_zero_percent_still_allows_one() -> None:
    p = planner(budget_per_flow_percent=0)
    p.first_attempt("f", 0.0)
    assert p.plan("f", 1, 0.0, safe=True).retry
    assert p.plan("f", 1, 0.0, safe=True).reason == "budget"


def test_bad_input() -> None:
    p = planner()
    with pytest.raises(ValueError):
        p.plan("f", 0, 0.0, safe=True)
    with pytest.raises(RuntimeError):
        p.retry_ended("nobody")
    with pytest.raises(TypeError):
        RetryPlanner({"max_attempts": 3})  # type: ignore[arg-type]


def test_idempotency_index() -> None:
    idx: IdempotencyIndex[str] = IdempotencyIndex()
    idx.add("org-a", "k", "first")
    assert idx.get("org-a", "k") == "first"
    assert idx.get("org-b", "k") is None  # another org's key never joins
    with pytest.raises(RuntimeError):
        idx.add("org-a", "k", "second")
    idx.discard("org-a", "k", "other")
    assert len(idx) == 1
    idx.discard("org-a", "k", "first")
    assert idx.get("org-a", "k") is None and len(idx) == 0


def test_unsafe_generic_backend_error() -> None:
    assert not retry_safe(BackendError("weird"))


def test_never_sent_and_no_healthy_backend_are_safe() -> None:
    from sfq.errors import NoHealthyBackend

    assert retry_safe(NoHealthyBackend("no backend of pool p was healthy"))
    assert retry_safe(BackendTimeout("connect timed out", never_sent=True))
    assert not retry_safe(BackendTimeout("read timed out"))
