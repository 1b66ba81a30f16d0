"""What a gateway sharing Redis decides alone while it cannot reach Redis (``state.on_loss:
local``): its slice of every global limit, and the order of its own candidates, by the engine's
own queue.

A fleet's limits are global: the pool's, each backend's, an org's or a strict class's slots, the
pool's and each org's buckets, a class's waiting places, a budget's money. Without Redis no
gateway can see the others' use, so each keeps a *slice* it can spend alone, sized so that the
slices of the live gateways add up to the limit and never more (docs/gateway.md, "When Redis
is lost"):

* the live gateways are those that renewed in Redis within ``lease_seconds`` before it was lost
  (``P gw``, :data:`sfq.state._lua.GATEWAYS`): ``n`` of them, this one at ``rank`` in the sorted
  ids, so that every gateway computes the same split without talking to the others;
* by demand: the fleet's decider writes a table of the live gateways' shares (:func:`shares_table`:
  the weights of their flows with work, :data:`SPREAD` of the whole spread equally) at most
  every ``lease_seconds / 2``; each gateway keeps the last two it read and takes, of each limit,
  the smaller part the two give it (:func:`allocate`: whole parts that add up to a count; a
  fraction of a rate). Every live gateway read the table before the last, so the parts add up
  to at most each limit;
* before there are two tables, equal parts: a count limit ``L`` (slots, waiting places) gives
  ``L // n`` to each, and one more to the first ``L % n`` ranks (``sum == L``); a rate (per
  minute) gives ``rate / n`` to each, bucket size and refill alike;
* a budget gives each ``left / n``, ``left`` being what the gateway last saw unspent and not
  reserved (a budget it never saw is refused: it cannot know what is left).

The decisions within those slices are the engine's: :class:`Alone` runs one
:class:`~sfq.engine.pool.PolicyQueue` per pool, of the policy with the slices as its limits,
over *stand-ins* of the gateway's candidates (a stand-in is a :class:`~sfq.engine.pool.Request`
with the charge the gateway's engine gave the candidate), so the order is the engine's (strict
classes first, then the weighted flows by start tag, look before you pop), and so are the
slots, buckets and busy period. The attempts that Redis granted before it was lost are adopted
as running. The meters start where the fleet's decider last had them (:meth:`Alone.restore` of
its :meth:`Alone.leads`, which each renewal brings when newer) and are dropped when Redis answers
again: the fleet's meters are the decider's, and a gateway alone only orders its own requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from ..cost import CostEstimator
from ..engine.pool import RUNNING, WAITING, PolicyQueue, Request, SharedLimits
from ..policy.classify import Flow
from ..policy.config import Policy
from ..policy.limits import TokenBucket

__all__ = ["Slices", "Alone", "sliced_policy"]


class Slices:
    """This gateway's part of every global limit: ``rank`` among ``n`` live gateways, equal
    parts; or, with ``tables`` (the decider's last two tables of the gateways' shares, each
    ``{gateway id: share}`` summing to 1, :func:`shares_table`), this gateway's part by its
    demand: the smaller of what the two tables give it (:func:`allocate`)."""

    __slots__ = ("rank", "n", "me", "tables")

    def __init__(self, rank: int, n: int, me: str = "", tables: Sequence[Mapping[str, float]] = ()) -> None:
        if n < 1 or not 0 <= rank < n:
            raise ValueError(f"a slice needs 0 <= rank < n, got rank {rank!r} of {n!r}")
        self.rank = rank
        self.n = n
        self.me = me
        self.tables = [t for t in tables if me in t]

    def count(self, limit: int) -> int:
        """This gateway's part of a count ``limit``: the parts of the ``n`` gateways add up to it."""
        if self.tables:
            return min(allocate(limit, t)[self.me] for t in self.tables)
        return limit // self.n + (1 if self.rank < limit % self.n else 0)

    def rate(self, per_minute: float) -> float:
        if self.tables:
            return per_minute * min(t[self.me] for t in self.tables)
        return per_minute / self.n

    def bucket(self, per_minute: float, now: float) -> TokenBucket:
        """A full bucket of this gateway's part of ``per_minute``."""
        return TokenBucket(self.rate(per_minute), now)

    def __repr__(self) -> str:
        return f"Slices(rank={self.rank}, n={self.n})"


#: the part of the gateways' shares spread equally over them (every live gateway gets some of
#: each limit while Redis is lost, whatever its demand was a moment before)
SPREAD = 0.1


def shares_table(demand: Mapping[str, float], live: Sequence[str]) -> dict[str, float]:
    """The decider's table of the live gateways' shares of every limit while Redis would be lost:
    each gateway's ``demand`` (the weights of the flows with work waiting or running there),
    plus :data:`SPREAD` of the whole spread equally (equal shares when nothing is demanded)."""
    ids = sorted(set(live))
    if not ids:
        return {}
    total = sum(max(0.0, demand.get(g, 0.0)) for g in ids)
    if total <= 0:
        return {g: 1.0 / len(ids) for g in ids}
    even = SPREAD / len(ids)  # (each demand over the total first: no product to underflow)
    return {g: (max(0.0, demand.get(g, 0.0)) / total + even) / (1 + SPREAD) for g in ids}


def allocate(limit: int, table: Mapping[str, float]) -> dict[str, int]:
    """A count ``limit`` split by ``table``'s shares: one each first when the limit has one for
    every gateway (a gateway whose demand was small when the table was made still starts its
    requests alone: a share of 4 % of 4 slots is none), then the rest by the shares: each its
    floor, then one more to the largest remainders (ties by id), so that the parts add up to
    ``limit`` exactly; every gateway computes the same split from the same table."""
    ids = sorted(table)
    base = 1 if ids and limit >= len(ids) else 0
    rest = limit - base * len(ids)
    exact = {g: rest * table[g] for g in ids}
    out = {g: int(math.floor(exact[g])) for g in ids}
    left = rest - sum(out.values())
    for g in sorted(ids, key=lambda g: (-(exact[g] - out[g]), g))[:max(0, left)]:
        out[g] += 1
    if base:
        for g in ids:
            out[g] += base
    return out


#: a limit's part: ``part(name, limit)``, ``name`` being ``pool:P``, ``backend:B``, ``org:O``
#: or ``class:C`` (the lease kinds of ``sfq.state._lua``)
Part = Callable[[str, int], int]


def sliced_policy(policy: Policy, part: Part, sl: Slices) -> Policy:
    """``policy`` with this gateway's part of every global limit as its limits: slots by
    ``part``, rates by ``sl`` (the pools' buckets; an org's rate is admission's, kept apart),
    and no queue length or age (the candidates' own waits are bounded where they wait)."""
    def rate(x: float | None) -> float | None:
        return None if not x else sl.rate(x)

    pools = {n: replace(p, limits=replace(p.limits, requests_per_minute=rate(p.limits.requests_per_minute),
                                          tokens_per_minute=rate(p.limits.tokens_per_minute),
                                          max_in_flight=None if p.limits.max_in_flight is None
                                          else part(f"pool:{n}", p.limits.max_in_flight)),
                        backends=tuple(replace(b, max_in_flight=part(f"backend:{b.name}", b.max_in_flight))
                                       for b in p.backends))
             for n, p in policy.pools.items()}
    classes = {n: replace(c, max_queue_length=None, max_queue_age_seconds=None,
                          max_in_flight=None if c.max_in_flight is None else part(f"class:{n}", c.max_in_flight))
               for n, c in policy.classes.items()}
    orgs = {n: replace(o, requests_per_minute=None,
                       max_in_flight=None if o.max_in_flight is None else part(f"org:{n}", o.max_in_flight))
            for n, o in policy.orgs.items()}
    t = policy.org_template
    if t is not None:
        t = replace(t, requests_per_minute=None,
                    max_in_flight=None if t.max_in_flight is None else sl.count(t.max_in_flight))
    return replace(policy, pools=MappingProxyType(pools), classes=MappingProxyType(classes),
                   orgs=MappingProxyType(orgs), org_template=t)


class Alone:
    """One gateway's decisions while Redis is lost: the engine's queue of each pool, of the
    sliced policy (:func:`sliced_policy`), over stand-ins of the gateway's candidates.

    ``add(member, flow, cost, tokens, backends)`` a candidate waiting for its grant (``cost``:
    the engine's charge at dispatch, ``price(member, cost)`` again when the engine's calibration
    moved; ``backends``: those it may go to); ``adopt(member, flow,
    backend)`` one that runs already (Redis granted it); ``next(pool)`` the next candidate that
    may start, ``(member, backend)``, charged and counted; ``remove(member)`` one that left
    waiting; ``done(member, actual_tokens)`` one whose attempt ended; ``correct(member, delta)``
    a correction of a running one's charge (cost units); ``wake_at(pool)`` when the pool may
    have something to start without any other event (a bucket refills)."""

    def __init__(self, policy: Policy, part: Part, sl: Slices, *, clock: Callable[[], float],
                 estimator: CostEstimator | None, floors: bool = False) -> None:
        self.policy = sliced_policy(policy, part, sl)
        self.clock = clock
        shared = SharedLimits(self.policy)
        self.queues = {name: PolicyQueue(self.policy, name, clock=clock, shared=shared, estimator=estimator)
                       for name in self.policy.pools}
        #: whether this queue applies the refund floors to the corrections it is told (the fleet's
        #: decider: the gateways' engines leave them to it); alone, the gateway's own engine's
        #: corrections arrive whole
        self.floors = floors
        for q in self.queues.values():
            q.refund_floors = floors and q.refund_floors
        self._in: dict[str, Request] = {}  # member -> its stand-in

    @classmethod
    def fleet(cls, policy: Policy, *, clock: Callable[[], float], estimator: CostEstimator | None) -> Alone:
        """The fleet's decider (``sfq.state._lead``): the engine's queues of the whole policy,
        every limit whole, over stand-ins of every gateway's candidates."""
        return cls(policy, _whole, Slices(0, 1), clock=clock, estimator=estimator, floors=True)

    def __contains__(self, member: str) -> bool:
        return member in self._in

    def add(self, member: str, flow: Flow, cost: float, tokens: float, backends: Collection[str],
            guess: bool = False, deadline_in: float | None = None) -> None:
        """``deadline_in``: seconds left to the candidate's deadline (it goes before its flow's
        requests due later, and is dropped here once past it, as its gateway drops it)."""
        if member in self._in:
            return
        c = float(cost)
        now = self.clock()
        r = Request(flow, c if c > 0 else 1e-9, float(tokens), now, None if deadline_in is None else now + deadline_in,
                    item=(member, frozenset(backends)))
        r.guess = bool(guess)
        self._in[member] = r
        self.queues[flow.pool].queue_new(r, r.arrival)

    def start(self, member: str, flow: Flow, cost: float, tokens: float, backend: str, guess: bool = False) -> None:
        """A candidate that Redis started at once on ``backend`` (nothing waited in its pool and
        every limit had room): charged and counted as the engine starts an uncontended request.
        Should the queue not start it (its view of the limits lags Redis's: a dead gateway's
        attempts not yet forgotten), it is counted as running anyway, uncharged."""
        if member in self._in:
            return
        self.add(member, flow, cost, tokens, (backend,), guess)
        r = self._in[member]
        q = self.queues[flow.pool]
        if q.pop(lambda x, b: x is r and b == backend) is r:  # (look before you pop: nothing else can start)
            return
        q.cancel(r)
        del self._in[member]
        self.adopt(member, flow, backend)

    def price(self, member: str, cost: float, guess: bool | None = None) -> None:
        """The candidate's charge at dispatch, priced again (the calibration moved since it was
        added): a waiting stand-in is charged this when it starts."""
        r = self._in.get(member)
        if r is not None and r.state == WAITING and cost > 0:
            r.cost = float(cost)
            if guess is not None:
                r.guess = bool(guess)

    def adopt(self, member: str, flow: Flow, backend: str) -> None:
        q = self.queues[flow.pool]
        if member in self._in or backend not in q.backends:
            return
        r = Request(flow, 1e-9, 0.0, self.clock(), item=(member, frozenset()))
        r.state, r.backend = RUNNING, backend
        q.adopt_running(r)
        self._in[member] = r

    def next(self, pool: str) -> tuple[str, str] | None:
        q = self.queues[pool]
        r = q.pop(_allowed)
        for x in q.expire():  # (past their deadline: their gateways drop them too)
            self._in.pop(x.item[0], None)
        if r is None:
            return None
        assert r.backend is not None
        return r.item[0], r.backend

    def remove(self, member: str) -> None:
        r = self._in.get(member)
        if r is not None and r.state == WAITING:
            del self._in[member]
            self.queues[r.flow.pool].cancel(r)

    def done(self, member: str, actual_tokens: float | None) -> None:
        r = self._in.pop(member, None)
        if r is not None and r.state == RUNNING:
            self.queues[r.flow.pool].finish(r, actual_tokens)

    def correct(self, member: str, delta: float) -> None:
        r = self._in.get(member)
        if r is not None and r.state == RUNNING:
            self.queues[r.flow.pool].correct(r, delta, self.floors)

    def undo(self, member: str) -> None:
        """A start :meth:`next` decided that did not happen (its candidate had left before the
        grant reached Redis): its charge taken back whole, its slots freed."""
        r = self._in.pop(member, None)
        if r is not None and r.state == RUNNING:
            q = self.queues[r.flow.pool]
            q.correct(r, -r.charged)
            q.finish(r, None)

    def members(self) -> tuple[set[str], set[str]]:
        """The members of the waiting stand-ins and of the running ones."""
        waiting: set[str] = set()
        running: set[str] = set()
        for m, r in self._in.items():
            (running if r.state == RUNNING else waiting).add(m)
        return waiting, running

    def meter(self, flow: Flow) -> float:
        return self.queues[flow.pool].meter(flow)

    def demand(self, policy: Policy) -> dict[str, float]:
        """Per gateway (a member's prefix): the weights of its flows with work waiting or running
        here, each flow once (what its slices follow should Redis be lost)."""
        flows: dict[str, set[Flow]] = {}
        for m, r in self._in.items():
            flows.setdefault(m.split(":", 1)[0], set()).add(r.flow)
        return {g: sum(policy.flow_weight(f.org, f.cls) for f in fs) for g, fs in flows.items()}

    def waiting(self, pool: str) -> int:
        """The stand-ins waiting in ``pool``."""
        return self.queues[pool].n_waiting

    def leads(self) -> dict[str, list[list[Any]]]:
        """Per pool, each flow's meter ahead of the pool's virtual time (meter units), for the
        flows with work here or a queue: what a new decider puts back (:meth:`restore`), so
        that the role moving does not forgive a flow the service it took ahead of the others.
        Nested shares (a tree of cores): none (their meters start level)."""
        out: dict[str, list[list[Any]]] = {}
        for name, q in self.queues.items():
            if q.nested:
                continue
            flows = {r.flow for r in self._in.values() if r.flow.pool == name}
            flows.update(q.flows)
            rows = [[list(f), lead] for f in flows if (lead := q.lead(f)) > 1e-9]
            if rows:
                out[name] = rows
        return out

    def restore(self, leads: Mapping[str, Any]) -> None:
        """Put back :meth:`leads` taken by an earlier decider: each flow's meter that far ahead
        of this one's virtual time (a bad row, or one past the core's bounds, is skipped)."""
        for name, rows in leads.items():
            q = self.queues.get(name)
            if q is None or q.nested or not isinstance(rows, list):
                continue
            for row in rows:
                try:
                    flow, lead = Flow(*row[0]), float(row[1])
                    if flow.pool != name or not (0.0 < lead < math.inf):
                        continue
                    q.set_lead(flow, lead)
                except (TypeError, ValueError, IndexError, OverflowError):
                    continue

    def wake_at(self, pool: str) -> float | None:
        return self.queues[pool].wake_at()

    def stats(self) -> dict[str, Any]:
        return {name: {"waiting": q.n_waiting, "in_flight": q.in_flight} for name, q in self.queues.items()}


def _whole(name: str, limit: int) -> int:
    return limit


def _allowed(r: Request, backend: str) -> bool:
    """The look-before-pop check: a stand-in goes only to a backend its candidate may use."""
    return backend in r.item[1]
