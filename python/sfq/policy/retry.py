"""Retries by five rules, as a pure planner (times are passed in; randomness is injected).

1. Only where a client would retry, before any byte reached the client: a connection error,
   an upstream 408, 409, 429 or 5xx (the rule of the official OpenAI client and of Envoy), or
   any failure of a request that carries an ``Idempotency-Key``. A read timeout is not retried
   (the model may still be working on it). The retry prefers another backend.
2. Back into the request's own flow (the caller re-queues it there; it waits its turn).
3. Exponential backoff with full jitter (uniform in ``[0, min(max, base * 2**(n-1))]``),
   never shorter than the upstream's ``Retry-After``.
4. At most ``max_attempts`` tries, the first one included.
5. Within the flow's retry budget (at most ``budget_per_flow_percent`` of its attempts over
   the last minute are retries, but one retry waiting or running per flow is always allowed),
   and never past the request's deadline.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Hashable
from typing import Generic, NamedTuple, TypeVar

from ..errors import BackendError, BackendHTTPError, BackendUnavailable, NoHealthyBackend
from .config import RetrySpec

__all__ = ["RetryDecision", "RetryPlanner", "IdempotencyIndex", "retry_safe", "retry_after_of"]

#: upstream statuses a client retries (besides every 5xx): timeout, conflict, rate limit
RETRYABLE_STATUS = frozenset({408, 409, 429})

V = TypeVar("V")


def retry_after_of(error: BaseException, now_wall: float | None = None) -> float | None:
    """Seconds the upstream asked us to wait (``Retry-After``: seconds or an HTTP date), from
    an error's ``retry_after`` attribute or its ``headers``; ``None`` when absent or bad."""
    ra = getattr(error, "retry_after", None)
    if ra is None:
        headers = getattr(error, "headers", None)
        if headers is not None:
            try:
                ra = headers.get("Retry-After")
            except Exception:
                ra = None
    if ra is None:
        return None
    if isinstance(ra, (int, float)) and not isinstance(ra, bool):
        return float(ra) if math.isfinite(ra) and ra >= 0 else None
    if isinstance(ra, str):
        s = ra.strip()
        try:
            v = float(s)
            return v if math.isfinite(v) and v >= 0 else None
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(s).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        return max(0.0, when - (time.time() if now_wall is None else now_wall))
    return None


def retry_safe(error: BaseException, idempotency_key: str | None = None) -> bool:
    """Whether a failed attempt may be tried again (rule 1)."""
    if isinstance(error, NoHealthyBackend):  # it waited for a backend that never came back: never sent
        return True
    if not isinstance(error, BackendError):
        return False
    if idempotency_key:
        return True
    if isinstance(error, BackendHTTPError):
        st = error.status
        return st is not None and (st in RETRYABLE_STATUS or 500 <= st <= 599)
    if error.never_sent:  # the transport knows it never reached the server
        return True
    return isinstance(error, BackendUnavailable)  # a connection error


class RetryDecision(NamedTuple):
    """``retry``: whether to try again; ``delay``: seconds to wait before re-queueing;
    ``reason``: ``ok``, ``not_safe``, ``max_attempts``, ``budget`` or ``deadline``; ``avoid``:
    the backend the retry should avoid when another can take it (the one that failed)."""

    retry: bool
    delay: float
    reason: str
    avoid: str | None = None


class _FlowBudget:
    """A flow's attempts over the last window. ``events[head:]`` are in the window (a list
    with a moving head rather than a deque: an empty deque is about 600 bytes, an empty list
    56, and most flows hold a few events)."""

    __slots__ = ("events", "head", "retries", "outstanding")

    def __init__(self) -> None:
        self.events: list[tuple[float, bool]] = []  # (time, was a retry) of attempts, oldest first
        self.head = 0  # events before it have left the window
        self.retries = 0  # retries in the window
        self.outstanding = 0  # retries planned and not yet ended

    def __len__(self) -> int:
        """Attempts in the window."""
        return len(self.events) - self.head

    def expire(self, cut: float) -> None:
        """Let the attempts made at or before ``cut`` leave the window (amortised O(1))."""
        ev, h = self.events, self.head
        n = len(ev)
        while h < n and ev[h][0] <= cut:
            if ev[h][1]:
                self.retries -= 1
            h += 1
        if h == n:
            ev.clear()
            h = 0
        elif h >= 32 and 2 * h >= n:
            del ev[:h]
            h = 0
        self.head = h


class RetryPlanner:
    """Plans retries for a policy's ``retry`` section. ``rng`` draws the jitter (inject a
    seeded ``random.Random`` for reproducible runs)."""

    WINDOW = 60.0

    def __init__(self, spec: RetrySpec, rng: random.Random | None = None) -> None:
        if not isinstance(spec, RetrySpec):
            raise TypeError(f"spec must be a RetrySpec, got {spec!r}")
        self.spec = spec
        self.rng = rng if rng is not None else random.Random()
        self._flows: dict[Hashable, _FlowBudget] = {}
        #: whether plan() applies the budget itself; false when a state shared by several
        #: gateways applies it over all of them (``sfq.state``)
        self.local_budget = True
        #: clock time of the next :meth:`sweep` made by :meth:`first_attempt` itself
        self._next_sweep = -math.inf

    def _budget(self, flow: Hashable, now: float) -> _FlowBudget:
        b = self._flows.get(flow)
        if b is None:
            b = self._flows[flow] = _FlowBudget()
        b.expire(now - self.WINDOW)
        return b

    def first_attempt(self, flow: Hashable, now: float) -> None:
        """Count a request's first try in the flow's window."""
        flows = self._flows
        if now >= self._next_sweep:  # (a flow idle for a window costs nothing: once per half window)
            self.sweep(now)
        b = flows.get(flow)
        if b is None:
            if len(flows) >= self.MAX_FLOWS:
                self._forget(now)
            b = flows[flow] = _FlowBudget()
        else:
            ev = b.events
            if b.head < len(ev) and ev[b.head][0] <= now - self.WINDOW:  # (expire's first test, without the call)
                b.expire(now - self.WINDOW)
        b.events.append((now, False))

    #: flows kept before those with nothing in their window and no retry planned are forgotten
    MAX_FLOWS = 10_000

    def _forget(self, now: float) -> None:
        """Forget the flows whose window is empty and that have no retry planned: memory follows
        the flows that are active, not every flow id ever seen (O(flows), once per MAX_FLOWS/2
        new flows at most)."""
        cut = now - self.WINDOW
        for f in [f for f, b in self._flows.items() if b.outstanding <= 0 and (not len(b) or b.events[-1][0] <= cut)]:
            del self._flows[f]
        if len(self._flows) >= self.MAX_FLOWS // 2:  # mostly active: let it grow before the next scan
            self.MAX_FLOWS = 2 * len(self._flows)

    def sweep(self, now: float) -> int:
        """Forget every flow with no attempt in the last window and no retry planned (its
        budget is a fresh flow's: nothing is lost); returns how many. O(flows); made by
        :meth:`first_attempt` at most once per half window, and by the engine's
        ``forget_idle`` (a driver's timer), so that an idle process holds nothing for flows
        seen once."""
        self._next_sweep = now + self.WINDOW / 2
        cut = now - self.WINDOW
        gone = [f for f, b in self._flows.items() if b.outstanding <= 0 and (not len(b) or b.events[-1][0] <= cut)]
        for f in gone:
            del self._flows[f]
        if len(gone) > len(self._flows):  # (a dict keeps its size after deletions: a new one is compact)
            self._flows = dict(self._flows)
        return len(gone)

    def retry_ended(self, flow: Hashable) -> None:
        """A planned retry is no longer waiting or running (it ended, whatever the outcome)."""
        b = self._flows.get(flow)
        if b is None or b.outstanding <= 0:
            raise RuntimeError(f"retry_ended({flow!r}) without a planned retry")
        b.outstanding -= 1

    def backoff(self, tries: int) -> float:
        """The delay before try number ``tries + 1`` (``tries`` >= 1 made so far), without
        ``Retry-After``."""
        s = self.spec
        if s.backoff == "constant":
            return s.base_seconds
        cap = min(s.max_seconds, s.base_seconds * 2.0 ** min(tries - 1, 60))
        return cap if s.backoff == "exponential" else self.rng.uniform(0.0, cap)

    def share(self, flow: Hashable, now: float) -> tuple[int, int]:
        """``(retries, attempts)`` of the flow over the last minute."""
        b = self._budget(flow, now)
        return b.retries, len(b)

    def plan(self, flow: Hashable, tries: int, now: float, *, safe: bool, deadline: float | None = None,
             retry_after: float | None = None) -> RetryDecision:
        """Decide whether try number ``tries + 1`` happens. On ``retry=True`` the retry is
        counted in the budget at once (it is waiting from now on); call ``retry_ended`` when
        that attempt ends."""
        if isinstance(tries, bool) or not isinstance(tries, int) or tries < 1:
            raise ValueError(f"tries must be an integer >= 1, got {tries!r}")
        if not safe:
            return RetryDecision(False, 0.0, "not_safe")
        if tries >= self.spec.max_attempts:
            return RetryDecision(False, 0.0, "max_attempts")
        b = self._budget(flow, now)
        if self.local_budget and b.outstanding > 0 and (
                (b.retries + 1) * 100.0 > self.spec.budget_per_flow_percent * (len(b) + 1)):
            return RetryDecision(False, 0.0, "budget")
        delay = self.backoff(tries)
        if retry_after is not None and retry_after > delay:
            delay = retry_after
        if deadline is not None and now + delay >= deadline:
            return RetryDecision(False, delay, "deadline")
        b.events.append((now, True))
        b.retries += 1
        b.outstanding += 1
        return RetryDecision(True, delay, "ok")


class IdempotencyIndex(Generic[V]):
    """Requests running under an ``Idempotency-Key``, per scope (the org: two orgs' keys never
    meet). A second request with the key while the first runs joins it."""

    def __init__(self) -> None:
        self._running: dict[tuple[Hashable, str], V] = {}

    def get(self, scope: Hashable, key: str) -> V | None:
        return self._running.get((scope, key))

    def add(self, scope: Hashable, key: str, value: V) -> None:
        if (scope, key) in self._running:
            raise RuntimeError(f"idempotency key {key!r} is already running for {scope!r}")
        self._running[(scope, key)] = value

    def discard(self, scope: Hashable, key: str, value: V) -> None:
        if self._running.get((scope, key)) is value:
            del self._running[(scope, key)]

    def __len__(self) -> int:
        return len(self._running)
