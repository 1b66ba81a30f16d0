"""Outcome accounting, fair-share figures and metrics per (org, class, pool).

Every request the policy sees ends as exactly one outcome (``OUTCOMES``); a refusal carries
its reason (``REASONS``). The numbers are plain counters per flow (:class:`FlowCounters`):
an event adds to a few attributes and takes no lock. ``stats()`` reads them, and so does a
Prometheus scrape: :class:`PolicyMetrics` registers a collector in a
``prometheus_client.CollectorRegistry`` an embedder can mount
(``generate_latest(metrics.registry)``) that turns them into the series below when it is
collected.

**The share window.** Each flow keeps, for the last ``window_seconds``, the cost it was
served per second (a sparse ring: one record per second that had an event) and the spans of
time it was *backlogged* (a request waiting: queued, not started) that covered a whole second.
Both are updated in O(1) per event; the figures are made only when read (a scrape, ``/stats``):

* ``share``: the org's part of its pool's served cost over the window;
* ``expected_share``: what the weights promise it. A flow is backlogged in a second when it
  had a request waiting *throughout* that second: SFQ's guarantee (Goyal, Vin and Cheng,
  "Start-time Fair Queuing", SIGCOMM 1996) bounds the service of two flows over any interval
  in which both are continuously backlogged, and says nothing of a flow that is not. A flow
  that waits a moment for the next free slot, or whose every request is already running, is
  getting what it asks: in that second it is expected what it got, as a strict class always
  is. The flows backlogged in a second share the rest of that second's weighted service (what
  they were served in it) by ``weight / (sum of their weights)`` (a flow's weight is its org's
  weight times its class's, as the engine charges it). The promise over the window is the sum
  of each second's, over the window's served cost (by time when nothing was served), so that a
  pool that served each second as promised shows ``share == expected_share``. A strict class
  is served before the weighted ones: its flows are expected what they got;
* ``jain``: Jain's index of ``share / expected_share`` over the orgs with an expected share.

Served cost is counted when an attempt ends (a completed request's usage, or for one that
ends early -- cancelled, failed mid-stream -- what passed to its client).

**Bounded series.** An org that has sent nothing has no series. At most ``max_org_series``
orgs get their own ``org`` label; the others are summed under ``org="_other"``. The orgs are
chosen by their served cost over the window: free places are filled at every read, and the
whole choice is made again at most once per window, a newcomer taking an org's place only when
it was served more than twice as much (hysteresis). A counter counts each event in exactly one
series: an org's own series counts what happened while it had its label, ``_other`` what
happened to the orgs it held while it held them. Every series is monotonic (an org that comes
back continues from where its series stopped), and ``sum(increase(...))`` over all ``org``
labels is exact; a demoted org's counters show once more, at the read that demotes it, with
their last counts, then end (Prometheus marks them stale). The wait histogram is per class and
pool (no ``org`` label).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as _prom_metrics
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from .config import Policy

__all__ = ["OUTCOMES", "REASONS", "PolicyMetrics", "FlowCounters", "WAIT_BUCKETS", "OTHER_ORG", "OBJECTIVE_MISSED",
           "backlogged_mask", "expected_shares", "jain", "wait_quantile", "ttft_bounds"]

OUTCOMES = ("completed", "failed", "cancelled_before_start", "cancelled_during_execution", "refused")
#: why a request was refused (before start) or why it failed (``failed`` outcomes carry one too)
REASONS = ("unauthenticated", "class_not_allowed", "unknown_model", "bad_request", "too_large", "rate_limited",
           "queue_full",
           # nested shares: the team (or org) already has max_users users with requests live
           "too_many_users",
           # a flow an embedder classified names an org the policy has no entry (and no template) for
           "unknown_org",
           "queue_timeout", "deadline", "closed",
           # refused at once: it could not start before its deadline (a class's refuse_unmeetable)
           "deadline_unmeetable",
           # no backend of the pool was in rotation for unavailable_timeout
           "unavailable",
           # several gateways sharing one queue (sfq.state): Redis cannot be reached; a retry over
           # the flow's budget counted over every gateway
           "state_unavailable", "budget",
           # the org's spending budget (orgs.NAME.budget) cannot cover the request ("budget" above
           # is the retry budget)
           "budget_exhausted")
#: seconds: the buckets of the wait-before-start histogram
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                900.0, 3600.0, 7200.0)
#: the ``org`` label of the orgs beyond ``max_org_series`` (and of refused made-up orgs)
OTHER_ORG = "_other"
#: a newcomer takes a labelled org's place when it was served more than this many times as much
HYSTERESIS = 2.0
_LABELS = ("org", "class", "pool")
#: the histogram's ``le`` labels, +Inf last
_go_float: Callable[[float], str] = floatToGoString  # (prometheus_client's own spelling of a bound)
_LE = tuple(_go_float(b) for b in WAIT_BUCKETS) + ("+Inf",)
_NB = len(WAIT_BUCKETS) + 1
_ZERO: dict[tuple[str, str], float] = {}
#: the reasons of a request whose deadline or queue age ran out (``sfq_deadline_missed_total``)
MISSED = frozenset(("deadline", "queue_timeout"))
#: the reasons of a request that ended without an answer and counts as a miss of its class's
#: time-to-first-token objective (:meth:`PolicyMetrics.first_token`): its deadline or queue age
#: ran out, or it was refused at once because it could not start before its deadline
OBJECTIVE_MISSED = frozenset(("deadline", "queue_timeout", "deadline_unmeetable"))


def ttft_bounds(objective: float | None) -> tuple[float, ...]:
    """The buckets (seconds) of a class's time-to-first-token histogram: ``WAIT_BUCKETS`` and
    its objective (so that the share of requests within it is exact)."""
    if objective is None or objective in WAIT_BUCKETS:
        return WAIT_BUCKETS
    return tuple(sorted((*WAIT_BUCKETS, objective)))


class _Firsts:
    """The time to first token of one (class, pool), as the gateway saw it: a histogram since
    the start (``buckets`` per bound of ``bounds``, not cumulative, the last over the largest;
    ``total``: their sum; ``created``: ``time.time()`` at the first), and over the share window
    one record ``[second, counts per bucket, requests within the objective, requests counted]``
    per second with an event (a request counted is one answered, or one that ended without an
    answer for ``OBJECTIVE_MISSED``; within: its first token came no later than the class's
    objective in force then)."""

    __slots__ = ("bounds", "le", "buckets", "total", "created", "recent")

    def __init__(self, objective: float | None) -> None:
        self.bounds = ttft_bounds(objective)
        self.le = tuple(_go_float(b) for b in self.bounds) + ("+Inf",)
        self.buckets = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.created = time.time()
        self.recent: list[list[Any]] = []


class FlowCounters:
    """Plain counters of one (org, class, pool). ``refused_by``: the refusals among ``reasons``
    (the rest are failures); ``wait_buckets``: waits before start per bucket of
    ``WAIT_BUCKETS`` (not cumulative; the last one is over the largest bound); ``created``: when
    the flow was first seen (``time.time()``). The share window: ``since`` (clock time since
    which the flow has had a request waiting, ``None`` while nothing waits), ``spans`` (its
    spans ``[start, end]`` of waiting still in the window, those that covered a whole second:
    no other can make it backlogged in a second) and ``recent`` (one record
    ``[second, served cost, wait counts per bucket or None]`` per second with an event).
    ``last``: clock time the flow was last seen idle (made, gone idle, refused while idle),
    for :meth:`PolicyMetrics.forget_idle`."""

    __slots__ = ("waiting", "in_flight", "outcomes", "reasons", "charged_cost", "served_cost", "cancelled_work",
                 "upstream_429", "timeouts", "attempts", "retries", "waits", "refused_by", "wait_buckets", "created",
                 "joins", "missed", "since", "spans", "recent", "last")

    def __init__(self) -> None:
        self.created = time.time()
        self.waiting = 0
        self.in_flight = 0
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.reasons: dict[str, int] = {}
        self.charged_cost = 0.0  # what the engine charged the flow for its attempts that ended, corrections made
        self.served_cost = 0.0  # what was delivered: usage reports, or what passed of a request ended early
        self.cancelled_work = 0.0  # tokens produced for requests cancelled while running
        self.upstream_429 = 0
        self.timeouts = 0
        self.attempts = 0
        self.retries = 0
        self.waits = 0.0  # sum of waits before start, seconds
        self.refused_by: dict[str, int] = {}
        self.wait_buckets = [0] * _NB
        self.joins = 0  # requests that joined a running one of the same Idempotency-Key
        self.missed = 0  # requests that ended because their deadline or queue age ran out
        self.since: float | None = None
        # (lists, not deques: an empty deque is 760 bytes, two of them per active flow; each is
        # cut from the front at most once a second and holds at most the window's seconds)
        self.spans: list[list[float]] = []
        self.recent: list[list[Any]] = []
        self.last = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"waiting": self.waiting, "in_flight": self.in_flight, **self.outcomes,
                "reasons": dict(self.reasons), "charged_cost": self.charged_cost, "served_cost": self.served_cost,
                "cancelled_work_tokens": self.cancelled_work, "upstream_429": self.upstream_429,
                "timeouts": self.timeouts, "deadline_missed": self.missed, "attempts": self.attempts,
                "retries": self.retries,
                "retry_share": self.retries / self.attempts if self.attempts else 0.0,
                "mean_wait": self.waits / self.attempts if self.attempts else None}

    def vector(self) -> dict[tuple[str, str], float]:
        """The flow's counters as one mapping ``(family, label value) -> count`` (the
        ``outcome`` or ``reason`` label; ``""`` for the families without one)."""
        v: dict[tuple[str, str], float] = {("sfq_requests", o): n for o, n in self.outcomes.items()}
        if self.joins:
            v["sfq_requests", "joined"] = self.joins
        for reason, n in self.reasons.items():
            refused = self.refused_by.get(reason, 0)
            if refused:
                v["sfq_refusals", reason] = refused
            if n - refused:
                v["sfq_failures", reason] = n - refused
        for name, value in (("sfq_charged_cost", self.charged_cost), ("sfq_served_cost", self.served_cost),
                            ("sfq_cancelled_work_tokens", self.cancelled_work),
                            ("sfq_upstream_429", self.upstream_429), ("sfq_timeouts", self.timeouts),
                            ("sfq_deadline_missed", self.missed), ("sfq_attempts", self.attempts),
                            ("sfq_retries", self.retries)):
            if value:
                v[name, ""] = value
        return v


Key = tuple[str, str, str]


# ------------------------------------------------------------------ the window's math (pure)
def backlogged_mask(spans: Iterable[Sequence[float]], since: float | None, now: float, lo: int, top: int) -> int:
    """The seconds ``lo..top`` (whole clock seconds) in which a flow was backlogged, as bits
    (bit ``i``: second ``lo + i``): those that one of its waiting ``spans`` ``[start, end]``,
    or the open span from ``since`` (``None``: none) to ``now``, covers whole (``start <=
    second`` and ``second + 1 <= end``; the current second counts once it is over)."""
    mask = 0
    for a, b in spans:
        i, j = max(math.ceil(a), lo), min(math.floor(b) - 1, top)
        if i <= j:
            mask |= ((1 << (j - i + 1)) - 1) << (i - lo)
    if since is not None:
        i, j = max(math.ceil(since), lo), min(math.floor(now) - 1, top)
        if i <= j:
            mask |= ((1 << (j - i + 1)) - 1) << (i - lo)
    return mask


def _second(rec: list[Any], sec: int, window: int, blank: tuple[Any, ...]) -> list[Any]:
    """The record of second ``sec`` in ``rec`` (``[sec, ...]``, oldest first): the last one, or
    a new one made of ``blank``, the records ``window`` seconds older than it dropped."""
    if rec and rec[-1][0] == sec:
        r: list[Any] = rec[-1]
        return r
    r = [sec, *blank]
    rec.append(r)
    old = sec - window
    i = 0
    while rec[i][0] <= old:  # (stops at ``r`` at the latest)
        i += 1
    if i:
        del rec[:i]
    return r


def _bits(mask: int) -> Iterator[int]:
    i = 0
    while mask:
        if mask & 1:
            yield i
        mask >>= 1
        i += 1


def expected_shares(flows: Sequence[tuple[float, bool, int, float, float]], backlogged_by_second: Sequence[float]
                    ) -> list[float]:
    """What the weights promise each flow of one pool over a window (the module docstring's
    rule). ``flows``: ``(weight, strict, backlogged mask, served cost in the window, served
    cost in its backlogged seconds)``; ``backlogged_by_second``: in each second of the window,
    the served cost of the weighted (not strict) flows backlogged in it (bit ``i`` of a mask is
    ``backlogged_by_second[i]``). A strict flow is expected what it got, and so is a weighted
    flow in the seconds it was not backlogged; in each second the backlogged flows share what
    they were served by their weights. The promises add up to 1 when anything was served (or,
    with nothing served, when anything was backlogged: then by time)."""
    total = sum(f[3] for f in flows)
    n = len(backlogged_by_second)
    wsum = [0.0] * n
    by_mask: dict[int, float] = {}
    for w, strict, mask, _, _ in flows:
        if mask and not strict:
            by_mask[mask] = by_mask.get(mask, 0.0) + w
    for mask, w in by_mask.items():
        for i in _bits(mask):
            wsum[i] += w
    g: dict[int, float] = {}
    if total > 0:
        for mask in by_mask:
            g[mask] = sum(backlogged_by_second[i] / wsum[i] for i in _bits(mask))
        return [served / total if strict or not mask else (served - mine + w * g[mask]) / total
                for w, strict, mask, served, mine in flows]
    busy = sum(1 for x in wsum if x > 0)
    for mask in by_mask:
        g[mask] = sum(1.0 / wsum[i] for i in _bits(mask)) / busy
    return [0.0 if strict or not mask else w * g[mask] for w, strict, mask, _, _ in flows]


def jain(values: Iterable[float]) -> float | None:
    """Jain's index ``(sum x)^2 / (n sum x^2)`` (1: all equal; ``1/n``: one has everything);
    ``None`` for no values, 1 when they are all 0."""
    xs = list(values)
    if not xs:
        return None
    sq = sum(x * x for x in xs)
    return 1.0 if sq == 0 else sum(xs) ** 2 / (len(xs) * sq)


def wait_quantile(counts: Sequence[int], q: float, bounds: Sequence[float] = WAIT_BUCKETS) -> float | None:
    """The ``q`` quantile (0..1) of waits counted per bucket of ``bounds`` (``counts``: not
    cumulative, the last over the largest bound), interpolated within its bucket as
    Prometheus' ``histogram_quantile`` does; ``None`` for no waits. A quantile in the last
    bucket is the largest bound."""
    n = sum(counts)
    if not n:
        return None
    rank = q * n
    acc = 0
    for i, c in enumerate(counts):
        if c and acc + c >= rank:
            if i >= len(bounds):
                return bounds[-1]
            lo = bounds[i - 1] if i else 0.0
            return lo + (bounds[i] - lo) * max(0.0, rank - acc) / c
        acc += c
    return bounds[-1]


class _Org:
    """One org's figures in one pool over the window (made at read time)."""

    __slots__ = ("served", "expected", "waiting", "in_flight", "oldest", "waits", "flows", "classes", "weight")

    def __init__(self) -> None:
        self.served = 0.0
        self.expected = 0.0
        self.waiting = 0
        self.in_flight = 0
        self.oldest: float | None = None  # the queued_at (clock) of its oldest waiting request
        self.waits: list[int] | None = None  # waits in the window per bucket (None: none)
        self.flows: list[FlowCounters] = []
        self.classes: list[str] = []  # the class of each of ``flows``
        self.weight: float | None = None

    def add(self, o: _Org) -> None:
        self.served += o.served
        self.expected += o.expected
        self.waiting += o.waiting
        self.in_flight += o.in_flight
        if o.oldest is not None and (self.oldest is None or o.oldest < self.oldest):
            self.oldest = o.oldest
        self.add_waits(o.waits)
        self.flows += o.flows
        self.classes += o.classes

    def add_waits(self, w: list[int] | None) -> None:
        if w is not None:
            mine = self.waits
            if mine is None:
                self.waits = list(w)
            else:
                for i, n in enumerate(w):
                    if n:
                        mine[i] += n

    def outcomes(self) -> dict[str, int]:
        """Its requests by outcome since the start (and ``joined``)."""
        out = dict.fromkeys((*OUTCOMES, "joined"), 0)
        for fc in self.flows:
            for k, n in fc.outcomes.items():
                out[k] += n
            out["joined"] += fc.joins
        return out


class Fairness:
    """The window's figures at one read: per pool, per org (:class:`_Org`), the labelled orgs."""

    def __init__(self, time: float, window: float, pools: dict[str, dict[str, _Org]], served: dict[str, float],
                 labelled: set[str], demoted: set[str], now: float) -> None:
        self.time = time
        self.window = window
        self.pools = pools
        self.served = served
        self.labelled = labelled
        self.demoted = demoted  # orgs this read took the label from (their counters show once more)
        self.now = now

    def grouped(self, pool: str) -> dict[str, _Org]:
        """The pool's orgs as exposed: each labelled org, the rest summed under ``_other``."""
        out: dict[str, _Org] = {}
        other: _Org | None = None
        for org, o in self.pools.get(pool, {}).items():
            if org in self.labelled:
                out[org] = o
            else:
                if other is None:
                    other = _Org()
                other.add(o)
        if other is not None:
            out[OTHER_ORG] = other
        return out

    def jain(self, pool: str) -> float | None:
        orgs = self.pools.get(pool, {})
        total = self.served.get(pool, 0.0)
        return jain((o.served / total if total > 0 else 0.0) / o.expected for o in orgs.values() if o.expected > 0)


class PolicyMetrics:
    """Counters per (org, class, pool), the share window, and their Prometheus series in
    ``registry`` (created when not given: pass one to expose the policy's series next to the
    embedder's own). A flow shows from its first event (or from the start for the ``flows``
    given here). ``clock``: seconds (the engine's); ``window_seconds`` and
    ``max_org_series``: the policy file's ``metrics:`` section (:meth:`configure`)."""

    def __init__(self, registry: CollectorRegistry | None = None, flows: Iterable[Key] = (), *,
                 clock: Callable[[], float] = time.monotonic, window_seconds: float = 60.0,
                 max_org_series: int = 1000) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.flows: dict[Key, FlowCounters] = {}
        self.clock = clock
        self.window = 60.0
        self._w = 60
        self.max_org_series = 1000
        self.configure(window_seconds, max_org_series)
        #: the policy in force (the engine sets it): flows' weights and strict classes
        self.policy: Policy | None = None
        #: the engine's view of the queues: ``{(pool, org): queued_at of its oldest waiting request}``
        self.oldest: Callable[[], Mapping[tuple[str, str], float]] | None = None
        #: the engine's prediction of a new request's wait, ``(org, class, pool) -> seconds``
        #: (``None``: no prediction); ``/stats`` gives it per org
        self.predicted: Callable[[str, str, str], float | None] | None = None
        self._weights: dict[tuple[str, str], tuple[float, bool]] = {}
        self._weights_of: Policy | None = None
        # the bounded series: which orgs have their own label, and what each series has counted
        self._labelled: set[str] = set()
        self._assigned: set[str] = set()  # orgs given a label (their own or _other) at least once
        self._chosen_at = -math.inf
        self._mark: dict[Key, dict[tuple[str, str], float]] = {}  # a demoted org's flows: counts when demoted
        self._hidden: dict[Key, dict[tuple[str, str], float]] = {}  # counted under _other while it was there
        self._other_base: dict[tuple[str, str], dict[tuple[str, str], float]] = {}  # (class, pool): left _other
        self._other_created: dict[tuple[str, str], float] = {}
        #: the wait histogram per (class, pool): [waits per bucket, sum, created]
        self._hist: dict[tuple[str, str], list[Any]] = {}
        #: the time to first token per (class, pool) (:meth:`first_token`)
        self._ttft: dict[tuple[str, str], _Firsts] = {}
        for k in flows:
            self._get(k)
        self.collector = _Collector(self)
        self.registry.register(self.collector)

    def configure(self, window_seconds: float, max_org_series: int) -> None:
        """Set the share window (seconds, >= 1) and the most orgs with their own label (>= 1)."""
        if isinstance(window_seconds, bool) or not isinstance(window_seconds, (int, float)) or not (
                math.isfinite(window_seconds) and window_seconds >= 1):
            raise ValueError(f"window_seconds must be a number of seconds >= 1, got {window_seconds!r}")
        if isinstance(max_org_series, bool) or not isinstance(max_org_series, int) or max_org_series < 1:
            raise ValueError(f"max_org_series must be an integer >= 1, got {max_org_series!r}")
        self.window = float(window_seconds)
        self._w = int(math.ceil(self.window))
        self.max_org_series = max_org_series

    def _get(self, key: Key) -> FlowCounters:
        fc = self.flows.get(key)
        if fc is None:
            fc = self.flows[key] = FlowCounters()
            fc.last = self.clock()
        return fc

    # ------------------------------------------------------------ events
    def _record(self, fc: FlowCounters, now: float) -> list[Any]:
        return _second(fc.recent, int(now), self._w, (0.0, None))

    def _unqueued(self, fc: FlowCounters) -> None:
        """The flow has nothing waiting any more: close its span of waiting, kept only when it
        covered a whole second (a shorter one makes no second backlogged)."""
        start = fc.since
        if start is None:
            return
        fc.since = None
        now = fc.last = self.clock()
        if math.ceil(start) + 1 > now:
            return
        sp = fc.spans
        sp.append([start, now])
        old = now - self._w - 1
        i = 0
        while sp[i][1] < old:  # (stops at the span just added at the latest)
            i += 1
        if i:
            del sp[:i]

    def queued(self, key: Key, n: int = 1) -> None:
        fc = self.flows.get(key) or self._get(key)
        fc.waiting += n
        if fc.since is None and fc.waiting > 0:
            fc.since = self.clock()

    def started(self, key: Key, wait: float, cost: float, retry: bool) -> None:
        """An attempt started after ``wait`` seconds, charged ``cost`` at dispatch (the charge
        is counted when the attempt ends, :meth:`attempt_ended`, every correction made)."""
        fc = self.flows.get(key) or self._get(key)
        fc.waiting -= 1
        fc.in_flight += 1
        fc.attempts += 1
        fc.waits += wait
        b = bisect_left(WAIT_BUCKETS, wait)
        fc.wait_buckets[b] += 1
        h = self._hist.get((key[1], key[2]))
        if h is None:
            h = self._hist[key[1], key[2]] = [[0] * _NB, 0.0, time.time()]
        h[0][b] += 1
        h[1] += wait
        if fc.waiting <= 0:
            self._unqueued(fc)
        r = self._record(fc, self.clock())
        w = r[2]
        if w is None:
            w = r[2] = [0] * _NB
        w[b] += 1
        if retry:
            fc.retries += 1

    def began(self, key: Key, cost: float) -> None:
        """A request queued and started at once: :meth:`queued`, then :meth:`started` after
        0 s (its first attempt)."""
        self.queued(key)
        self.started(key, 0.0, cost, False)

    def completed(self, key: Key, served_cost: float | None, charged: float) -> None:
        """A request's attempt ended and the request completed: :meth:`attempt_ended`, then
        :meth:`ended` (``completed``)."""
        self.attempt_ended(key, served_cost=served_cost, charged=charged)
        self.ended(key, "completed")

    def attempt_ended(self, key: Key, *, served_cost: float | None = None, upstream_429: bool = False,
                      timeout: bool = False, charged: float | None = None) -> None:
        """An attempt ended: ``served_cost`` is what it delivered, ``charged`` what the engine
        charged its flow for it (both cost units)."""
        fc = self.flows.get(key) or self._get(key)
        fc.in_flight -= 1
        if charged:
            fc.charged_cost += charged
        if served_cost:
            fc.served_cost += served_cost
            self._record(fc, self.clock())[1] += served_cost
        if upstream_429:
            fc.upstream_429 += 1
        if timeout:
            fc.timeouts += 1

    def left_queue(self, key: Key) -> None:
        fc = self.flows.get(key) or self._get(key)
        fc.waiting -= 1
        if fc.waiting <= 0:
            self._unqueued(fc)

    def timeout(self, key: Key) -> None:
        fc = self.flows.get(key) or self._get(key)
        fc.timeouts += 1

    def cancelled_work_tokens(self, key: Key, tokens: float) -> None:
        if tokens > 0:
            fc = self.flows.get(key) or self._get(key)
            fc.cancelled_work += tokens

    def ended(self, key: Key, outcome: str, reason: str | None = None) -> None:
        fc = self.flows.get(key) or self._get(key)
        outcomes = fc.outcomes
        if outcome not in outcomes:
            raise ValueError(f"unknown outcome {outcome!r}")
        outcomes[outcome] += 1
        if reason is not None:
            fc.reasons[reason] = fc.reasons.get(reason, 0) + 1
            if reason in MISSED:
                fc.missed += 1
            if outcome == "refused":
                fc.refused_by[reason] = fc.refused_by.get(reason, 0) + 1
                if fc.since is None:  # (refused while idle: its last activity; else _idle's)
                    fc.last = self.clock()

    def first_token(self, key: Key, seconds: float | None) -> None:
        """A request of ``key`` got its first byte of answer ``seconds`` after it arrived (its
        time to first token, as the gateway saw it), or (``None``) ended without an answer for
        one of ``OBJECTIVE_MISSED``: counted for its class's ``ttft_objective_seconds``
        (``sfq_time_to_first_token_seconds``, ``sfq_objective_attainment``, ``/stats``)."""
        cls, pool = key[1], key[2]
        p = self.policy
        spec = p.classes.get(cls) if p is not None else None
        objective = spec.ttft_objective_seconds if spec is not None else None
        h = self._ttft.get((cls, pool))
        if h is None:
            h = self._ttft[cls, pool] = _Firsts(objective)
        r = _second(h.recent, int(self.clock()), self._w, (None, 0, 0))
        r[3] += 1
        if seconds is None:
            return
        if seconds < 0.0:
            seconds = 0.0
        b = bisect_left(h.bounds, seconds)
        h.buckets[b] += 1
        h.total += seconds
        counts = r[1]
        if counts is None:
            counts = r[1] = [0] * len(h.buckets)
        counts[b] += 1
        if objective is not None and seconds <= objective:
            r[2] += 1

    def objectives(self, pool: str | None = None) -> dict[tuple[str, str], dict[str, Any]]:
        """Per (class, pool) with a request counted by :meth:`first_token` in the share window:
        ``attainment`` (the part of them whose first token came within the class's objective;
        ``None`` for a class without one), ``attainment_requests`` (how many were counted), and
        ``ttft_p50``, ``ttft_p99`` (seconds, over those answered; ``None`` if none)."""
        p = self.policy
        lo = int(self.clock()) - self._w + 1
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for (cls, fp), h in self._ttft.items():
            if pool is not None and fp != pool:
                continue
            counts: list[int] | None = None
            met = n = 0
            for sec, c, m, k in h.recent:
                if sec < lo:
                    continue
                met += m
                n += k
                if c is not None:
                    counts = list(c) if counts is None else [a + b for a, b in zip(counts, c)]
            if not n:
                continue
            spec = p.classes.get(cls) if p is not None else None
            has = spec is not None and spec.ttft_objective_seconds is not None
            out[cls, fp] = {"attainment": met / n if has else None, "attainment_requests": n,
                            "ttft_p50": None if counts is None else wait_quantile(counts, 0.5, h.bounds),
                            "ttft_p99": None if counts is None else wait_quantile(counts, 0.99, h.bounds)}
        return out

    def joined(self, key: Key) -> None:
        """A request joined a running one with the same ``Idempotency-Key``: counted in
        ``sfq_requests_total{outcome="joined"}`` (not an outcome of the policy's: the request
        it joined has that)."""
        fc = self.flows.get(key) or self._get(key)
        fc.joins += 1

    def snapshot(self) -> dict[Key, dict[str, Any]]:
        return {k: fc.as_dict() for k, fc in self.flows.items()}

    # ------------------------------------------------------------ forgetting
    @property
    def idle_horizon(self) -> float:
        """Seconds a flow of an org made from the template stays idle before it is forgotten:
        the share window and a second (it no longer counts in any figure of the window), and
        at least a minute."""
        return max(60.0, self.window + 1.0)

    def forget_idle(self) -> int:
        """Forget the counters of flows of orgs the policy file does not name (orgs made from
        its ``org_template``: names an embedder made up, unbounded) that have had nothing
        waiting or running for :attr:`idle_horizon` seconds; returns how many. O(flows); a
        driver calls it on a timer (``PolicyEngine.forget_idle``).

        Nothing a figure needs is lost: such a flow no longer counts in the share window, and
        a forgotten org that comes back is a new one (its series start again, with a new
        ``_created``, which Prometheus reads as a counter reset). An org counted under
        ``_other`` leaves its counts there (``_other`` stays monotonic); an org with its own
        label has its series end (as a demoted org's do: nothing is counted twice), and its
        label goes to the next org. The orgs the file names are never forgotten (they are
        bounded by the file, and an operator reads their series)."""
        p = self.policy
        named: Mapping[str, Any] = p.orgs if p is not None else {}
        before = self.clock() - self.idle_horizon
        gone = [k for k, fc in self.flows.items()
                if fc.since is None and fc.last < before and not fc.waiting and not fc.in_flight
                and k[0] and k[0] != OTHER_ORG and k[0] not in named]
        if not gone:
            return 0
        flows = self.flows
        for k in gone:
            fc = flows.pop(k)
            mark = self._mark.pop(k, None)
            self._hidden.pop(k, None)
            if k[0] not in self._labelled:  # counted under _other: its counts stay there
                vec = fc.vector()
                if mark is not None:
                    vec = _minus(vec, mark)
                _add_into(self._other_base.setdefault((k[1], k[2]), {}), vec)
                self._other_created.setdefault((k[1], k[2]), time.time())
        left = {k[0] for k in flows}
        for k in gone:
            org = k[0]
            self._weights.pop((org, k[1]), None)
            if org not in left:
                self._labelled.discard(org)
                self._assigned.discard(org)
        if len(gone) > len(flows):  # (a dict keeps its size after deletions: a new one is compact)
            self.flows = dict(flows)
            self._weights = dict(self._weights)
            self._labelled = set(self._labelled)
            self._assigned = set(self._assigned)
        return len(gone)

    # ------------------------------------------------------------ the window, at read time
    def _weight(self, org: str, cls: str) -> tuple[float, bool]:
        """The flow's weight and whether its class is strict (remembered per policy)."""
        p = self.policy
        if self._weights_of is not p:
            self._weights_of = p
            self._weights = {}
        got = self._weights.get((org, cls))
        if got is not None:
            return got
        if p is None or cls not in p.classes:
            got = (1.0, False)
        else:
            try:
                got = (p.flow_weight(org, cls), p.classes[cls].strict)
            except KeyError:  # an org a reload removed: its flows keep their last figures, weight 1
                got = (1.0, p.classes[cls].strict)
        self._weights[org, cls] = got
        return got

    def org_weight(self, org: str) -> float | None:
        p = self.policy
        o = p.org(org, keep=False) if p is not None else None
        return None if o is None else o.weight

    def fairness(self) -> Fairness:
        """The window's figures now (O(flows + window) per pool), and the orgs with their own
        label (chosen again when due)."""
        now = self.clock()
        w = self._w
        top = int(now)
        lo = top - w + 1
        per_pool: dict[str, list[tuple[str, float, bool, int, float, float, FlowCounters, str]]] = {}
        backlogged_by_sec: dict[str, list[float]] = {}
        waits: dict[Key, list[int]] = {}
        score: dict[str, float] = {}
        for key, fc in self.flows.items():
            org, cls, pool = key
            if not org or not pool or not cls:
                continue  # refused before its org, class or pool was known: in no pool's figures
            mask = backlogged_mask(fc.spans, fc.since, now, lo, top) if fc.spans or fc.since is not None else 0
            served = mine = 0.0
            wq: list[int] | None = None
            weight, strict = self._weight(org, cls)
            secs = backlogged_by_sec.get(pool)
            if secs is None:
                secs = backlogged_by_sec[pool] = [0.0] * w
            counted = mask if not strict else 0
            for sec, cost, wc in fc.recent:
                if sec < lo:
                    continue
                if cost:
                    served += cost
                    if counted >> (sec - lo) & 1:
                        mine += cost
                        secs[sec - lo] += cost
                if wc is not None:
                    wq = list(wc) if wq is None else [a + b for a, b in zip(wq, wc)]
            if wq is not None:
                waits[key] = wq
            if mask or served or fc.waiting or fc.in_flight:
                score[org] = score.get(org, 0.0) + served + (1e-9 if mask else 0.0)
            per_pool.setdefault(pool, []).append((org, weight, strict, mask, served, mine, fc, cls))
        oldest = dict(self.oldest()) if self.oldest is not None else {}
        pools: dict[str, dict[str, _Org]] = {}
        pool_served: dict[str, float] = {}
        for pool, rows in per_pool.items():
            exp = expected_shares([(r[1], r[2], r[3], r[4], r[5]) for r in rows], backlogged_by_sec[pool])
            orgs: dict[str, _Org] = {}
            total = 0.0
            for (org, _, cls_strict, _, served, _, fc, cls), e in zip(rows, exp):
                o = orgs.get(org)
                if o is None:
                    o = orgs[org] = _Org()
                    o.weight = self.org_weight(org)
                    o.oldest = oldest.get((pool, org))
                o.served += served
                total += served
                o.expected += e
                o.waiting += fc.waiting
                o.in_flight += fc.in_flight
                o.flows.append(fc)
                o.classes.append(cls)
            pools[pool] = orgs
            pool_served[pool] = total
        for (org, _, pool), wq in waits.items():
            pools[pool][org].add_waits(wq)
        demoted: set[str] = set()
        labelled = self._choose(now, score, demoted)
        return Fairness(time.time(), self.window, pools, pool_served, labelled, demoted, now)

    def _choose(self, now: float, score: Mapping[str, float], demoted: set[str]) -> set[str]:
        """The orgs with their own label: free places go to the best served orgs not placed yet
        at every read; all places are chosen again at most once per window, a newcomer taking a
        place only when served more than ``HYSTERESIS`` times what the weakest holder was."""
        known = {k[0] for k in self.flows if k[0] and k[0] != OTHER_ORG}
        new = known - self._assigned
        cap = self.max_org_series
        if now - self._chosen_at >= self.window and self._assigned:
            self._chosen_at = now
            held = self._labelled
            ranked = sorted(known, key=lambda o: (-(score.get(o, 0.0) * (HYSTERESIS if o in held else 1.0)),
                                                  o not in held, o))
            want = set(ranked[:cap])
            moving = (held - want) | (want - held - new)
            by_org: dict[str, list[Key]] = {}
            if moving:
                for k in self.flows:
                    if k[0] in moving:
                        by_org.setdefault(k[0], []).append(k)
            for org in held - want:
                self._demote(org, by_org.get(org, []))
                demoted.add(org)
            for org in want - held:
                if org in new:  # never shown yet: its own series from its first event
                    self._labelled.add(org)
                else:
                    self._promote(org, by_org.get(org, []))
            self._assigned |= new
            return self._labelled
        if self._chosen_at == -math.inf and new:
            self._chosen_at = now
        if new:
            free = cap - len(self._labelled)
            for org in sorted(new, key=lambda o: (-score.get(o, 0.0), o)):
                if free > 0:
                    self._labelled.add(org)  # its series count from its first event
                    free -= 1
            self._assigned |= new
        return self._labelled

    def _demote(self, org: str, keys: list[Key]) -> None:
        self._labelled.discard(org)
        for k in keys:
            self._mark[k] = self.flows[k].vector()

    def _promote(self, org: str, keys: list[Key]) -> None:
        """``org`` leaves ``_other`` for its own label: what it counted under ``_other`` stays
        there (``_other_base``) and is never counted again under its own label (``_hidden``)."""
        self._labelled.add(org)
        for k in keys:
            mark = self._mark.pop(k, _ZERO)
            there = _minus(self.flows[k].vector(), mark)
            _add_into(self._hidden.setdefault(k, {}), there)
            _add_into(self._other_base.setdefault((k[1], k[2]), {}), there)

    # ------------------------------------------------------------ /stats
    def stats(self, pool: str | None = None) -> dict[str, Any]:
        """The fair-share figures as JSON (``GET /stats``, docs/API.md): per pool, its orgs
        (labelled ones, the rest under ``_other``), over the last ``window_seconds``."""
        f = self.fairness()
        out: dict[str, Any] = {}
        names = list(self.policy.pools) if self.policy is not None else sorted(f.pools)
        for name in names:
            if pool is not None and name != pool:
                continue
            total = f.served.get(name, 0.0)
            orgs = {}
            waiting = in_flight = 0
            predict = self.predicted
            for org, o in f.grouped(name).items():
                waiting += o.waiting
                in_flight += o.in_flight
                predicted: dict[str, float | None] | None = None
                if org != OTHER_ORG:
                    predicted = {c: None if predict is None else predict(org, c, name) for c in sorted(set(o.classes))}
                orgs[org] = {
                    "weight": o.weight if org != OTHER_ORG else None,
                    "share": o.served / total if total > 0 else 0.0,
                    "expected_share": o.expected, "served_cost": o.served,
                    "waiting": o.waiting, "in_flight": o.in_flight,
                    "oldest_wait_seconds": None if o.oldest is None else max(0.0, f.now - o.oldest),
                    "wait_p50": None if o.waits is None else wait_quantile(o.waits, 0.5),
                    "wait_p99": None if o.waits is None else wait_quantile(o.waits, 0.99),
                    "classes": sorted(set(o.classes)), "requests": o.outcomes(),
                    "predicted_wait_seconds": predicted}
            out[name] = {"jain": f.jain(name), "waiting": waiting, "in_flight": in_flight, "served_cost": total,
                         "orgs": orgs, "classes": self._classes(name)}
        return {"time": f.time, "window_seconds": self.window, "pools": out, "classes": self._service_levels()}

    def _service_levels(self) -> dict[str, dict[str, Any]]:
        return {} if self.policy is None else service_levels(self.policy)

    def _classes(self, pool: str) -> dict[str, dict[str, Any]]:
        """``/stats``' classes of one pool: each class a request of the pool was in, with its
        weight (``None`` for a strict class), its requests now, its deadline misses and its
        requests by outcome since the start (over every org)."""
        p = self.policy
        out: dict[str, dict[str, Any]] = {}
        objectives = self.objectives(pool)

        def row(cls: str) -> dict[str, Any]:
            spec = p.classes.get(cls) if p is not None else None
            strict = spec is not None and spec.strict
            got = objectives.get((cls, pool))
            return {"weight": None if strict else (spec.weight if spec is not None else 1.0),
                    "strict": strict, "waiting": 0, "in_flight": 0, "deadline_missed": 0,
                    "deadline_seconds": None if spec is None else spec.deadline_seconds,
                    "ttft_objective_seconds": None if spec is None else spec.ttft_objective_seconds,
                    "attainment": None, "attainment_requests": 0, "ttft_p50": None, "ttft_p99": None,
                    **(got or {}), "requests": dict.fromkeys((*OUTCOMES, "joined"), 0)}

        for (org, cls, fp), fc in self.flows.items():
            if fp != pool or not org or not cls:
                continue
            c = out.get(cls)
            if c is None:
                c = out[cls] = row(cls)
            c["waiting"] += fc.waiting
            c["in_flight"] += fc.in_flight
            c["deadline_missed"] += fc.missed
            req = c["requests"]
            for k, n in fc.outcomes.items():
                req[k] += n
            req["joined"] += fc.joins
        for cls, fp in objectives:  # (a class whose flows were forgotten: its window still counts)
            if cls not in out:
                out[cls] = row(cls)
        return dict(sorted(out.items()))


def service_levels(policy: Policy) -> dict[str, dict[str, Any]]:
    """Per class of ``policy``: its service levels (docs/policy.md, "Deadlines and service
    levels"): whether it is strict, its default deadline, the time to first token promised and
    whether it refuses unmeetable deadlines (``None`` where the file sets none)."""
    return {c.name: {"strict": c.strict, "deadline_seconds": c.deadline_seconds,
                     "ttft_objective_seconds": c.ttft_objective_seconds, "refuse_unmeetable": c.refuse_unmeetable}
            for c in policy.classes.values()}


def _minus(a: Mapping[tuple[str, str], float], b: Mapping[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    return {k: v - b.get(k, 0) for k, v in a.items()}


def _add_into(a: dict[tuple[str, str], float], b: Mapping[tuple[str, str], float]) -> None:
    for k, v in b.items():
        a[k] = a.get(k, 0) + v


#: (name, help, type, label names); the order the series are exposed in
_FAMILIES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("sfq_queue_wait_seconds", "Wait before start (seconds), per class and pool", "histogram", ("class", "pool")),
    ("sfq_time_to_first_token_seconds", "Time to first token as the gateway saw it: from a request's arrival to the "
     "first byte of its answer (the first event of a stream), per class and pool; the buckets include the class's "
     "ttft_objective_seconds", "histogram", ("class", "pool")),
    ("sfq_objective_attainment", "The part of the class's requests over the window whose first token came within its "
     "ttft_objective_seconds (those that ended for their deadline without an answer count as misses)", "gauge",
     ("class", "pool")),
    ("sfq_requests", "Requests by outcome", "counter", (*_LABELS, "outcome")),
    ("sfq_refusals", "Requests refused or dropped before start, by reason", "counter", (*_LABELS, "reason")),
    ("sfq_failures", "Requests that failed, by reason", "counter", (*_LABELS, "reason")),
    ("sfq_queue_length", "Requests waiting (not started)", "gauge", _LABELS),
    ("sfq_in_flight", "Requests running on a backend", "gauge", _LABELS),
    ("sfq_charged_cost", "Cost the engine charged for attempts that ended, every correction made (cost units)",
     "counter", _LABELS),
    ("sfq_served_cost", "Cost served: usage reports, or what passed to the client of a request that ended early "
                        "(cost units)", "counter", _LABELS),
    ("sfq_cancelled_work_tokens", "Tokens produced for requests cancelled while running (streams)", "counter",
     _LABELS),
    ("sfq_upstream_429", "Upstream 429 answers", "counter", _LABELS),
    ("sfq_timeouts", "Queue-age or deadline expiries and backend timeouts", "counter", _LABELS),
    ("sfq_deadline_missed", "Requests ended because their deadline (X-SFQ-Timeout, timeout=) or their class's "
                            "max_queue_age_seconds ran out: in the queue, between retries or while running",
     "counter", _LABELS),
    ("sfq_attempts", "Attempts started (first tries and retries)", "counter", _LABELS),
    ("sfq_retries", "Retries started", "counter", _LABELS),
    ("sfq_share", "The org's share of the pool's served cost over the window", "gauge", ("pool", "org")),
    ("sfq_expected_share", "The share the weights promise the org over the window: among the orgs with a request "
     "waiting throughout a second, by weight; what it got in a second it was not", "gauge", ("pool", "org")),
    ("sfq_oldest_wait_seconds", "Age of the org's oldest waiting request", "gauge", ("pool", "org")),
    ("sfq_fairness_jain", "Jain's index of served / expected share over the pool's orgs with an expected share",
     "gauge", ("pool",)),
    ("sfq_org_weight", "The org's weight (policy file)", "gauge", ("org",)),
)
_FAMILY = {"histogram": HistogramMetricFamily, "counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
#: the counter families made from :meth:`FlowCounters.vector`, and their extra label
_EXTRA = {"sfq_requests": "outcome", "sfq_refusals": "reason", "sfq_failures": "reason"}


class _Collector(Collector):
    """The policy's series, made from the plain counters when the registry is collected (a
    scrape). A labelled org's series' ``_created`` is when its flow was first seen; ``_other``'s
    when it first held an org."""

    def __init__(self, m: PolicyMetrics) -> None:
        self.m = m

    def describe(self) -> Iterator[Metric]:
        for name, doc, typ, labels in _FAMILIES:
            yield _FAMILY[typ](name, doc, labels=labels)

    def collect(self) -> Iterator[Metric]:
        m = self.m
        f = m.fairness()
        labelled = f.labelled
        fam = {name: _FAMILY[typ](name, doc, labels=labels) for name, doc, typ, labels in _FAMILIES}
        created = _prom_metrics._use_created  # (prometheus_client.disable_created_metrics() turns it off)
        others: dict[tuple[str, str], list[Any]] = {}  # (class, pool): [counters, waiting, in flight]
        for key, fc in list(m.flows.items()):
            org, cls, pool = key
            own = org in labelled or org == ""
            if own or org in f.demoted:  # (a demoted org's counters show once more, with their last counts)
                vec = fc.vector()
                hidden = m._hidden.get(key)
                if hidden:
                    vec = _minus(vec, hidden)
                self._flow(fam, {"org": org, "class": cls, "pool": pool}, vec, fc.waiting, fc.in_flight,
                           fc.created if created else None, gauges=own)
                if own:
                    continue
            acc = others.get((cls, pool))
            if acc is None:
                base = m._other_base.get((cls, pool))
                acc = others[cls, pool] = [dict(base) if base else {}, 0, 0]
            mark = m._mark.get(key)
            _add_into(acc[0], fc.vector() if mark is None else _minus(fc.vector(), mark))
            acc[1] += fc.waiting
            acc[2] += fc.in_flight
        for (cls, pool), base in m._other_base.items():  # _other's counts stay when it holds no org now
            if (cls, pool) not in others:
                others[cls, pool] = [dict(base), 0, 0]
        for (cls, pool), (vec, waiting, in_flight) in others.items():
            ts = m._other_created.setdefault((cls, pool), time.time())
            self._flow(fam, {"org": OTHER_ORG, "class": cls, "pool": pool}, vec, waiting, in_flight,
                       ts if created else None)
        wait = fam["sfq_queue_wait_seconds"].samples
        for (cls, pool), (buckets, total, ts) in list(m._hist.items()):
            lab = {"class": cls, "pool": pool}
            cum = 0.0
            for le, n in zip(_LE, buckets):
                cum += n
                wait.append(Sample("sfq_queue_wait_seconds_bucket", {**lab, "le": le}, cum))
            wait.append(Sample("sfq_queue_wait_seconds_count", lab, cum))
            wait.append(Sample("sfq_queue_wait_seconds_sum", lab, float(total)))
            if created:
                wait.append(Sample("sfq_queue_wait_seconds_created", lab, ts))
        ttft = fam["sfq_time_to_first_token_seconds"].samples
        for (cls, pool), h in list(m._ttft.items()):
            if not any(h.buckets):
                continue  # (only misses so far: no time to first token)
            lab = {"class": cls, "pool": pool}
            cum = 0.0
            for le, n in zip(h.le, h.buckets):
                cum += n
                ttft.append(Sample("sfq_time_to_first_token_seconds_bucket", {**lab, "le": le}, cum))
            ttft.append(Sample("sfq_time_to_first_token_seconds_count", lab, cum))
            ttft.append(Sample("sfq_time_to_first_token_seconds_sum", lab, float(h.total)))
            if created:
                ttft.append(Sample("sfq_time_to_first_token_seconds_created", lab, h.created))
        attain = fam["sfq_objective_attainment"].samples
        for (cls, pool), got in m.objectives().items():
            if got["attainment"] is not None:
                attain.append(Sample("sfq_objective_attainment", {"class": cls, "pool": pool}, got["attainment"]))
        share, expected, oldest = (fam["sfq_share"].samples, fam["sfq_expected_share"].samples,
                                   fam["sfq_oldest_wait_seconds"].samples)
        weights: dict[str, float] = {}
        for pool in f.pools:
            total = f.served.get(pool, 0.0)
            for org, o in f.grouped(pool).items():
                lab = {"pool": pool, "org": org}
                share.append(Sample("sfq_share", lab, o.served / total if total > 0 else 0.0))
                expected.append(Sample("sfq_expected_share", lab, o.expected))
                if o.oldest is not None:
                    oldest.append(Sample("sfq_oldest_wait_seconds", lab, max(0.0, f.now - o.oldest)))
                if org != OTHER_ORG and o.weight is not None:
                    weights[org] = o.weight
            j = f.jain(pool)
            if j is not None:
                fam["sfq_fairness_jain"].samples.append(Sample("sfq_fairness_jain", {"pool": pool}, j))
        fam["sfq_org_weight"].samples.extend(Sample("sfq_org_weight", {"org": org}, w) for org, w in weights.items())
        yield from fam.values()

    @staticmethod
    def _flow(fam: dict[str, Metric], lab: dict[str, str], vec: Mapping[tuple[str, str], float], waiting: int,
              in_flight: int, ts: float | None, gauges: bool = True) -> None:
        for o in OUTCOMES:
            _counter(fam["sfq_requests"].samples, "sfq_requests", {**lab, "outcome": o},
                     vec.get(("sfq_requests", o), 0), ts)
        attempts = vec.get(("sfq_attempts", ""), 0)
        for (name, value_label), n in vec.items():  # (a series shows from its first count: 0 only after a move)
            extra = _EXTRA.get(name)
            if extra is not None:
                if name == "sfq_requests" and value_label in OUTCOMES:
                    continue
                _counter(fam[name].samples, name, {**lab, extra: value_label}, n, ts)
            else:
                _counter(fam[name].samples, name, lab, n, ts)
        if attempts and ("sfq_charged_cost", "") not in vec:
            _counter(fam["sfq_charged_cost"].samples, "sfq_charged_cost", lab, 0.0, ts)
        if gauges:
            fam["sfq_queue_length"].samples.append(Sample("sfq_queue_length", lab, float(waiting)))
            fam["sfq_in_flight"].samples.append(Sample("sfq_in_flight", lab, float(in_flight)))


def _counter(samples: list[Sample], name: str, labels: dict[str, str], value: float, created: float | None) -> None:
    samples.append(Sample(name + "_total", labels, float(value)))
    if created is not None:
        samples.append(Sample(name + "_created", labels, created))
