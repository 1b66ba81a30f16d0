"""What a gateway sharing Redis decides alone while it cannot reach Redis (``state.on_loss:
local``): its slice of every global limit, and the fair order of its own candidates.

A fleet's limits are global: the pool's, each backend's, an org's or a strict class's slots, the
pool's and each org's buckets, a class's waiting places, a budget's money. Without Redis no
gateway can see the others' use, so each keeps a *slice* it can spend alone, sized so that the
slices of the live gateways add up to the limit and never more (docs/gateway.md, "When Redis
is lost"):

* the live gateways are those that renewed in Redis within ``lease_seconds`` before it was lost
  (``P gw``, :data:`sfq.state._lua.GATEWAYS`): ``n`` of them, this one at ``rank`` in the sorted
  ids, so that every gateway computes the same split without talking to the others;
* a count limit ``L`` (slots, waiting places) gives ``L // n`` to each, and one more to the
  first ``L % n`` ranks (``sum == L``);
* a rate (per minute) gives ``rate / n`` to each, bucket size and refill alike;
* a budget gives each ``left / n``, ``left`` being what the gateway last saw unspent and not
  reserved (a budget it never saw is refused: it cannot know what is left).

The order among this gateway's own candidates is SFQ's, run by the core (``sfq.Scheduler``, the
same one the engine uses): strict classes first in the file's order, then the weighted flows by
start tag, a flow whose head does not fit its slices held back (``suspend``) while the others
go. Meters start level when Redis is lost and are dropped when it answers again: the fleet's
meters are Redis's, and a gateway alone for a few seconds only orders its own requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .._core import Scheduler
from ..policy.limits import TokenBucket

__all__ = ["Slices", "LocalOrder"]


class Slices:
    """This gateway's part of every global limit: ``rank`` among ``n`` live gateways."""

    __slots__ = ("rank", "n")

    def __init__(self, rank: int, n: int) -> None:
        if n < 1 or not 0 <= rank < n:
            raise ValueError(f"a slice needs 0 <= rank < n, got rank {rank!r} of {n!r}")
        self.rank = rank
        self.n = n

    def count(self, limit: int) -> int:
        """This gateway's part of a count ``limit``: the parts of the ``n`` gateways add up to it."""
        return limit // self.n + (1 if self.rank < limit % self.n else 0)

    def rate(self, per_minute: float) -> float:
        return per_minute / self.n

    def bucket(self, per_minute: float, now: float) -> TokenBucket:
        """A full bucket of this gateway's part of ``per_minute``."""
        return TokenBucket(self.rate(per_minute), now)

    def __repr__(self) -> str:
        return f"Slices(rank={self.rank}, n={self.n})"


class LocalOrder:
    """One pool's candidates at this gateway, in SFQ's order (the core's), strict classes first.

    ``add(member, flow, cost, weight, strict)`` a candidate (``strict``: its class's rank among
    the strict classes, ``-1`` for a weighted one); ``remove(member)`` one that left;
    ``next(fits)`` the first candidate, in order, for which ``fits(member)`` is true (it is
    dispatched: its flow charged ``cost / weight``, its work in flight until ``done(member)``: a
    flow whose head waits for a slot is held back without closing the busy period), or
    ``None``."""

    def __init__(self) -> None:
        self._sched: Any = Scheduler()
        self._tickets: dict[str, int] = {}  # member -> the core's ticket (weighted candidates)
        self._strict: dict[str, tuple[int, int]] = {}  # member -> (rank, arrival)
        self._running: dict[str, str] = {}  # member -> flow: weighted candidates granted, their work in flight
        self._seq = 0

    def __len__(self) -> int:
        return len(self._tickets) + len(self._strict)

    def __contains__(self, member: str) -> bool:
        return member in self._tickets or member in self._strict

    def add(self, member: str, flow: str, cost: float, weight: float, strict: int) -> None:
        if member in self:
            return
        self._seq += 1
        if strict >= 0:
            self._strict[member] = (strict, self._seq)
            return
        if self._sched.weight(flow) != weight:
            self._sched.set_weight(flow, weight)
        c = float(cost)
        self._tickets[member] = self._sched.enqueue(flow, c if math.isfinite(c) and c > 0 else 0.0, member)

    def remove(self, member: str) -> None:
        t = self._tickets.pop(member, None)
        if t is not None:
            self._sched.cancel(t)
        self._strict.pop(member, None)

    def correct(self, flow: str, delta: float) -> None:
        """A correction of a running candidate's charge (a stream's delivered tokens, a
        settlement): the local meter moves as the engine's would (never below ``v``)."""
        try:
            self._sched.adjust(flow, delta)
        except (ValueError, OverflowError):  # a correction past the core's bounds: the meter keeps its value
            pass

    def next(self, fits: Callable[[str], bool]) -> str | None:
        for member, _ in sorted(self._strict.items(), key=lambda kv: kv[1]):
            if fits(member):
                del self._strict[member]
                return member
        held: list[Any] = []
        try:
            while True:
                d = self._sched.peek()
                if d is None:
                    return None
                member = str(d.item)
                if fits(member):
                    self._sched.dispatch()
                    self._sched.work_started(d.flow)  # its work keeps the busy period open (and its meter)
                    self._running[member] = d.flow
                    del self._tickets[member]
                    return member
                self._sched.suspend(d.flow)  # its head waits for a slot of its own: the others go
                held.append(d.flow)
        finally:
            for flow in held:
                self._sched.resume(flow)

    def done(self, member: str) -> None:
        """The candidate ``member`` that :meth:`next` returned ended its work."""
        flow = self._running.pop(member, None)
        if flow is not None:
            self._sched.work_done(flow)
