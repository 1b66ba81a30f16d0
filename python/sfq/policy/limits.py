"""Pure, clock-free building blocks: token buckets and concurrency counters.

Every method that depends on time takes ``now`` (seconds, any monotonic origin) so the
callers inject their clock and the tests step it by hand. A clock that goes backwards is
treated as standing still (nothing refills, nothing is lost).
"""

from __future__ import annotations

import math

__all__ = ["TokenBucket", "Slots"]


class TokenBucket:
    """A token bucket for a per-minute limit: it holds at most ``per_minute`` tokens, starts
    full and refills continuously at ``per_minute / 60`` tokens per second.

    ``take(n)`` debits ``n`` when at least ``min(n, capacity)`` tokens are there: a request
    larger than the whole bucket waits until the bucket is full and then goes, leaving it in
    debt, so it is neither refused forever nor let through early. ``credit(n)`` gives tokens
    back (a usage report smaller than the estimate); ``debit(n)`` takes more (larger), and may
    leave the bucket in debt.
    """

    __slots__ = ("capacity", "rate", "level", "_t")

    # (the counts are annotated ``object``: checked here, with one message, where the compiled
    # module would turn a string away with mypyc's own TypeError, and True into 1.0)
    def __init__(self, per_minute: object, now: float) -> None:
        if isinstance(per_minute, bool) or not isinstance(per_minute, (int, float)) or not (
                math.isfinite(per_minute) and per_minute > 0):
            raise ValueError(f"per_minute must be a finite number > 0, got {per_minute!r}")
        self.capacity = float(per_minute)
        self.rate = self.capacity / 60.0
        self.level = self.capacity
        self._t = float(now)

    def _refill(self, now: float) -> None:
        if now > self._t:
            self.level = min(self.capacity, self.level + (now - self._t) * self.rate)
            self._t = now

    def available(self, now: float) -> float:
        """Tokens in the bucket at ``now`` (negative while in debt)."""
        self._refill(now)
        return self.level

    @staticmethod
    def _count(n: object) -> float:
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not (math.isfinite(n) and n >= 0):
            raise ValueError(f"a token count must be a finite number >= 0, got {n!r}")
        return float(n)

    def _need(self, n: object) -> float:
        return min(self._count(n), self.capacity)

    def can_take(self, n: object, now: float) -> bool:
        need = self._need(n)
        self._refill(now)
        return self.level >= need - 1e-9

    def take(self, n: object, now: float) -> bool:
        """Debit ``n`` if allowed now; returns whether it was."""
        count = self._count(n)
        self._refill(now)
        if self.level < min(count, self.capacity) - 1e-9:
            return False
        self.level -= count
        return True

    def wait(self, n: object, now: float) -> float:
        """Seconds from ``now`` until ``take(n)`` would succeed (0 if it would now)."""
        need = self._need(n)
        self._refill(now)
        missing = need - self.level
        return 0.0 if missing <= 1e-9 else missing / self.rate

    def credit(self, n: object, now: float) -> None:
        """Give ``n`` tokens back (capped at the capacity)."""
        count = self._count(n)
        self._refill(now)
        self.level = min(self.capacity, self.level + count)

    def debit(self, n: object, now: float) -> None:
        """Take ``n`` more tokens unconditionally (a usage report above the estimate)."""
        count = self._count(n)
        self._refill(now)
        self.level -= count

    def __repr__(self) -> str:
        return f"TokenBucket(per_minute={self.capacity:g}, level={self.level:.3f})"


class Slots:
    """A concurrency counter: ``used`` of ``limit`` (``None`` = unlimited). ``full`` is a field,
    kept by the three ways to count (``acquire``, ``hold``, ``release``), so that the hot path
    reads one attribute; nobody writes ``used`` but them."""

    __slots__ = ("name", "limit", "used", "full")

    def __init__(self, name: str, limit: int | None) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"{name}: limit must be an integer >= 0 or None, got {limit!r}")
        self.name = name
        self.limit = limit  # requests at once (None: unlimited; 0: none, a gateway's part of a small global limit)
        self.used = 0  # requests holding a slot
        self.full = limit == 0  # used >= limit: no slot to acquire (never, unlimited)

    def acquire(self) -> None:
        """Take a free slot (``RuntimeError`` when it is full)."""
        if self.full:
            raise RuntimeError(f"{self.name}: no free slot ({self.used}/{self.limit})")
        used = self.used = self.used + 1
        self.full = self.limit is not None and used >= self.limit

    def hold(self) -> None:
        """Count a request that holds a slot already, even past the limit (one started under a
        policy that allowed more, adopted by this one): nothing more is acquired until it is
        back under."""
        used = self.used = self.used + 1
        self.full = self.limit is not None and used >= self.limit

    def release(self) -> None:
        """Give a slot back (``RuntimeError`` when none is held)."""
        if self.used <= 0:
            raise RuntimeError(f"{self.name}: release without acquire")
        used = self.used = self.used - 1
        self.full = self.limit is not None and used >= self.limit

    def __repr__(self) -> str:
        return f"Slots({self.name!r}, {self.used}/{self.limit})"
