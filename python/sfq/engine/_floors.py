"""How far a refund may take a flow's meter, in the delivered-service modes (``settle``, ``served``).

A request's charge at dispatch is an estimate. In these modes, when the request completes
(``PolicyQueue.settle``), its charge is corrected to what it really cost. While the flow
still has work in flight it keeps its meter, lag included, so a refund may take the meter
below the virtual time ``v``. The rule here limits how far.

When a flow is dispatched while it is the only flow competing in the core, ``v`` becomes
the flow's own meter (the dispatch's start tag). That meter still holds the estimates of
the flow's work in flight, and every flow that joins later starts from ``v``, so from
those estimates. If the estimates were high (a plain request whose ``max_tokens`` is well
above what it uses), the refunds that come back at completion would put the flow far
below everyone who joined meanwhile. It would then win every turn until it had been
served that whole gap a second time. With several backends this gap is large: a flow that
arrives first fills every slot by itself and moves ``v`` up by one estimate per slot
(issue 27).

So from that dispatch on, the work that was already in flight is refunded only down to
the start tag it set, plus whatever the flow has been charged since. Charges can still go
up. Nothing is kept from refunds when another flow was competing at the dispatch: the
flow's high estimates then cost it turns that went to that flow, and the refunds make up
for them. Requests dispatched later are settled as before. The record is dropped once the
flow has no work left in flight. Only a dispatch whose charge is a guess sets a floor
(``pool.guessed``: an estimate at the prior ratio, before any usage report calibrated the
flow or its model): once estimates are calibrated, refunds are their noise, and holding them
back overcharged a flow each time it happened to be alone while the others' work ran (they
keep their lower meters; docs/design.md §4). (docs/design.md §4.)
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .pool import Request


class _Floor:
    """A flow's latest dispatch that set ``v`` while the flow was alone: its start tag, the
    flow's requests dispatched since (in flight), and the charges of those already ended."""

    __slots__ = ("start", "since", "banked")

    def __init__(self, start: float, r: Request) -> None:
        self.start = start  # cost units / weight (the meter's units): v as the dispatch set it
        self.since: set[Request] = {r}
        self.banked = 0.0  # cost units: final charges of requests in ``since`` that ended


class RefundFloors:
    """The floors of one pool's flows (see the module docstring). Takes the pool's core as
    an argument to each call and keeps no other state."""

    __slots__ = ("flows",)

    def __init__(self) -> None:
        #: the flows with a floor (empty: no refund is held back; the hot paths test this dict)
        self.flows: dict[Hashable, _Floor] = {}

    def __bool__(self) -> bool:
        return bool(self.flows)

    def dispatched(self, r: Request, start: float, v: float, alone: bool) -> None:
        """The core dispatched ``r``, whose work is reported as its flow's, at start tag
        ``start``. Before the dispatch the virtual time was ``v``, and ``alone`` says
        whether its flow was the only one competing."""
        if alone and start > v:
            self.flows[r.work_flow] = _Floor(start, r)
            return
        fl = self.flows.get(r.work_flow)
        if fl is not None:
            fl.since.add(r)

    def refund(self, r: Request, delta: float, sched: Any) -> float:
        """The part of the refund ``delta`` (cost units, < 0) of ``r`` that its flow gets."""
        fl = self.flows.get(r.work_flow)
        if fl is None or r in fl.since:
            return delta
        w = sched.weight(r.work_flow)
        floor = fl.start + (fl.banked + sum(x.charged for x in fl.since)) / w
        m = sched.meter(r.work_flow)
        if m + delta / w >= floor:
            return delta
        return (floor - m) * w if m > floor else 0.0

    def ended(self, r: Request, sched: Any) -> None:
        """``r``'s attempt ended (its work is done in the core, its charge final)."""
        fl = self.flows.get(r.work_flow)
        if fl is None:
            return
        if r in fl.since:
            fl.since.discard(r)
            fl.banked += r.charged
        if not sched.running(r.work_flow):
            del self.flows[r.work_flow]
