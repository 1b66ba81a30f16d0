"""One pool's queue under a policy: strict FIFOs, the SFQ core, limits, deadlines, the charge.

A :class:`PolicyQueue` answers, synchronously and on an injected clock: "which request may
start now, and on which backend?" (:meth:`PolicyQueue.pop`), "it delivered this much"
(:meth:`PolicyQueue.delivered`, :meth:`PolicyQueue.settle`) and "this attempt ended"
(:meth:`PolicyQueue.finish`). The gateway's driver, the library's ``Dispatcher`` and the
simulator all run this code; none of them drives the SFQ core itself.

The request's charge (``sfq.policy.charge``): a flow's entry in the core is enqueued at a lower
bound of its head's cost (the prompt's); the request is estimated again and charged when it
is dispatched (the calibration may have learned meanwhile), and only once a backend takes it:
the pool *looks before it pops* (``peek``), so a request that fits no backend with room
waits uncharged, first in line (or, with ``overtake``, set aside while later ones go). In
``settle`` and ``served`` its work is reported as its flow's (``work_started(flow)``) until
its attempt ends, so the busy period stays open while the fleet works and a flow whose
request runs keeps its meter (its lag) when its next request arrives; ``served`` charges a
stream's output tokens as they are delivered; both settle to the clamped usage at the end
(docs/design.md §4-§5).

Order within a pool:

1. **Strict classes**, in the order the policy lists them, first come first served, each
   capped by its ``max_in_flight`` (so urgent work never takes the whole pool).
2. **Weighted classes** share the rest by cost on the SFQ core (``sfq.Scheduler``): every
   flow ``(org, class, pool)`` has weight org x class. The core holds one entry per flow (the
   flow's next turn); when the flow wins, the request that goes is chosen inside the flow by
   the size buckets (small first, but after ``small_picks`` small ones in a row the oldest
   large one), and the flow is charged that request's cost (``adjust`` corrects the entry's
   provisional cost), so the flow's share does not depend on the order within it. SFQ picks
   by start tag, which does not depend on the head's cost, so choosing the request at
   dispatch time changes no decision between flows.

Limits: a flow whose org (or class) is at its ``max_in_flight`` leaves the competition
(``suspend``) and rejoins at ``max(S, v)`` when a slot frees (``resume``): it blocks no one
and banks no credit. Pool-wide limits (the pool's ``max_in_flight``, backend slots, the
``requests_per_minute`` and ``tokens_per_minute`` buckets, backends paused by a 429) hold
the whole pool: requests keep their places in the fair queue until the limit allows the next.
A request that took its org's ``requests_per_minute`` token ahead (``on_limit: wait``: the
engine's admission) is *parked* until that token refills (``Request.ready_at``): counted as
waiting, but in no flow and not in the core, it then joins its flow as a request arriving then.
A waiting request is dropped the moment its class's ``max_queue_age_seconds``, its own
``max_wait`` (the smaller of the two is its queue age bound) or its own deadline runs out
(:meth:`PolicyQueue.expire`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import logging

from .._core import Scheduler
from ..cost import CostEstimator, Estimate
from ..errors import Refused
from ..policy.charge import ChargeMode
from ..policy.classify import Flow
from ..policy.config import ClassSpec, Policy, PoolSpec
from ..policy.limits import Slots, TokenBucket
from ..policy.spend import Hold
from ._floors import RefundFloors
from .tree import TreeScheduler

__all__ = ["Fits", "PolicyQueue", "Request", "SharedLimits", "WAITING", "RUNNING", "BACKOFF", "ENDED"]

# request states
WAITING, RUNNING, BACKOFF, ENDED = "waiting", "running", "backoff", "ended"
_INF = math.inf
_ids = itertools.count(1)
#: seconds of ended attempts the pool's measured service is taken over (``PolicyQueue.service``)
SERVICE_WINDOW = 60.0
#: the most ended attempts kept for it (the latest)
SERVICE_SAMPLES = 4096
#: ended attempts in the window before anything is predicted from it
SERVICE_MIN_SAMPLES = 8
log = logging.getLogger("sfq.engine")


class Request:
    """One request as the policy tracks it. ``cost`` is in cost units (the scheduler's),
    ``tokens`` the token estimate debited from ``tokens_per_minute`` at start; ``deadline``
    is absolute (the clock's seconds) or ``None``; ``item`` is the caller's."""

    __slots__ = ("id", "flow", "cost", "tokens", "need", "arrival", "queued_at", "deadline", "drop_at", "cpt",
                 "drop_reason", "item", "state", "backend", "started_at", "tries", "idempotency_key",
                 "outcome", "reason", "small", "retrying", "est", "epoch", "streaming", "charged", "delivered",
                 "work_flow", "working", "in_core", "avoid", "start_tag", "fixed", "hold",
                 "charged_total", "guess", "max_wait", "ready_at")

    def __init__(self, flow: Flow, cost: float, tokens: float, arrival: float, deadline: float | None = None,
                 item: Any = None, need: float = 0.0, idempotency_key: str | None = None,
                 est: Estimate | None = None, epoch: int = -1, streaming: bool = False) -> None:
        self.id = next(_ids)
        self.flow = flow
        self.cost = cost
        self.tokens = tokens
        self.need = need  # prompt + max_tokens of one sequence (backend max_context)
        self.arrival = arrival
        self.queued_at = arrival
        self.deadline = deadline
        #: seconds it may wait for each start (its own queue age bound, next to its class's
        #: ``max_queue_age_seconds``: the smaller applies); inf: none of its own
        self.max_wait = _INF
        self.drop_at = _INF
        self.drop_reason = ""
        self.item = item
        self.state = WAITING
        self.backend: str | None = None
        self.started_at: float | None = None
        self.tries = 0  # attempts started
        self.idempotency_key = idempotency_key
        self.outcome: str | None = None
        self.reason: str | None = None
        self.small = True
        self.retrying = False  # the current attempt is a retry (counted in the retry budget)
        self.est = est  # the estimate (None: ``cost`` is a fixed charge, never corrected)
        self.epoch = epoch  # the estimator's calibration epoch ``est`` was made in
        self.streaming = streaming  # a stream: in ``served`` mode its output is charged as delivered
        self.charged = 0.0  # cost units charged to the flow's meter for the current attempt
        self.charged_total = 0.0  # cost units charged for its attempts that ended (every correction made)
        self.delivered = 0.0  # output tokens the current attempt passed to its client
        self.cpt = 0.0  # characters per output token its text counts at (0: not read yet)
        self.work_flow: Hashable = None  # the flow its work in flight is reported as (None: the pool's)
        self.working = False  # its work in flight is reported to the core (work_started, not yet done)
        self.in_core = False  # the current attempt was dispatched by the SFQ core (a weighted class)
        self.avoid: str | None = None  # a backend a retry should avoid when another can take it
        self.start_tag = 0.0  # cost units: its flow's meter when the core dispatched it (= v then)
        self.fixed = est is None  # ``cost`` is charged as given, never re-estimated or corrected
        self.hold: Hold | None = None  # its spend's reservation (a pool with prices), settled when it ends
        #: whether its charge is a guess (``guessed``), when another engine priced it (a stand-in
        #: of a gateway's candidate, ``sfq.state``); ``None``: the estimator says
        self.guess: bool | None = None
        #: clock time its org's ``requests_per_minute`` reserved its token for (``on_limit:
        #: wait``): until then it is parked, out of the competition (no slot, no place in the core:
        #: :meth:`PolicyQueue.pop` joins it to its flow then); ``-inf``: not parked
        self.ready_at = -_INF

    def __repr__(self) -> str:
        return (f"Request(#{self.id} {self.flow.org}/{self.flow.cls}/{self.flow.pool} cost={self.cost:g} "
                f"state={self.state}{' outcome=' + self.outcome if self.outcome else ''})")


class SharedLimits:
    """Limits that span pools: every org's and class's ``max_in_flight`` (and their members
    in each pool's queue, to suspend and resume them)."""

    def __init__(self, policy: Policy) -> None:
        self.slots: dict[tuple[str, str], Slots] = {}
        for o in policy.orgs.values():
            if o.max_in_flight is not None:
                self.slots[("org", o.name)] = Slots(f"orgs.{o.name}.max_in_flight", o.max_in_flight)
        for c in policy.classes.values():
            if c.max_in_flight is not None:
                self.slots[("class", c.name)] = Slots(f"classes.{c.name}.max_in_flight", c.max_in_flight)
        self.queues: list[PolicyQueue] = []
        self.policy = policy
        t = policy.org_template
        #: whether an org the file does not name may bring a limit of its own (its template's)
        self.lazy = t is not None and t.max_in_flight is not None

    def groups(self, flow: Flow) -> tuple[tuple[str, str], ...]:
        if not self.slots and not self.lazy:  # no org or class limits at all
            return ()
        g = ("org", flow.org)
        if g not in self.slots:  # an org the file does not name (its template's limit applies)
            o = self.policy.org(flow.org)
            if o is not None and o.max_in_flight is not None and o.name not in self.policy.orgs:
                self.slots[g] = Slots(f"org_template.max_in_flight ({flow.org})", o.max_in_flight)
        return tuple(g for g in (("org", flow.org), ("class", flow.cls)) if g in self.slots)

    def room(self, flow: Flow) -> bool:
        """Whether the flow's org and class have a free slot."""
        s = self.slots
        o = s.get(("org", flow.org))
        if o is not None and o.full:
            return False
        c = s.get(("class", flow.cls))
        return c is None or not c.full

    def acquire(self, flow: Flow) -> None:
        for g in self.groups(flow):
            sl = self.slots[g]
            sl.acquire()
            if sl.full:
                for q in self.queues:
                    q._group_full(g)

    def release(self, flow: Flow) -> None:
        for g in self.groups(flow):
            sl = self.slots[g]
            was_full = sl.full
            sl.release()
            if was_full:
                for q in self.queues:
                    q._group_free(g)


def guessed(r: Request, estimator: CostEstimator) -> bool:
    """Whether ``r``'s charge at dispatch is a guess its settlement may correct by much: an
    estimate at the prior ratio (no usage report has calibrated its flow or its model yet, as
    on a fleet that just started). A flow that sets ``v`` alone on such charges gets a refund
    floor (``_floors``)."""
    g = r.guess
    if g is not None:
        return g
    e = r.est
    return e is not None and not r.fixed and estimator.on_prior(e.model, r.flow)


def _by_id(r: Request) -> int:
    return r.id


#: the driver's check that a backend (by name) can take a request now (``PolicyQueue.pop``)
Fits = Callable[["Request", str], bool]


class _FlowQ:
    """A weighted flow's waiting requests: those with a deadline of their own in a heap,
    nearest deadline first (``edf``, made with the first of them: EDF inside the flow,
    docs/design.md §5d), the others in two size buckets (both FIFO); and its entry in the core
    (``token``: the core's ticket, ``None`` when it has none). It exists while the flow has
    requests waiting (``PolicyQueue._flow_queue`` makes it, ``_emptied`` forgets it)."""

    __slots__ = ("flow", "spec", "small", "large", "n", "run", "token", "token_cost", "groups", "aside", "named",
                 "edf")

    def __init__(self, flow: Flow, spec: ClassSpec, groups: tuple[tuple[str, str], ...], run: int = 0) -> None:
        self.flow = flow
        self.spec = spec
        self.small: deque[Request] = deque()
        self.large: deque[Request] = deque()
        self.n = 0  # live waiting requests
        self.run = run  # small picks in a row since the last large one
        self.token: int | None = None
        self.token_cost = 0.0
        self.groups = groups
        self.aside = False  # its head fits no backend with room: suspended so that others overtake
        self.named = True  # its org is named in the policy file (its small-pick run outlives the queue)
        #: the requests with a deadline of their own, as ``(drop_at, arrival number, request)``:
        #: a min-heap, left requests cleaned lazily at its top; ``None`` until the flow has one
        self.edf: list[tuple[float, int, Request]] | None = None

    @staticmethod
    def _head(d: deque[Request]) -> Request | None:
        while d and d[0].state != WAITING:
            d.popleft()
        return d[0] if d else None

    def preferred(self) -> Request | None:
        """The request that goes when the flow next wins (does not remove it): the nearest
        deadline (ties: the first queued), else the size buckets' choice."""
        if self.edf:
            e = self.edf
            while e and e[0][2].state != WAITING:
                heapq.heappop(e)
            if e:
                return e[0][2]
        s = self._head(self.small)
        big = self._head(self.large) if self.large else None
        if s is None:
            return big
        if big is None or self.run < self.spec.small_picks:
            return s
        return big

    def take(self, r: Request) -> None:
        """Take ``r``, the request :meth:`preferred` named, out of the queue."""
        self.n -= 1
        if self.edf and self.edf[0][2] is r:
            heapq.heappop(self.edf)  # (a deadline's pick leaves the small-pick run as it was)
            return
        d = self.small if r.small else self.large
        assert d[0] is r
        d.popleft()
        self.run = self.run + 1 if r.small else 0

    def clear(self) -> None:
        """Forget the requests left in it (none waits any more)."""
        self.small.clear()
        self.large.clear()
        self.edf = None

    def requests(self) -> Iterator[Request]:
        """Its requests still in it (those that left are skipped by the caller's state test)."""
        yield from self.small
        yield from self.large
        if self.edf:
            for x in self.edf:
                yield x[2]

    def oldest_arrival(self) -> float:
        heads = [h.queued_at for h in (self._head(self.small), self._head(self.large)) if h is not None]
        if self.edf:  # O(its requests with a deadline): for readouts and a full class's Retry-After
            heads.extend(x[2].queued_at for x in self.edf if x[2].state == WAITING)
        return min(heads) if heads else _INF


class _Backend:
    __slots__ = ("name", "limit", "in_flight", "paused_until", "healthy", "saturated", "max_context")

    def __init__(self, name: str, limit: int, max_context: int | None) -> None:
        self.name = name
        self.limit = limit  # requests at once
        self.in_flight = 0  # requests running there
        self.paused_until = -_INF  # clock seconds: an upstream 429 pauses it until then
        self.healthy = True  # in rotation (the driver's health checks say so)
        self.saturated = False  # in rotation but full by its own report (a saturation probe)
        self.max_context = max_context  # tokens one sequence may need (None: no limit)

    def open(self, now: float) -> bool:
        """Whether it may take a request now (healthy, not saturated, not paused, a free slot)."""
        return self.healthy and not self.saturated and self.in_flight < self.limit and self.paused_until <= now


class PolicyQueue:
    """A pool's queue and limits. ``clock`` gives seconds; ``scheduler`` makes the core
    (default ``sfq.Scheduler``); ``charge``: the charge mode (``sfq.policy.charge``);
    ``estimator``: re-estimates a request at dispatch and prices delivered tokens. Not
    thread-safe; call it from one thread (one event loop)."""

    def __init__(self, policy: Policy, pool: str, *, clock: Callable[[], float],
                 shared: SharedLimits | None = None, scheduler: Callable[[], Any] | None = None,
                 charge: str | None = None, estimator: CostEstimator | None = None) -> None:
        if pool not in policy.pools:
            raise ValueError(f"unknown pool {pool!r}; pools: {', '.join(policy.pools)}")
        if not callable(clock):
            raise TypeError(f"clock must be callable, got {clock!r}")
        self.policy = policy
        self.charge = ChargeMode(policy.cost.charge if charge is None else charge)
        self.served = self.charge is ChargeMode.SERVED
        self.seed = self.charge is ChargeMode.SEED  # charged once at dispatch, never corrected (an enum
        # member's lookup costs 0.2 µs on Python 3.11: the hot paths test this field)
        cs = policy.cost
        self.estimator = estimator if estimator is not None else CostEstimator(
            cs.input_weight, cs.output_weight, default_max_tokens=cs.default_max_tokens, prior_ratio=cs.prior_ratio,
            cached_input_weight=cs.cached_input_weight)
        self.spec: PoolSpec = policy.pools[pool]
        self.name = pool
        self.clock = clock
        self.shared = shared if shared is not None else SharedLimits(policy)
        self.shared.queues.append(self)
        now = clock()
        lim = self.spec.limits
        self.rpm = TokenBucket(lim.requests_per_minute, now) if lim.requests_per_minute else None
        self.tpm = TokenBucket(lim.tokens_per_minute, now) if lim.tokens_per_minute else None
        self.slots = Slots(f"pools.{pool}.limits.max_in_flight", lim.max_in_flight)
        #: ``limits.headroom`` (0: off): see :meth:`_may_take`
        self.headroom = lim.headroom
        self._run_n: dict[Flow, int] = {}  # running requests per flow (kept while headroom is on)
        self.backends: dict[str, _Backend] = {
            b.name: _Backend(b.name, b.max_in_flight, b.max_context) for b in self.spec.backends}
        self.largest_context = (_INF if any(b.max_context is None for b in self.spec.backends)
                                else float(max(b.max_context or 0 for b in self.spec.backends)))
        make: Callable[[], Any] = scheduler if scheduler is not None else Scheduler
        #: nested shares (teams, users): a tree of cores (``sfq.engine.tree``); else one core, as always
        self.nested = policy.nested
        self.sched: Any = TreeScheduler(policy, make) if self.nested else make()
        self.strict = {c: deque[Request]() for c in policy.strict_classes}
        self._strict_n = dict.fromkeys(self.strict, 0)
        #: the weighted flows with requests waiting (made on first use, forgotten when empty:
        #: memory follows the flows with work, not the orgs the file names)
        self.flows: dict[Flow, _FlowQ] = {}
        #: the small-pick run of an emptied flow of an org the file names, when not 0 (so that a
        #: queue made again picks as the one forgotten would have)
        self._runs: dict[Flow, int] = {}
        self._group_members: dict[tuple[str, str], dict[Flow, _FlowQ]] = {}
        self.waiting_by_class = dict.fromkeys(policy.classes, 0)
        self.n_waiting = 0  # requests waiting, every class
        self.in_flight = 0
        self._drops: list[tuple[float, int, Request]] = []  # (drop_at, id, request), lazily cleaned
        self._arrivals = 0  # requests with a deadline queued so far (their order among equal deadlines)
        #: requests parked until their org's rate refills (``Request.ready_at``): ``(ready_at, id,
        #: request)``, lazily cleaned; counted as waiting (their class's places, ``n_waiting``) but
        #: in no flow and not in the core, so they hold no slot and delay no one
        self.parked: list[tuple[float, int, Request]] = []
        self.n_parked = 0  # requests parked (live entries of ``parked``)
        self._dropped: list[Request] = []  # dropped by pop(), not yet handed out by expire()
        #: seconds a waiting request may wait while no backend of the pool is in rotation
        #: before it is answered (reason ``unavailable``); counted from its arrival or from the
        #: start of the outage, whichever is later (0: at once)
        self.unavailable_timeout = 0.0
        self.down_since: float | None = None  # when the pool lost its last backend in rotation
        self._starts: dict[str, deque[float]] = {c: deque() for c in policy.classes}  # last minute's starts
        self.blocked_until = -_INF  # when a bucket or a paused backend next allows a start
        #: how many flows whose head fits no backend with room may be set aside (suspended,
        #: uncharged) so that later ones go out; 0: everything waits behind such a head
        self.overtake = 0
        self.aside: list[_FlowQ] = []  # the flows set aside, oldest first
        #: the request first in line that fits no backend with room, as the last pop() found it
        #: (everything waits behind it, uncharged); None when there is none
        self.stalled: Request | None = None
        #: a shared ledger (several gateways, ``sfq.state``): told of every correction of a
        #: running request's charge after the core took it (cost units), so that the shared
        #: meter moves as this one does; ``None`` in memory
        self.on_charge: Callable[[Request, float], None] | None = None
        #: how far refunds may take the meters of flows that set v alone (``_floors``)
        self._floors = RefundFloors()
        #: no flow of this pool is ever suspended in the core by a limit or nested in a tree:
        #: flat flows, and no org or class ``max_in_flight`` (nor a template's, made on first
        #: use); the policy of a queue never changes (a reload makes new queues)
        self._plain = not self.nested and not self.shared.slots and not self.shared.lazy
        #: whether this queue applies the refund floors itself (``False`` when a shared ledger
        #: applies them, with the order it decides: ``sfq.state``; and under nested shares,
        #: where the floors are not defined yet: docs/design.md, "Nested shares")
        self.refund_floors = not self.nested
        #: flows of orgs the file does not name may have a weight other than 1 (a template's, or
        #: a Dispatcher's ``set_weight``, kept by the policy): their weight is told to the core
        #: again on each return, so the core is told to forget it (weight 1) once such a flow has
        #: nothing waiting or running, and then forgets the flow once ``v`` passes its meter
        self._unnamed_weights = not self.nested and (policy.org_template is not None or hasattr(policy, "weights"))
        #: the attempts that ended in the last :data:`SERVICE_WINDOW` seconds, ``(end, seconds
        #: it held its slot, its cost)``, with their sums: the pool's measured service
        #: (``unmeetable``, ``predicted_wait``)
        self._done: deque[tuple[float, float, float]] = deque()
        self._held_sum = 0.0
        self._cost_sum = 0.0

    def _flow_queue(self, f: Flow) -> _FlowQ:
        """The weighted flow's queue, made when a request of the flow comes to wait (again):
        its weight told to the core, and the flow suspended there while one of its org's or
        class's ``max_in_flight`` is full."""
        fq = self.flows.get(f)
        if fq is not None:
            return fq
        spec = self.policy.classes[f.cls]
        fq = self.flows[f] = _FlowQ(f, spec, () if self._plain else self.shared.groups(f), self._runs.pop(f, 0))
        fq.named = f.org in self.policy.orgs and len(f) == 3  # (a team's or user's queue: _drop_nested)
        w = self.policy.flow_weight(f.org, f.cls)
        if fq.named or w != 1.0:  # (the core's default weight is 1: nothing to tell it)
            self.sched.set_weight(f, w)
        full = False
        for g in fq.groups:
            self._group_members.setdefault(g, {})[f] = fq
            full = full or self.shared.slots[g].full
        if full:
            self.sched.suspend(f)
        return fq

    # ------------------------------------------------------------ admission
    def __len__(self) -> int:
        return sum(self.waiting_by_class.values())

    def make_room(self, flow: Flow) -> Request | None:
        """Where a request of ``flow`` may wait: ``None`` when its class has room in this pool;
        when the class is at its ``max_queue_length``, the waiting request that gives its place
        up (the newest of the org holding the most places: queue space is shared fairly, as
        Kubernetes APF's per-queue limits share it), or ``Refused("queue_full")`` when
        ``flow``'s org already holds the most. Changes nothing: the caller evicts the request
        returned once it accepts the new one."""
        cls = flow.cls
        spec = self.policy.classes[cls]
        if spec.max_queue_length is None or self.waiting_by_class[cls] < spec.max_queue_length:
            return None
        held: dict[str, int] = {}
        newest: dict[str, Request] = {}
        if cls in self.strict:
            for r in self.strict[cls]:
                if r.state == WAITING:
                    held[r.flow.org] = held.get(r.flow.org, 0) + 1
                    newest[r.flow.org] = r
        else:
            for f, fq in self.flows.items():
                if f.cls == cls and fq.n:
                    held[f.org] = held.get(f.org, 0) + fq.n
                    for d in (fq.small, fq.large):  # (left requests stay in a deque until they reach its head)
                        last = next((x for x in reversed(d) if x.state == WAITING), None)
                        o = newest.get(f.org)
                        if last is not None and (o is None or last.id > o.id):
                            newest[f.org] = last
                    if fq.edf:  # (those with a deadline: the newest of them, O(them))
                        last = max((x[2] for x in fq.edf if x[2].state == WAITING), key=_by_id, default=None)
                        o = newest.get(f.org)
                        if last is not None and (o is None or last.id > o.id):
                            newest[f.org] = last
        if self.n_parked:  # requests parked until their org's rate refills hold places too
            for _, _, x in self.parked:
                if x.state == WAITING and x.ready_at > -_INF and x.flow.cls == cls:
                    org = x.flow.org
                    held[org] = held.get(org, 0) + 1
                    o = newest.get(org)
                    if o is None or x.id > o.id:
                        newest[org] = x
        top = max(held, key=lambda o: (held[o], o in newest), default=None)
        if top is not None and cls not in self.strict:
            top = self._first_of_tied(held, newest, top)
        mine = held.get(flow.org, 0)
        if top is None or mine >= held[top] or top not in newest:
            raise Refused("queue_full", f"class {cls!r} already has {self.waiting_by_class[cls]} requests waiting in "
                                        f"pool {self.name!r} (max_queue_length {spec.max_queue_length}) and org "
                                        f"{flow.org!r} holds the most of them ({mine})",
                          retry_after=self.place_frees_in(cls))
        return newest[top]

    def _first_of_tied(self, held: dict[str, int], newest: dict[str, Request], top: str) -> str:
        """Among the orgs tied with ``top`` (as many places held, as able to give one up): the
        first in the policy file, else the one whose flow queue was made first. That is the
        order the flows' queues had when those of every org the file names were made at start
        and kept, so which org gives a place up does not depend on which flow emptied last.
        O(orgs) for a tie only."""
        best = (held[top], top in newest)
        tied = [o for o in held if (held[o], o in newest) == best]
        if len(tied) == 1:
            return top
        named = {o for o in tied if o in self.policy.orgs}
        if not named:
            return tied[0]  # (held is in the order the queues were made)
        return next(o for o in self.policy.orgs if o in named)

    def evict(self, r: Request) -> None:
        """Take the waiting request ``r`` out of the queue, uncharged, to give its place to
        another org's request (:meth:`make_room`); its reason is ``queue_full``."""
        if r.state != WAITING or r.flow.pool != self.name:
            raise ValueError(f"evict({r!r}): the request is not waiting in pool {self.name!r}")
        self._unqueue(r)
        r.reason = "queue_full"

    def place_frees_in(self, cls: str) -> float:
        """Seconds until a waiting place of ``cls`` is expected to free: the sooner of the
        class's mean gap between starts over the last minute and the time at which its oldest
        waiting request runs out of queue age (by then it has started or been dropped); the
        window (60 s) when neither is known."""
        now = self.clock()
        best = _INF
        st = self._starts[cls]
        while st and st[0] <= now - 60.0:
            st.popleft()
        if st:
            best = 60.0 / len(st) if now - st[0] >= 1.0 else (now - st[0] + 1.0) / len(st)
        age = self.policy.classes[cls].max_queue_age_seconds
        if age is not None:
            oldest = self._oldest(cls)
            if oldest < _INF:
                best = min(best, max(0.0, oldest + age - now))
        return 60.0 if best == _INF else best

    def _oldest(self, cls: str) -> float:
        if cls in self.strict:
            d = self.strict[cls]
            return d[0].queued_at if d else _INF
        return min((fq.oldest_arrival() for f, fq in self.flows.items() if f.cls == cls), default=_INF)

    def push(self, r: Request, *, queued_at: float | None = None) -> None:
        """Queue ``r`` (state WAITING) in its flow again: an accepted request back for a retry,
        or carried over by a policy reload, so its class's ``max_queue_length`` is not checked
        (a new request's place is :meth:`make_room`'s). ``ValueError`` when no backend of the
        pool could ever take it (``max_context``). ``queued_at``: when it joined the queue
        (default now; a policy reload keeps its age)."""
        flow = r.flow
        if flow.pool != self.name:
            raise ValueError(f"request of pool {flow.pool!r} pushed to pool {self.name!r}")
        spec = self.policy.classes.get(flow.cls)
        if spec is None or not self.policy.allows(flow):
            raise ValueError(f"flow {flow!r} is not allowed by the policy")
        if r.need > self.largest_context:
            raise ValueError(f"the request needs about {r.need:.0f} tokens, more than any backend of pool "
                             f"{self.name!r} takes ({self.largest_context:.0f})")
        if not (math.isfinite(r.cost) and r.cost > 0):
            raise ValueError(f"cost must be a finite number > 0, got {r.cost!r}")
        self.queue_new(r, self.clock() if queued_at is None else queued_at, spec)

    def queue_new(self, r: Request, now: float, spec: ClassSpec | None = None) -> None:
        """:meth:`push` without its checks, for a request the caller checked (the engine's
        ``submit``): its flow allowed, its need and cost in range, its class's queue not full."""
        flow = r.flow
        if spec is None:
            spec = self.policy.classes[flow.cls]
        r.state = WAITING
        r.queued_at = now
        age = spec.max_queue_age_seconds
        at_age = now + age if age is not None else _INF
        if r.max_wait < _INF and now + r.max_wait < at_age:  # its own bound, when the smaller
            at_age = now + r.max_wait
        at_deadline = r.deadline if r.deadline is not None else _INF
        r.drop_at = at_age if at_age < at_deadline else at_deadline
        r.drop_reason = "deadline" if at_deadline <= at_age else "queue_timeout"
        if r.ready_at > -_INF:  # its org's rate: parked until its token comes (pop joins it then)
            heapq.heappush(self.parked, (r.ready_at, r.id, r))
            self.n_parked += 1
        else:
            self._join(r, spec)
        self.waiting_by_class[flow.cls] += 1
        self.n_waiting += 1
        if r.drop_at < _INF:
            heapq.heappush(self._drops, (r.drop_at, r.id, r))

    def _join(self, r: Request, spec: ClassSpec) -> None:
        """``r`` (counted as waiting) takes its place in its flow: its strict class's FIFO, or
        its flow's size bucket, the flow entering the core if it had no entry."""
        flow = r.flow
        if spec.strict:
            self.strict[flow.cls].append(r)
            self._strict_n[flow.cls] += 1
        else:
            fq = self._flow_queue(flow)
            r.small = spec.small_cost is None or r.cost <= spec.small_cost
            if r.deadline is None:
                (fq.small if r.small else fq.large).append(r)
            else:  # EDF inside the flow: nearest deadline first, ties in queue order (design.md §5d)
                e = fq.edf
                if e is None:
                    e = fq.edf = []
                self._arrivals += 1
                heapq.heappush(e, (r.drop_at, self._arrivals, r))
            fq.n += 1
            if fq.token is None:
                self._enter(fq)

    def _unpark(self, now: float) -> None:
        """Join to their flows, in the order of their tokens, the parked requests whose token
        has come by ``now``: each rejoins the competition as a request arriving then (its flow
        at ``max(S, v)``: it banks no credit for the wait), its queue age counted from its
        arrival."""
        parked = self.parked
        classes = self.policy.classes
        while parked and parked[0][0] <= now:
            at, _, r = heapq.heappop(parked)
            if r.state == WAITING and r.ready_at == at:
                r.ready_at = -_INF
                self.n_parked -= 1
                self._join(r, classes[r.flow.cls])

    def next_unpark(self) -> float | None:
        """When the next parked request's token comes (``None``: none is parked)."""
        parked = self.parked
        while parked and (parked[0][2].state != WAITING or parked[0][2].ready_at != parked[0][0]):
            heapq.heappop(parked)
        return parked[0][0] if parked else None

    def _enter(self, fq: _FlowQ) -> None:
        """Give the flow its entry in the core (its next turn), at a lower bound of its head's
        charge: the prompt's cost (the charge is estimated at dispatch, when the calibration may
        have learned more; SFQ selects by the flows' meters, not by their heads' costs, so this
        changes no order, and the dispatch corrects the meter at once). A fixed cost as given."""
        head = fq.preferred()
        assert head is not None
        c = fq.token_cost = self._entry_cost(head)
        fq.token = self.sched.enqueue(fq.flow, c, fq)

    def _entry_cost(self, r: Request) -> float:
        """What ``r`` enters the core at (:meth:`_enter`): its prompt's cost, or a fixed cost."""
        e = r.est
        if e is None or r.fixed:
            return r.cost
        est = self.estimator
        c = est.input_weight * e.charged_prompt
        return est.min_cost if c < est.min_cost else c

    def _unqueue(self, r: Request) -> None:
        """Bookkeeping for a waiting request that leaves without starting."""
        r.state = ENDED
        cls = r.flow.cls
        self.waiting_by_class[cls] -= 1
        self.n_waiting -= 1
        if r.ready_at > -_INF:  # parked: in no flow yet (its heap entry goes lazily)
            self.n_parked -= 1
            if not self.n_parked:
                self.parked.clear()
            return
        if cls in self.strict:
            self._strict_n[cls] -= 1
            self.strict[cls].remove(r)
            return
        fq = self.flows[r.flow]
        fq.n -= 1
        if fq.n == 0 and fq.token is not None:
            self.sched.cancel(fq.token)
            fq.token = None
            self._emptied(fq)
            fq.clear()

    def cancel(self, r: Request) -> bool:
        """Remove a waiting request, uncharged. ``False`` if it is not waiting here."""
        if r.state != WAITING or r.flow.pool != self.name:
            return False
        self._unqueue(r)
        return True

    def expire(self) -> list[Request]:
        """Drop every waiting request whose queue age or deadline has run out by now; each gets
        ``reason`` ``queue_timeout`` or ``deadline``. Returns them, and those :meth:`pop`
        dropped since the last call (oldest deadline first)."""
        if self._drops or self.down_since is not None:
            self._drop_expired(self.clock())
        if not self._dropped:
            return []
        out, self._dropped = self._dropped, []
        return out

    def _drop_expired(self, now: float) -> None:
        drops = self._drops
        while drops and drops[0][0] <= now:
            at, _, r = heapq.heappop(drops)
            if r.state == WAITING and r.drop_at == at:
                self._unqueue(r)
                r.reason = r.drop_reason
                self._dropped.append(r)
        if self.down_since is not None:
            gone = [r for r in self.iter_waiting() if self._unavailable_at(r) <= now]
            for r in gone:
                self._unqueue(r)
                r.reason = "unavailable"
                self._dropped.append(r)

    def _unavailable_at(self, r: Request) -> float:
        assert self.down_since is not None
        return max(self.down_since, r.queued_at) + self.unavailable_timeout

    def set_available(self, available: bool) -> None:
        """Whether any backend of the pool is in rotation (saturated or not). While none is,
        waiting requests are answered after :attr:`unavailable_timeout` (``unavailable``)
        rather than wait for a backend that may never come back."""
        if available:
            self.down_since = None
        elif self.down_since is None:
            self.down_since = self.clock()

    def next_drop(self) -> float | None:
        """When the next waiting request runs out of queue age or deadline, or of
        ``unavailable_timeout`` during an outage (``None``: never)."""
        drops = self._drops
        while drops and (drops[0][2].state != WAITING or drops[0][2].drop_at != drops[0][0]):
            heapq.heappop(drops)
        t = drops[0][0] if drops else None
        if self.down_since is not None:  # an outage: O(waiting) while it lasts, never otherwise
            u = min((self._unavailable_at(r) for r in self.iter_waiting()), default=None)
            if u is not None and (t is None or u < t):
                t = u
        return t

    # ------------------------------------------------------------ limits and suspension
    def _group_full(self, g: tuple[str, str]) -> None:
        for fq in self._group_members.get(g, {}).values():
            self.sched.suspend(fq.flow)

    def _group_free(self, g: tuple[str, str]) -> None:
        slots = self.shared.slots
        for fq in self._group_members.get(g, {}).values():
            if not fq.aside and not any(slots[h].full for h in fq.groups):
                self.sched.resume(fq.flow)

    def _emptied(self, fq: _FlowQ) -> None:
        """``fq`` has no waiting request left: it leaves the aside and is forgotten, so that
        memory follows the flows with work, not every org the file names or every id ever
        seen. Nothing a decision needs goes with it: the flow's meter lives in the core (which
        keeps it while it is above ``v`` or the flow has a weight of its own, and otherwise
        forgets it, as it may: the flow rejoins at ``max(S, v) = v``); its weight and
        suspension are told to the core again when it next has a request waiting
        (:meth:`_flow_queue`); an org the file names keeps its small-pick run (``_runs``). A
        flow left suspended in the core by a full ``max_in_flight`` is resumed as it goes (it
        has nothing waiting, so nothing competes; made again while the group is full, it is
        suspended again)."""
        if fq.aside:
            self._unaside(fq)
        if len(fq.flow) > 3:
            self._drop_nested(fq)
            return
        f = fq.flow
        del self.flows[f]
        if fq.named and fq.run:
            self._runs[f] = fq.run
        if fq.groups:
            gm = self._group_members
            for g in fq.groups:
                members = gm[g]
                del members[f]
                if not members:  # (an org of the template: its group goes with its last flow)
                    del gm[g]
            self.sched.resume(f)
        if self._unnamed_weights and not fq.named:
            self._forget_weight(f)

    def forget_starts(self, now: float) -> None:
        """Let the starts older than a minute leave each class's window (a start does this
        too; this is for a pool where nothing starts any more)."""
        for st in self._starts.values():
            while st and st[0] <= now - 60.0:
                st.popleft()

    def _forget_weight(self, f: Flow) -> None:
        """``f`` (an org the file does not name) has nothing waiting here: when nothing of it
        runs either, its weight in the core goes back to 1 (told again when it next waits:
        :meth:`_flow_queue`, :meth:`start_alone`), so the core forgets it once ``v`` passes its
        meter: memory follows the live flows, not every org ever seen."""
        sched = self.sched
        if sched.weight(f) != 1.0 and not sched.running(f) and not sched.suspended(f):
            sched.set_weight(f, 1.0)

    def _drop_nested(self, fq: _FlowQ) -> None:
        """Forget the empty queue of a team or user (nested shares): memory follows the live
        users, not every user ever seen. A suspended one (its org or class at its limit) is
        resumed first, so the core does not keep it; it rejoins as any idle flow does."""
        f = fq.flow
        del self.flows[f]
        for g in fq.groups:
            members = self._group_members.get(g)
            if members is not None:
                members.pop(f, None)
                if not members:
                    del self._group_members[g]
        if self.sched.suspended(f):
            self.sched.resume(f)
        self.sched.release(f)

    def _unaside(self, fq: _FlowQ) -> None:
        fq.aside = False
        self.aside.remove(fq)
        slots = self.shared.slots
        if not any(slots[h].full for h in fq.groups):
            self.sched.resume(fq.flow)

    def _release_aside(self, now: float, fits: Fits | None) -> None:
        """Put back in the competition the flows set aside whose head now fits a backend."""
        headroom = self.headroom
        for fq in list(self.aside):
            head = fq.preferred()
            if head is not None and self._backend_for(head, now, fits) is not None and (
                    not headroom or self._may_take(fq.flow)):
                self._unaside(fq)

    def _may_take(self, flow: Flow) -> bool:
        """``limits.headroom``: whether ``flow`` may take a slot now. Yes while more than
        ``headroom`` of the pool's slots are free; else only when the flow has nothing running
        or fewer running than its part of the slots not kept (``slots - headroom`` over the flows
        with work, waiting or running).
        A prototype (issue 42): the slots kept are idle while every flow with work holds its
        part, which is what it costs in throughput."""
        cap = sum(b.limit for b in self.backends.values() if b.healthy)
        if self.slots.limit is not None:
            cap = min(cap, self.slots.limit)
        if cap - self.in_flight > self.headroom:
            return True
        running = self._run_n.get(flow, 0)
        if not running:
            return True
        active = set(self._run_n)
        active.update(f for f, fq in self.flows.items() if fq.n)
        return running < (cap - self.headroom) / max(1, len(active))

    def pause_backend(self, name: str, seconds: float) -> None:
        """An upstream 429: send nothing to backend ``name`` for ``seconds`` (its Retry-After)."""
        b = self.backends[name]
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        b.paused_until = max(b.paused_until, self.clock() + seconds)

    def set_healthy(self, name: str, healthy: bool) -> None:
        """Whether backend ``name`` is in rotation; the pool is available while one is."""
        self.backends[name].healthy = bool(healthy)
        self.set_available(any(b.healthy for b in self.backends.values()))

    def set_saturated(self, name: str, saturated: bool) -> None:
        """Backend ``name`` is in rotation but says it is full (its saturation probe)."""
        self.backends[name].saturated = bool(saturated)

    @property
    def available(self) -> bool:
        """Whether some backend of the pool is in rotation (saturated or paused ones count)."""
        return self.down_since is None

    def _backend_for(self, r: Request, now: float, fits: Fits | None = None) -> _Backend | None:
        """The least-loaded backend that may take ``r`` now; one other than ``r.avoid`` (the
        backend its last attempt failed on) when there is such a one."""
        best: _Backend | None = None
        load = 2.0
        avoided: _Backend | None = None
        for b in self.backends.values():
            if b.open(now) and (b.max_context is None or r.need <= b.max_context) and (
                    fits is None or fits(r, b.name)):
                if b.name == r.avoid:
                    avoided = b
                    continue
                x = b.in_flight / b.limit
                if x < load:
                    best, load = b, x
        return best if best is not None else avoided

    def full(self) -> bool:
        """Whether nothing can start for want of a slot: the pool's ``max_in_flight`` is reached,
        or every backend holds its limit (outside an outage, whose own timeouts a poll keeps).
        A :meth:`pop` now would start nothing and drop only what :meth:`wake_at` names."""
        if self.down_since is not None:
            return False
        if self.slots.full:
            return True
        for b in self.backends.values():
            if b.in_flight < b.limit:
                return False
        return True

    def _pool_room(self, now: float) -> bool:
        if self.slots.full:
            return False
        if self.rpm is not None and not self.rpm.can_take(1, now):
            self.blocked_until = now + self.rpm.wait(1, now)
            return False
        for b in self.backends.values():
            if b.open(now):
                return True
        paused = [b.paused_until for b in self.backends.values()
                  if b.healthy and not b.saturated and b.in_flight < b.limit]
        if paused:
            self.blocked_until = min(paused)
        return False

    def _tokens_ok(self, r: Request, now: float) -> bool:
        if self.tpm is None or self.tpm.can_take(r.tokens, now):
            return True
        self.blocked_until = now + self.tpm.wait(r.tokens, now)
        return False

    # ------------------------------------------------------------ start and end
    def pop(self, fits: Fits | None = None) -> Request | None:
        """The next request that may start now, marked RUNNING on its backend (``backend``),
        with every counter and bucket debited and its flow charged; ``None`` when nothing may
        start now. Drop expired requests first (:meth:`expire`): ``pop`` never starts one
        past its time. ``fits(request, backend)``: the driver's own check that the backend
        can take the request now (the simulator's KV budget); the request the core names is
        charged only once a backend takes it (look before you pop)."""
        self.stalled = None
        if not self.n_waiting:  # nothing to start, nothing to drop
            self.blocked_until = -_INF
            return None
        now = self.clock()
        drops = self._drops
        if (drops and drops[0][0] <= now) or self.down_since is not None:  # (_drop_expired's own tests)
            self._drop_expired(now)
        parked = self.parked
        if parked and parked[0][0] <= now:
            self._unpark(now)
        self.blocked_until = -_INF
        if not self._pool_room(now):
            return None
        shared = self.shared
        for cls, d in self.strict.items():
            if not self._strict_n[cls]:
                continue
            cslots = shared.slots[("class", cls)]
            if cslots.full:
                continue
            for r in d:
                if not shared.room(r.flow):
                    continue  # its org is at its limit: it must not hold the others back
                if not self._tokens_ok(r, now):
                    return None  # the pool's token bucket holds everyone, in order
                b = self._backend_for(r, now, fits)
                if b is None:
                    self.stalled = r
                    return None  # no backend with room fits it: it waits first in line
                d.remove(r)
                self._strict_n[cls] -= 1
                return self._start(r, b, now)
        sched = self.sched
        if self.aside:
            self._release_aside(now, fits)
        while True:
            peek = sched.peek()
            if peek is None:
                return None
            fq: _FlowQ = peek.item
            head = fq.preferred()
            assert head is not None, "a flow in the core has a waiting request"
            if self.tpm is not None and not self._tokens_ok(head, now):
                return None
            b = self._backend_for(head, now, fits)
            if b is not None and self.headroom and not self._may_take(fq.flow):
                fq.aside = True  # held back from the last free slots (limits.headroom), uncharged
                self.aside.append(fq)
                sched.suspend(fq.flow)
                continue
            if b is not None:
                break
            if len(self.aside) >= self.overtake:
                self.stalled = head
                return None  # it waits first in line, uncharged (look before you pop)
            fq.aside = True  # set aside, uncharged: later selections may go out
            self.aside.append(fq)
            sched.suspend(fq.flow)
        r = head
        # the work starts with the dispatch: reported first, so that taking the last waiting
        # request does not close the busy period it opens; in the delivered-service modes it is
        # reported as the flow's, so the flow keeps its meter (its lag) while its work runs
        work = r.work_flow = None if self.seed else fq.flow
        sched.work_started(work)
        r.working = True
        # a flow alone whose charge is a guess (the prior's) sets v: its refunds get a floor
        v, alone = sched.virtual_time, sched.waiting_flows == 1 and self._guessed(r)
        disp = sched.dispatch()
        assert disp is not None and disp.item is fq
        if work is not None and self.refund_floors and (self._floors.flows or (alone and disp.start > v)):
            self._floors.dispatched(r, disp.start, v, alone)  # how far its earlier work may be refunded
        fq.take(r)
        fq.token = None
        r.in_core = True
        r.start_tag = disp.start
        r.charged = fq.token_cost
        r.delivered = 0.0
        self._adjust(r, self._dispatch_charge(r) - fq.token_cost)
        if fq.n:
            self._enter(fq)
        else:
            fq.small.clear()
            fq.large.clear()  # (its heap, if any, holds only requests that left: it goes with the queue)
            self._emptied(fq)
        return self._start(r, b, now, True)  # (core)

    # ------------------------------------------------------------ the charge
    def _dispatch_charge(self, r: Request) -> float:
        """What ``r`` is charged as it is dispatched: its estimate as the estimator sees it now
        (the calibration may have learned since it arrived); a stream in ``served`` mode only
        its prompt (its output is charged as it is delivered); a fixed cost as given."""
        e = r.est
        if e is None or r.fixed:
            return r.cost
        est = self.estimator
        if est.epoch != r.epoch:
            try:
                e = r.est = est.reestimate(e, r.flow)
                r.epoch = est.epoch
            except Exception:  # an estimator subclass's own failure: the estimate at arrival stands
                log.exception("sfq: re-estimating a request of flow %r at dispatch failed", r.flow)
        if self.served and r.streaming:
            c = est.input_weight * e.charged_prompt
            cost = c if c > est.min_cost else est.min_cost
        else:
            cost = e.cost
        r.cost = cost
        return cost

    def reprice(self, r: Request) -> float:
        """The charge at dispatch of ``r``, which this engine started but whose start waits for
        the grant of a shared state (several gateways, ``sfq.state``), priced again from the
        calibration as it is now; returns it (``r.cost``). The grant is the request's dispatch
        over the fleet, and the estimate is the calibration's at dispatch (:meth:`_dispatch_charge`):
        a request handed on before its flow's first usage report must not be granted, seconds
        later, at the prior's price. The difference moves the flow's meter here and ``r.charged``
        (the shared state, told only of corrections after the grant, charges the new price)."""
        if r.in_core and not r.fixed and r.est is not None and self.estimator.epoch != r.epoch:
            self._adjust(r, self._dispatch_charge(r) - r.charged)
        return r.cost

    def _guessed(self, r: Request) -> bool:
        return guessed(r, self.estimator)

    def _adjust(self, r: Request, delta: float) -> None:
        """Move the meter of ``r``'s flow by ``delta`` cost units (a charge mode's correction)."""
        if not delta:
            return
        try:
            self.sched.adjust(r.flow, delta)
        except (OverflowError, ValueError):
            log.exception("sfq: correcting the charge of flow %r by %g failed; ignored", r.flow, delta)
            return
        r.charged += delta
        if self.on_charge is not None:
            self.on_charge(r, delta)

    def correct(self, r: Request, delta: float, floor: bool = False) -> None:
        """Move the meter of ``r``'s flow by ``delta`` cost units: a correction another engine
        computed for the same request (a gateway's own engine, for the queue of stand-ins that
        decides for several gateways, or for one alone while their shared state cannot be
        reached: ``sfq.state``). ``floor``: a refund (``delta < 0``) stops at the flow's refund
        floor, as :meth:`settle`'s does (the other engine left the floors to this queue).
        A request adopted as running (:meth:`adopt_running`: started by another queue, as a
        fleet's new decider or a gateway alone adopts what was running): a charge moves its
        flow's meter all the same, and a refund takes back no more than it was charged here
        (the rest was charged where it started)."""
        if r.in_core:
            if floor and delta < 0 and self._floors:
                delta = self._floors.refund(r, delta, self.sched)
            self._adjust(r, delta)
        elif r.state == RUNNING and r.flow.pool == self.name and not self.nested:
            self._adjust(r, max(delta, -r.charged))

    def delivered(self, r: Request, tokens: object) -> float:
        """The running request ``r`` passed ``tokens`` more output tokens to its client; in
        ``served`` mode a stream is charged them now. Capped at what its ``max_tokens`` allows;
        returns the tokens counted."""
        if r.state != RUNNING or r.flow.pool != self.name:
            raise ValueError(f"delivered({r!r}): the request is not running in pool {self.name!r}")
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not (
                math.isfinite(tokens) and tokens >= 0):
            raise ValueError(f"tokens must be a finite number >= 0, got {tokens!r}")
        return self.add_delivered(r, float(tokens))

    def add_delivered(self, r: Request, n: float) -> float:
        """:meth:`delivered` for a caller that has checked its arguments (``r`` running in
        this pool, ``n`` a finite float >= 0): a stream's every event comes through here."""
        e = r.est
        if e is not None:
            room = e.max_tokens - r.delivered
            if n > room:
                n = room if room > 0 else 0.0
        if not n:
            return 0.0
        r.delivered += n
        if self.served and r.in_core and r.streaming and not r.fixed:
            self._adjust(r, self.estimator.output_weight * n)
        return n

    def settle(self, r: Request, actual_cost: float) -> None:
        """Correct the charge of the running request ``r`` to ``actual_cost`` (cost units: what
        it really cost, clamped by the caller); nothing in ``seed`` mode or for a fixed cost."""
        if r.in_core and not r.fixed and not self.seed:
            delta = actual_cost - r.charged
            if delta < 0 and self._floors:  # not below a v its flow set alone on this charge (_floors)
                delta = self._floors.refund(r, delta, self.sched)
            self._adjust(r, delta)

    def start_alone(self, r: Request, now: float, spec: ClassSpec) -> bool:
        """:meth:`queue_new` then :meth:`pop`, in one step, for a new request ``r`` that finds
        nothing waiting in the pool, where that pair can only start ``r`` at once: no request
        waits (so the core holds no other flow and nothing can be dropped), the class is not
        strict, the flow is not nested and no org or class ``max_in_flight`` applies to it (so
        the core cannot have it suspended), the pool is not in an outage, and ``r`` would not
        run out of queue age at once. ``True``: ``r`` runs (``r.backend``), with the very core
        calls, charge, counters and buckets the pair makes. ``False``: nothing changed (the
        caller queues it and polls as always). The uncontended request's path: docs/library.md."""
        if self.n_waiting or spec.strict or not self._plain or self.down_since is not None or self.slots.full:
            return False
        if self.rpm is not None and not self.rpm.can_take(1, now):
            return False
        if self.tpm is not None and not self.tpm.can_take(r.tokens, now):
            return False
        age = spec.max_queue_age_seconds
        at_age = now + age if age is not None else _INF
        if r.max_wait < _INF and now + r.max_wait < at_age:
            at_age = now + r.max_wait
        at_deadline = r.deadline if r.deadline is not None else _INF
        drop_at = at_age if at_age < at_deadline else at_deadline
        if drop_at <= now:
            return False
        b = self._backend_for(r, now, None)
        if b is None:
            return False
        # it starts: from here on, what queue_new, _flow_queue, _enter, pop and _emptied do
        self.stalled = None
        self.blocked_until = -_INF
        f = r.flow
        r.queued_at = now
        r.drop_at = drop_at
        r.drop_reason = "deadline" if at_deadline <= at_age else "queue_timeout"
        small = r.small = spec.small_cost is None or r.cost <= spec.small_cost
        named = len(f) == 3 and f.org in self.policy.orgs  # (its _FlowQ's ``named``)
        run = self._runs.pop(f, 0)
        run = run + 1 if small else 0
        if run and named:
            self._runs[f] = run
        sched = self.sched
        w = self.policy.flow_weight(f.org, f.cls)
        if w != 1.0 or named:
            sched.set_weight(f, w)
        e = r.est
        c = self._entry_cost(r)
        sched.enqueue(f, c, r)
        work = r.work_flow = None if self.seed else f
        sched.work_started(work)
        r.working = True
        alone = floors = False
        if work is not None and self.refund_floors:  # (a flow alone whose charge is a guess: pop's floor)
            alone = e is not None and not r.fixed and self._guessed(r)
            floors = alone or bool(self._floors.flows)
        v = sched.virtual_time if floors else 0.0
        disp = sched.dispatch()
        if floors and (self._floors.flows or disp.start > v):
            self._floors.dispatched(r, disp.start, v, alone)
        r.in_core = True
        r.start_tag = disp.start
        r.charged = c
        r.delivered = 0.0
        if e is not None and not r.fixed:  # (a fixed cost is charged as given: c)
            charge = self._dispatch_charge(r)
            if charge != c:
                self._adjust(r, charge - c)
        self._run(r, b, now, True)
        return True

    def _start(self, r: Request, b: _Backend, now: float, core: bool = False) -> Request:
        cls = r.flow.cls
        self.waiting_by_class[cls] -= 1
        self.n_waiting -= 1
        return self._run(r, b, now, core)

    def _run(self, r: Request, b: _Backend, now: float, core: bool) -> Request:
        """``r`` runs on ``b`` from ``now``: slots, buckets and the starts' window (the part of
        :meth:`_start` that does not count it out of the queue)."""
        cls = r.flow.cls
        r.state = RUNNING
        r.backend = b.name
        r.started_at = now
        r.tries += 1
        b.in_flight += 1
        self.in_flight += 1
        self.slots.acquire()
        if self.headroom:
            self._run_n[r.flow] = self._run_n.get(r.flow, 0) + 1
        if self.rpm is not None:
            self.rpm.take(1, now)
        if self.tpm is not None:
            self.tpm.debit(r.tokens, now)
        shared = self.shared
        if shared.slots or shared.lazy:  # (some org or class max_in_flight)
            shared.acquire(r.flow)
        st = self._starts[cls]
        st.append(now)
        while st[0] <= now - 60.0:  # the last minute's starts only
            st.popleft()
        if not core:  # (a strict class, or a start outside the core: no meter is charged)
            r.charged = 0.0
            r.in_core = False
            r.work_flow = None
            r.working = True
            self.sched.work_started()
        return r

    def adopt_running(self, r: Request) -> None:
        """Count a request already running on one of this pool's backends (started under the
        policy this one replaces, :meth:`PolicyEngine.reloaded`): it holds its backend, pool,
        org and class slots here until :meth:`finish`, even past a limit the new policy lowered
        (nothing more starts until it is back under). Buckets are not debited again."""
        if r.state != RUNNING or r.flow.pool != self.name or r.backend not in self.backends:
            raise ValueError(f"adopt_running({r!r}): not a request running in pool {self.name!r}")
        self.backends[r.backend].in_flight += 1
        self.in_flight += 1
        self.slots.hold()
        for g in self.shared.groups(r.flow):
            sl = self.shared.slots[g]
            sl.hold()
            if sl.full:
                for q in self.shared.queues:
                    q._group_full(g)
        r.in_core = False  # charged by the queue it started in, whose core is gone
        r.work_flow = None
        r.working = True
        self.sched.work_started()

    def move(self, r: Request, backend: str) -> None:
        """Count the running request ``r`` on ``backend`` instead of the one it was started on
        (the shared state of several gateways granted it a slot there, ``sfq.state``)."""
        if r.state != RUNNING or r.flow.pool != self.name or r.backend not in self.backends:
            raise ValueError(f"move({r!r}): not a request running in pool {self.name!r}")
        if backend not in self.backends:
            raise ValueError(f"move: unknown backend {backend!r} of pool {self.name!r}")
        self.backends[r.backend].in_flight -= 1
        self.backends[backend].in_flight += 1
        r.backend = backend

    def finish(self, r: Request, actual_tokens: float | None = None, retry_after: float | None = None) -> None:
        """A started request's attempt ended (any outcome): free its slots; correct the token
        bucket by ``actual_tokens`` (the usage report) when given; ``retry_after`` (an upstream
        429) pauses its backend that long."""
        if r.state != RUNNING or r.flow.pool != self.name or r.backend is None:
            raise ValueError(f"finish({r!r}): the request is not running in pool {self.name!r}")
        b = self.backends[r.backend]
        b.in_flight -= 1
        self.in_flight -= 1
        self.slots.release()
        if self.headroom:
            n = self._run_n.get(r.flow, 0) - 1
            if n > 0:
                self._run_n[r.flow] = n
            else:
                self._run_n.pop(r.flow, None)
        self._served(r.started_at, r.cost)
        r.state = ENDED
        if actual_tokens is not None and self.tpm is not None and math.isfinite(actual_tokens) and actual_tokens >= 0:
            diff = actual_tokens - r.tokens
            now = self.clock()
            if diff < 0:
                self.tpm.credit(-diff, now)
            elif diff > 0:
                self.tpm.debit(diff, now)
        if retry_after is not None:
            self.pause_backend(b.name, retry_after)
        if r.working:  # after every correction: a flow with work in flight is adjusted exactly
            r.working = False
            self.sched.work_done(r.work_flow)
            if self._floors.flows and r.work_flow is not None:
                self._floors.ended(r, self.sched)
        r.in_core = False
        shared = self.shared
        if shared.slots or shared.lazy:
            shared.release(r.flow)
        if self._unnamed_weights:
            f = r.flow
            if f not in self.flows and f.org not in self.policy.orgs:
                self._forget_weight(f)

    # ------------------------------------------------------------ deadlines that cannot be met
    def _served(self, started: float | None, cost: float) -> None:
        """An attempt of ``cost`` that started at ``started`` ended now: a sample of the service."""
        done = self._done
        now = self.clock()
        held = now - started if started is not None and now > started else 0.0
        done.append((now, held, cost))
        self._held_sum += held
        self._cost_sum += cost
        if len(done) > SERVICE_SAMPLES:
            _, h, c = done.popleft()
            self._held_sum -= h
            self._cost_sum -= c
        if done[0][0] <= now - SERVICE_WINDOW:  # (it holds the new one at least: never emptied here)
            self._forget_service(now)

    def _forget_service(self, now: float) -> None:
        done = self._done
        while done and done[0][0] <= now - SERVICE_WINDOW:
            _, h, c = done.popleft()
            self._held_sum -= h
            self._cost_sum -= c
        if not done:  # (no drift of the float sums across quiet spells)
            self._held_sum = self._cost_sum = 0.0

    def service(self, flow: Flow, now: float) -> tuple[float, float] | None:
        """What the pool serves, as measured, and what ``flow`` may get of it: ``(cost units a
        second the pool serves with its slots all busy, the most of them ``flow`` may get)``.
        The first is the slots in rotation (the pool's ``max_in_flight`` and its backends', not
        those paused or saturated) times the cost an attempt served per second it held its slot
        over the last :data:`SERVICE_WINDOW` seconds: the pool's completions per second while
        its slots are all busy (Little's law), which, unlike completions counted in a window,
        does not fall while the pool idles for want of work. The second also holds ``flow`` to
        its org's and class's ``max_in_flight``. ``None`` before :data:`SERVICE_MIN_SAMPLES`
        attempts ended in the window, or with no slot."""
        done = self._done
        self._forget_service(now)
        if len(done) < SERVICE_MIN_SAMPLES or self._held_sum <= 0.0 or self._cost_sum <= 0.0:
            return None
        per_slot = self._cost_sum / self._held_sum
        cap = 0
        for b in self.backends.values():
            if b.healthy and not b.saturated:
                cap += b.limit
        lim = self.slots.limit
        if lim is not None and lim < cap:
            cap = lim
        mine = cap
        shared = self.shared
        for g in (("org", flow.org), ("class", flow.cls)):
            sl = shared.slots.get(g)
            if sl is not None and sl.limit is not None and sl.limit < mine:
                mine = sl.limit
        if mine <= 0:
            return None
        return cap * per_slot, mine * per_slot

    def _fair_part(self, flow: Flow) -> float:
        """``flow``'s weight over the weights of the flows competing in the core now, itself
        included (a flow set aside or held by a full ``max_in_flight`` does not compete):
        its part of the weighted classes' service while they all stay backlogged (SFQ)."""
        w = self.policy.flow_weight(flow.org, flow.cls)
        total = w
        slots = self.shared.slots
        for f, fq in self.flows.items():
            if f == flow or fq.token is None or fq.aside:
                continue
            if fq.groups and any(slots[g].full for g in fq.groups):
                continue
            total += self.policy.flow_weight(f.org, f.cls)
        return w / total

    def _slot_free(self, flow: Flow, now: float) -> bool:
        """Whether a slot is free for a new request of ``flow`` now (it may start at the next poll)."""
        for b in self.backends.values():
            if b.open(now):
                return not self.slots.full and self.shared.room(flow)
        return False

    @staticmethod
    def _turn(ahead: Iterable[tuple[float, float]], now: float, rate: float) -> float:
        """When a flow served at ``rate`` (cost units a second) from ``now`` reaches the end of
        ``ahead`` (``(drop time, cost)`` in the order they go): each starts in turn if it is
        still in time then, and holds the flow ``cost / rate``; one out of time frees its turn."""
        t = now
        for key, c in ahead:
            if t < key:
                t += c / rate
        return t

    def _flow_rate(self, flow: Flow, pool_rate: float, mine: float) -> float:
        """``flow``'s fair part of the measured service (:meth:`service`'s two figures)."""
        rate = pool_rate * self._fair_part(flow)
        return mine if rate > mine else rate

    def unmeetable(self, flow: Flow, cost: float, drop_at: float, now: float) -> float | None:
        """For a new request of ``flow`` (a weighted class, not nested), of ``cost``, that must
        start before ``drop_at`` (its deadline, or its queue age if sooner) and has a deadline
        of its own: ``None`` when it may start in time, else the seconds after which a request
        like it (the same time allowed) may (docs/design.md §5d, "Refusing early").

        An estimate, not a bound. While a slot is free for it, it may start (``None``).
        Otherwise its flow is taken to be served from now on at its fair part of the pool's
        measured service (:meth:`service` times :meth:`_fair_part`: the flows competing now go
        on competing), in EDF order: each of its requests due no later than this one starts, in
        turn, if it is still in time then, and holds the flow for its cost over that rate; one
        that ran out of time is dropped and frees its turn. This one cannot make it when its
        turn comes at or after ``drop_at``. ``None`` too when nothing is measured yet, under
        nested shares, or when even the pool's whole service would be enough. The same model
        as :meth:`predicted_wait`."""
        fq = self.flows.get(flow)
        if fq is None or not fq.edf or self.nested:
            return None
        svc = self.service(flow, now)
        if svc is None:
            return None
        pool_rate, mine = svc
        if self._slot_free(flow, now):
            return None  # a slot is free (for it): it may start at the next poll
        ahead = [(x[0], x[2].cost) for x in fq.edf if now < x[0] <= drop_at and x[2].state == WAITING]
        total = sum(c for _, c in ahead)
        if now + total / (pool_rate if pool_rate < mine else mine) < drop_at:
            return None  # even served at the pool's whole rate, first of all, it has time
        rate = self._flow_rate(flow, pool_rate, mine)
        ahead.sort()
        t = self._turn(ahead, now, rate)  # EDF at that rate
        if t < drop_at:
            return None
        return t - drop_at + cost / rate  # (t - drop_at < the last one's c / rate: see docs/design.md §5d)

    def predicted_wait(self, flow: Flow, now: float, drop_at: float = _INF) -> float | None:
        """Seconds a new request of ``flow`` arriving ``now`` is predicted to wait before it
        starts (``drop_at``: its drop time, when it has a deadline; ``inf``: none), by the model
        of :meth:`unmeetable`: 0 while a slot is free for it; otherwise its flow is served from
        now on at its fair part of the pool's measured service, and its turn comes once the
        requests ahead of it have had theirs: its flow's requests with a drop time no later
        than its own, nearest first, then (when it has no deadline) those without one, in
        queue order; each starts if still in time then and holds the flow its cost over that
        rate. ``None`` when nothing is measured yet (:meth:`service`), for a strict class, and
        under nested shares (not modelled). Time: the flow's waiting requests, and the flows
        competing in the pool."""
        if self.nested or flow.cls in self.strict:
            return None
        svc = self.service(flow, now)
        if svc is None:
            return None
        if self._slot_free(flow, now):
            return 0.0
        fq = self.flows.get(flow)
        ahead: list[tuple[float, float]] = []
        if fq is not None:
            if fq.edf:
                ahead = [(x[0], x[2].cost) for x in fq.edf if now < x[0] <= drop_at and x[2].state == WAITING]
                ahead.sort()
            if drop_at == _INF:  # after those with a deadline: those without, in queue order
                rest = [r for d in (fq.small, fq.large) for r in d if r.state == WAITING and r.deadline is None]
                rest.sort(key=_by_id)
                ahead.extend((r.drop_at, r.cost) for r in rest if now < r.drop_at)
        if not ahead:
            return 0.0
        return self._turn(ahead, now, self._flow_rate(flow, *svc)) - now

    # ------------------------------------------------------------ views
    def wake_at(self) -> float | None:
        """The earliest clock time at which :meth:`pop` or :meth:`expire` may have something new
        without any other event (a bucket refills, a pause ends, a request runs out of time, a
        parked request's token comes)."""
        t = self.next_drop() if self._drops or self.down_since is not None else None  # (else: none)
        b = self.blocked_until
        if b > -_INF and (t is None or b < t):
            t = b
        if self.n_parked:  # a parked request's token comes (it joins its flow then)
            p = self.next_unpark()
            if p is not None and (t is None or p < t):
                t = p
        return t

    def held(self, flow: Flow) -> int:
        """Requests of ``flow`` first in line that fit no backend with room (stalled or set aside)."""
        fq = self.flows.get(flow)
        n = 1 if fq is not None and fq.aside else 0
        st = self.stalled
        return n + int(st is not None and st.state == WAITING and st.flow == flow and not n)

    def waiting(self, flow: Flow) -> int:
        """Requests of ``flow`` waiting: in its queue, and parked for its org's rate."""
        n = sum(1 for _, _, r in self.parked if r.state == WAITING and r.ready_at > -_INF and r.flow == flow) \
            if self.n_parked else 0
        if flow.cls in self.strict:
            return n + sum(1 for r in self.strict[flow.cls] if r.state == WAITING and r.flow == flow)
        fq = self.flows.get(flow)
        return n + (0 if fq is None else fq.n)

    def iter_waiting(self) -> Iterator[Request]:
        yield from (r for _, _, r in list(self.parked) if r.state == WAITING and r.ready_at > -_INF)
        for d in self.strict.values():
            yield from (r for r in d if r.state == WAITING)
        for fq in self.flows.values():
            yield from (r for r in fq.requests() if r.state == WAITING)

    def meter(self, flow: Hashable) -> float:
        return float(self.sched.meter(flow))

    def lead(self, flow: Hashable) -> float:
        """How far ``flow``'s meter is ahead of the pool's virtual time (meter units; 0 when it
        is not): the service it took ahead of the others, which a fleet's next decider puts
        back (:meth:`set_lead`, ``sfq.state``). 0 under nested shares (a tree of cores)."""
        if self.nested:
            return 0.0
        x = float(self.sched.meter(flow)) - float(self.sched.virtual_time)
        return x if x > 0.0 else 0.0

    def set_lead(self, flow: Hashable, lead: float) -> None:
        """Move ``flow``'s meter ``lead`` meter units ahead of where it stands (a flow new to
        this queue: of the virtual time), as a correction of ``lead`` times its weight would:
        a fleet's new decider putting back what the last one left (:meth:`lead`). Nothing under
        nested shares; ``OverflowError`` past the core's bound on a lead."""
        if self.nested or not (0.0 < lead < _INF):
            return
        self.sched.adjust(flow, lead * float(self.sched.weight(flow)))
