"""``Dispatcher``: the fleet's face of the one asyncio driver (:class:`PolicyDispatcher`).

A ``Dispatcher`` is a :class:`~sfq.dispatch.PolicyDispatcher` under the policy its fleet
makes (:class:`FleetPolicy`): one pool per model, one class, and every flow id the caller
names its own org, weighted by :meth:`Dispatcher.set_weight`. Every primitive is the
driver's own and means the same in both (``submit``, ``stream``, ``acquire``,
``open_stream``, ``timeout``, the queue bound, the errors and their ``param``, ``stats()``);
this module only turns the caller's flow id and the body's model into the driver's
``Flow``, and keeps per-flow statistics bounded in number (:class:`FlowTally`) instead of a
Prometheus series per flow id, which a proxy keyed by API keys could grow without end.
"""

from __future__ import annotations

import functools
import math
import random
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from .._common import unhashable_flow
from ..backends.base import Backend
from ..backends.health import HealthOptions
from ..backends.openai import OpenAIBackend
from ..cost import CostEstimator
from ..engine.pool import Request
from ..errors import UnknownModel
from ..policy.charge import CHARGE_MODES
from ..policy.classify import Flow
from ..policy.config import BackendSpec, ClassSpec, CostSpec, OrgSpec, Policy, PoolSpec, RetrySpec, UpstreamTimeouts
from .permit import Permit
from .policy_calls import PolicyEventStream
from .policy_dispatcher import PolicyDispatcher
from .stream import EventStream
from .tally import FlowTally

__all__ = ["DEFAULT_CLASS", "DEFAULT_POOL", "Dispatcher", "DispatchRecord", "FleetPolicy", "FlowTally"]

#: the name of the default pool (backends with ``model=None``) in the request engine
DEFAULT_POOL = "(default)"
#: the one class of a dispatcher's flows in the request engine
DEFAULT_CLASS = "default"
#: a dispatcher's backends are the caller's, with their own timeouts (``OpenAIBackend``'s
#: ``read_timeout``, ``timeout``, ``stream_timeout``): the driver adds none of its own
_OWN_TIMEOUTS = UpstreamTimeouts(first_byte=None, between_events=None, total=None)


@functools.lru_cache(maxsize=1024)
def _weighted(weight: float) -> OrgSpec:
    """The org spec of a flow of ``weight`` (one per weight, not one per call)."""
    return OrgSpec("*", (), (DEFAULT_CLASS,), weight)


@dataclass(frozen=True)
class FleetPolicy(Policy):
    """The policy a ``Dispatcher`` runs its fleet under: one pool per model, one class, and
    every flow id its own org, weighted by ``Dispatcher.set_weight`` (default 1): the
    degenerate case of a policy file, applied by the same request engine."""

    weights: dict[Hashable, float] = field(default_factory=dict, compare=False)

    def org(self, name: str, *, keep: bool = True) -> OrgSpec | None:
        w = self.weights.get(name)
        return _weighted(1.0) if w is None else _weighted(w)

    def allows(self, flow: tuple[str, ...]) -> bool:
        return len(flow) == 3 and flow[1] in self.classes and flow[2] in self.pools  # (every org: the caller's)

    def flow_weight(self, org: str, cls: str) -> float:
        c = self.classes[cls]  # (KeyError for another class, as Policy.flow_weight)
        w = self.weights.get(org)
        return (1.0 if w is None else w) * (1.0 if c.strict else c.weight)


class DispatchRecord(NamedTuple):
    """What ``on_dispatch`` receives when a request is sent to a backend.

    ``start``/``finish``: the flow's meter before and after the charge (cost units, the
    scheduler's ``Dispatch``); ``wait``: seconds from submit to send (injected clock).
    """

    flow: Hashable
    ticket: int  # the request's id (increases with every request)
    cost: float
    start: float
    finish: float
    model: str | None
    backend: str
    wait: float


#: flows ``Dispatcher._flow`` remembers before it starts again
_MADE = 4096


def _json_key(flow: Hashable) -> str:
    """A flow id (or a pool's model) as a ``stats()`` key: a string, as ``json.dumps`` writes a
    key (``None``: ``"null"``, ``True``: ``"true"``, ``1``: ``"1"``, ``2.5``: ``"2.5"``); other
    ids, their ``str``. So ``stats()`` is JSON whatever the ids (``orjson`` takes only str keys)."""
    if type(flow) is _Id:
        flow = flow.id
    if type(flow) is str:
        return flow
    if flow is None or isinstance(flow, bool):
        return {None: "null", True: "true", False: "false"}[flow]
    if isinstance(flow, float):
        return float.__repr__(flow)
    if isinstance(flow, int):
        return int.__repr__(flow)
    return str(flow)


#: flow ids whose hash and equality are the interpreter's own (and a tuple of them): the engine
#: may hash and compare them as often as it needs, and no code of the caller's runs
_PLAIN = frozenset({str, int, float, bool, bytes, type(None)})


class _Id:
    """The engine's stand-in for a caller's flow id of any other type (an object of a class of
    its own, a tuple holding one). There is one per id while the engine holds anything of the
    flow (``Dispatcher._ids`` keeps them weakly, keyed by the id: the id's own ``__hash__`` and
    ``__eq__`` run there, on entry, where an exception changes nothing). Inside the engine, in
    the core and in the statistics the stand-in is hashed and compared by identity, so an id
    whose ``__hash__`` or ``__eq__`` raises, re-enters or changes between calls cannot leave an
    operation half done (a slot held, a flow in the core that no queue knows)."""

    __slots__ = ("id", "__weakref__")

    def __init__(self, flow: Hashable) -> None:
        self.id = flow  # the caller's id

    def __repr__(self) -> str:  # (never the id's own repr: no code of the caller's runs)
        return f"<flow id of type {type(self.id).__name__}>"


def _caller_id(org: Any) -> Hashable:
    """The caller's flow id of an engine flow's org (its stand-in's id, or the id itself)."""
    return org.id if type(org) is _Id else org


class Dispatcher(PolicyDispatcher):
    """Shares a fleet of OpenAI-compatible servers fairly between flows you name, on asyncio.

    Every request says whose it is (a flow: any hashable id, e.g. the tenant your own
    authentication found; never read from the body); each flow gets a share of the fleet in
    proportion to its weight, measured in tokens (prompt + output), however many or large its
    requests are. It is the one asyncio driver of sfq's request engine
    (:class:`sfq.PolicyDispatcher`, which ``sfq serve`` runs) under the policy the fleet makes
    (one pool per model, one class, each flow its own org), so every call means what it
    means there::

        async with sfq.Dispatcher(["http://127.0.0.1:8001"]) as d:
            reply = await d.submit("team-a", {"model": "m", "prompt": "hi", "max_tokens": 32})
            async with d.open_stream("team-b", {"model": "m", "prompt": "hi", "stream": True}) as events:
                async for event in events:
                    ...
            async with d.acquire("team-c", body) as grant:    # your own HTTP client does the call
                ...

    Cancelling the awaiting task before dispatch removes the request uncharged; after, it
    aborts the backend call. Errors are :class:`sfq.SFQError` s (``http_status``,
    ``to_openai()``); a malformed body is :class:`sfq.errors.BadRequest`. For flows under a
    policy file (orgs, classes, limits) use :class:`sfq.PolicyDispatcher` itself.

    Parameters
    ----------
    backends:
        the fleet: ``Backend`` instances, or URLs (each becomes ``OpenAIBackend(url)``).
        Backends with the same ``model`` form a pool with one scheduler; backends with
        ``model=None`` form the default pool, which takes every model name no other pool
        serves. Names must be unique.
    estimator:
        the ``CostEstimator`` (default: ``CostEstimator()``, cost in tokens).
    charge:
        ``"served"`` (default), ``"settle"`` or ``"seed"`` (``sfq.policy.charge``; docs/policy.md).
    clock:
        seconds, for waits and deadlines (default ``time.monotonic``).
    overtake:
        0 (default): stall when the selected request fits on no backend with room; ``k > 0``:
        up to ``k`` such requests wait aside while later selections go out.
    health:
        the backends' health rules (``sfq.backends.health.HealthOptions``: the 5xx and
        transport thresholds, the health checks' backoff, the longest 429 pause).
    unavailable_timeout:
        seconds a request waits in a pool with no healthy backend before it is removed with
        ``NoHealthyBackend`` (default 30; ``None``: no bound).
    max_queue_length:
        requests that may wait in a pool (default 100,000; ``None``: no bound); beyond it the
        flow holding the most places gives its newest up (``Refused``, ``queue_full``, 429).
    max_attempts:
        tries per request, the first included (default 3; 1: never retried); see docs/policy.md.
    scheduler, rng:
        the core factory (default ``sfq.Scheduler``), one per pool; the retries' jitter source.
    on_dispatch:
        called with a ``DispatchRecord`` each time a request starts (synchronously: keep it short).
    wait_window, max_flow_stats:
        the last ``wait_window`` waits per flow are kept for ``stats()``'s percentiles; per-flow
        statistics are kept for at most about ``max_flow_stats`` flows (idle ones are forgotten
        first; flows with work in progress are always kept).
    close_grace:
        seconds ``close()`` lets running requests finish.
    forget_idle_after:
        seconds after which a flow with nothing waiting or running has its ``stats()`` row
        forgotten (default 60; ``None``: only beyond ``max_flow_stats``): with the engine's own
        forgetting (:meth:`forget_idle`, on a timer), a flow id seen once costs nothing after
        about a minute.
    """

    def __init__(
        self,
        backends: Iterable[Backend | str],
        *,
        estimator: CostEstimator | None = None,
        charge: str = "served",
        clock: Callable[[], float] = time.monotonic,
        overtake: int = 0,
        health: HealthOptions | None = None,
        unavailable_timeout: float | None = 30.0,
        max_queue_length: int | None = 100_000,
        max_attempts: int = 3,
        scheduler: Callable[[], Any] | None = None,
        rng: random.Random | None = None,
        on_dispatch: Callable[[DispatchRecord], None] | None = None,
        wait_window: int = 10_000,
        max_flow_stats: int = 100_000,
        close_grace: float = 30.0,
        forget_idle_after: float | None = 60.0,
    ) -> None:
        fleet: list[Backend] = [OpenAIBackend(b) if isinstance(b, str) else b for b in backends]
        if not fleet:
            raise ValueError("a Dispatcher needs at least one backend")
        for b in fleet:
            if not isinstance(b, Backend):
                raise TypeError(f"backends must be sfq.backends.Backend instances or URLs, got {b!r}")
        names = [b.name for b in fleet]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"backend names must be unique; repeated: {dup}")
        if not isinstance(charge, str) or charge not in CHARGE_MODES:
            raise ValueError(f"charge must be one of {', '.join(map(repr, CHARGE_MODES))}, got {charge!r}")
        for what, n, low in (("overtake", overtake, 0), ("max_attempts", max_attempts, 1),
                             ("wait_window", wait_window, 1), ("max_flow_stats", max_flow_stats, 1),
                             ("max_queue_length", 1 if max_queue_length is None else max_queue_length, 1)):
            if isinstance(n, bool) or not isinstance(n, int) or n < low:
                raise ValueError(f"{what} must be an integer >= {low}{' or None' if what == 'max_queue_length' else ''}"
                                 f", got {n!r}")
        fa = forget_idle_after
        if fa is not None and (isinstance(fa, bool) or not isinstance(fa, (int, float)) or not (
                fa > 0 and math.isfinite(fa))):
            raise ValueError(f"forget_idle_after must be a finite number of seconds > 0 or None, got {fa!r}")
        u = unavailable_timeout
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not (u > 0 and math.isfinite(u))):
            raise ValueError(f"unavailable_timeout must be a finite number > 0 or None, got {u!r}")
        if estimator is not None and not isinstance(estimator, CostEstimator):
            raise TypeError(f"estimator must be a CostEstimator, got {estimator!r}")
        e = estimator if estimator is not None else CostEstimator()
        pools: dict[str | None, list[Backend]] = {}
        for b in fleet:
            pools.setdefault(b.model, []).append(b)
        self._pool_names: dict[str | None, str] = {m: DEFAULT_POOL if m is None else m for m in pools}
        cls = ClassSpec(DEFAULT_CLASS, small_cost=None, max_queue_length=max_queue_length)
        policy = FleetPolicy(
            pools=MappingProxyType({self._pool_names[m]: PoolSpec(self._pool_names[m], () if m is None else (m,), tuple(
                BackendSpec(b.name, b.max_in_flight, b.name, b.max_context) for b in bs), timeouts=_OWN_TIMEOUTS)
                for m, bs in pools.items()}),
            classes=MappingProxyType({DEFAULT_CLASS: cls}), orgs=MappingProxyType({}),
            cost=CostSpec(e.input_weight, e.output_weight, e.default_max_tokens, e.prior_ratio, charge),
            retry=RetrySpec(max_attempts=max_attempts), source="<sfq.Dispatcher>")
        self.tally = FlowTally(max_flow_stats, wait_window, clock)
        self.forget_idle_after = None if fa is None else float(fa)
        super().__init__(policy, backends={b.name: b for b in fleet}, clock=clock, estimator=e,
                         health=health if health is not None else HealthOptions(), close_grace=close_grace, rng=rng,
                         scheduler=scheduler, metrics=self.tally)  # type: ignore[arg-type]
        self.charge = charge
        self.overtake = overtake
        self.unavailable_timeout = None if u is None else float(u)
        for q in self.engine.queues.values():
            q.overtake = overtake
            q.unavailable_timeout = math.inf if u is None else float(u)
            q.on_charge = self.tally.charged
        self.on_dispatch = on_dispatch
        if on_dispatch is not None:
            self.on_start = self._dispatched
        self._default = self._pool_names.get(None)
        self._only = self._default if len(self._pool_names) == 1 else None  # one default pool takes every model
        self._made: dict[Hashable, Flow] = {}  # the caller's flow id -> its Flow in the one pool (_only)
        #: the stand-ins of the flow ids that are not plain (``_Id``), while the engine holds them
        self._ids: weakref.WeakValueDictionary[Hashable, _Id] = weakref.WeakValueDictionary()

    # ------------------------------------------------------------ the caller's flow -> the driver's
    def _flow(self, flow: Hashable, body: object, model: str | None = None) -> Flow:
        if self._only is not None and (body is None or type(body) is dict):  # one pool: the flow by its id
            made = self._made
            try:
                f = made.get(flow)
            except TypeError:
                raise unhashable_flow(flow) from None
            if f is None:
                if len(made) >= _MADE:  # (ids are the caller's, unbounded: a bounded memo, never a leak)
                    made.clear()
                f = Flow(self._key(flow), DEFAULT_CLASS, self._only)  # type: ignore[arg-type]
                made[flow] = f
            return f
        key = self._key(flow)
        if body is not None and not isinstance(body, Mapping):
            # refused (BadRequest) where every refusal is, on entry (the driver's _admit checks
            # the body before it looks at the flow): any pool will do
            return Flow(key, DEFAULT_CLASS, next(iter(self.engine.queues)))  # type: ignore[arg-type]
        pool = self._only
        if pool is None:
            if model is None and isinstance(body, Mapping):
                model = body.get("model")
            pool = self._pool_names.get(model) if isinstance(model, str) and model else None
            if pool is None:
                pool = self._default
                if pool is None:
                    raise UnknownModel(f"no backend serves model {model!r}; pools: "
                                       f"{sorted(str(m) for m in self._pool_names)}")
        return Flow(key, DEFAULT_CLASS, pool)  # type: ignore[arg-type]  # the caller's flow id is the org

    def _key(self, flow: Hashable, make: bool = True) -> Hashable:
        """The engine's org for the caller's flow id: the id itself when it is plain, else its
        stand-in (``_Id``; made when ``make``, else ``None`` when it has none). Raises the error
        of an unhashable id here, before anything changes."""
        t = type(flow)
        if t in _PLAIN or (t is tuple and all(type(x) in _PLAIN for x in flow)):  # type: ignore[attr-defined]
            return flow
        ids = self._ids
        try:
            k = ids.get(flow)
        except TypeError:
            raise unhashable_flow(flow) from None
        if k is None and make:
            k = _Id(flow)
            ids[flow] = k
        return k

    def forget_idle(self) -> int:
        """:meth:`PolicyDispatcher.forget_idle`, and the per-flow statistics (``stats()["flows"]``
        rows) of flows idle for ``forget_idle_after`` seconds, and the memo of flow ids seen."""
        n = super().forget_idle()
        if self.forget_idle_after is not None:
            n += self.tally.forget_idle(self.clock() - self.forget_idle_after)
        self._made.clear()
        return n

    def _checked(self, flow: Flow) -> Flow:
        return flow  # made by _flow: its org is the caller's id, its class and pool the fleet's (no refusal)

    # ------------------------------------------------------------ the primitives
    async def submit(self, flow: Hashable, body: Mapping[str, Any], *,  # type: ignore[override]
                     cost: float | None = None, timeout: float | None = None,
                     idempotent: bool = False, max_wait: float | None = None) -> dict[str, Any]:
        """Queue a non-streaming request of ``flow`` and return the backend's JSON reply.

        ``body``: an OpenAI ``/v1/completions`` (``prompt``) or ``/v1/chat/completions``
        (``messages``) request; ``cost``: a fixed charge in cost units instead of the estimate;
        ``timeout``: the request's deadline, seconds from now (it bounds the whole request: 504
        ``Refused``, reason ``deadline``, if it runs out while it waits, ``DeadlineExceeded``
        while it runs); ``max_wait``: seconds it may wait for each start (504 ``Refused``,
        reason ``queue_timeout``, when it runs out first; it never cuts a running request; a
        retry waits anew). A bad ``timeout`` or ``max_wait`` is an ``sfq.errors.InvalidTimeout``
        (400). A failure before the reply is
        retried in the request's own flow, preferably on another backend (``max_attempts``,
        the retry budget: docs/policy.md). ``idempotent=True`` is the caller's promise that
        the server running the request twice is harmless: then every backend failure may be
        retried, and the backend may resend it after a lost connection.
        """
        f = self._flow(flow, body)
        return await self._submit(f, body, timeout, "idempotent" if idempotent else None, None, cost, max_wait)

    def stream(self, flow: Hashable, body: Mapping[str, Any], *,  # type: ignore[override]
               cost: float | None = None, timeout: float | None = None,
               max_wait: float | None = None) -> EventStream:
        """Queue a streaming request of ``flow``: the backend's events (JSON objects), opened when
        entered (``async with``) or at the first iteration, where every refusal raises. Closing
        it early (``aclose()``, leaving the ``async with``, ``break``) cancels the request and
        frees its slot. Usage is always asked of the backend; the usage-only final chunk is
        passed on only when the body asked for it (``stream_options.include_usage``).
        ``cost``, ``timeout``, ``max_wait``: as in :meth:`submit`."""
        return PolicyEventStream(self, self._flow(flow, body), None, None, body, timeout, None, cost, max_wait)

    def open_stream(self, flow: Hashable, body: Mapping[str, Any], *,
                    timeout: float | None = None, cost: float | None = None,
                    max_wait: float | None = None) -> EventStream:
        """:meth:`stream`, to enter with ``async with``: entering waits for the turn and the
        backend's first event, so every refusal can still be an HTTP status."""
        return PolicyEventStream(self, self._flow(flow, body), None, None, body, timeout, None, cost, max_wait)

    def acquire(self, flow: Hashable, body: Mapping[str, Any] | None = None, *,
                cost: float | None = None, timeout: float | None = None, model: str | None = None,
                max_wait: float | None = None) -> Permit:
        """Wait for ``flow``'s turn and learn where to send the request (``PolicyDispatcher.acquire``:
        with a body, or with ``cost=`` and none). ``model`` names the pool of a permit without
        a body when the fleet has several (default: the body's ``model``, else the default pool).
        ``timeout``, ``max_wait``: as in :meth:`submit` (``max_wait`` bounds the wait for the
        grant, never the granted call)."""
        return Permit(self, self._flow(flow, body, model), body, cost, timeout, max_wait)

    # ------------------------------------------------------------ controls and views
    def set_weight(self, flow: Hashable, weight: float) -> None:
        """Set ``flow``'s weight (> 0, default 1) in every pool, for its future charges."""
        queues = list(self.engine.queues.values())
        key = self._key(flow)  # (held by the weights while it is set: the same stand-in meanwhile)
        queues[0].sched.set_weight(Flow(key, DEFAULT_CLASS, queues[0].name), weight)  # type: ignore[arg-type]
        # (validated: raises before anything changed)
        for q in queues[1:]:
            q.sched.set_weight(Flow(key, DEFAULT_CLASS, q.name), weight)  # type: ignore[arg-type]
        self.policy.weights[key] = float(weight)  # type: ignore[attr-defined]

    def wake(self, *models: str | None) -> None:
        """Pump again (``models``: the pools to look at; every pool when none is given). A model
        no pool serves raises ``KeyError``."""
        for m in models:
            self._queue_of(m)
        if not self._closed:
            self._pump()

    def _queue_of(self, model: str | None) -> Any:
        try:
            return self.engine.queues[self._pool_names[model]]
        except (KeyError, TypeError):
            raise KeyError(f"no pool serves model {model!r}; pools: "
                           f"{sorted(str(m) for m in self._pool_names)}") from None

    def scheduler_of(self, model: str | None) -> Any:
        """The SFQ core of the pool serving ``model`` (``None``: the default pool), to look at
        (its flows are ``sfq.Flow(flow, "default", pool)``; :meth:`meter` reads one by the
        caller's id). ``KeyError`` when no pool has that name."""
        return self._queue_of(model).sched

    def flow_key(self, flow: Hashable, model: str | None = None) -> Flow:
        """The engine's (and the core's) id of ``flow`` in the pool serving ``model`` (an id
        that is not a str, number, bytes, ``None`` or a tuple of them is held there by a
        stand-in, which the returned flow holds)."""
        return Flow(self._key(flow), DEFAULT_CLASS, self._queue_of(model).name)  # type: ignore[arg-type]

    def meter(self, flow: Hashable, model: str | None = None) -> float:
        """``flow``'s meter (cost units) in the pool serving ``model`` (``None``: the default pool)."""
        q = self._queue_of(model)
        return float(q.sched.meter(Flow(self._key(flow), DEFAULT_CLASS, q.name)))  # type: ignore[arg-type]

    def _dispatched(self, r: Request) -> None:
        assert self.on_dispatch is not None and r.backend is not None and r.started_at is not None
        start = r.start_tag
        w = self.policy.flow_weight(r.flow.org, r.flow.cls)
        q = self.engine.queues[r.flow.pool]
        model = q.spec.models[0] if q.spec.models else None
        self.on_dispatch(DispatchRecord(_caller_id(r.flow.org), r.id, r.charged, start, start + r.charged / w, model, r.backend,
                                        r.started_at - r.queued_at))

    def stats(self) -> dict[str, Any]:
        """:meth:`PolicyDispatcher.stats` (``pools``, ``backends``; JSON-serialisable), with
        ``flows`` keyed by the caller's flow ids as strings (as ``json.dumps`` writes a key:
        ``1`` as ``"1"``, ``None`` as ``"null"``; any other id that is not a str: its ``str``),
        and ``pools`` by model (the default pool: ``"null"``). A flow's row: ``waiting``,
        ``held`` (first in line, waiting aside, uncharged, for a backend that fits),
        ``in_flight``, ``dispatched`` (attempts started),
        ``completed``, ``failed`` (after the retries), ``retried``, ``cancelled`` (before
        start, uncharged), ``aborted`` (while running), ``rejected`` (the dispatcher closed),
        ``unavailable`` (no healthy backend for ``unavailable_timeout``), ``expired`` (the
        deadline ran out before start), ``refused`` (other refusals), ``charged_cost`` (cost
        units) and ``wait_p50``/``wait_p95``/``wait_p99`` (seconds from arrival to start over
        the last ``wait_window`` starts; ``None`` before any). ``refused_other``: refusals of
        flows with no row (by reason). Its cost grows with the number of flows."""
        s = super().stats()
        t = self.tally
        flows: dict[str, Any] = {}
        for f, row in list(t.rows.items()):
            flows[_json_key(f)] = t.row(f, self._held(f) if row.waiting else 0)
        s["flows"] = flows
        s["refused_other"] = dict(t.refused_other)
        s.pop("unclassified", None)
        by_model: dict[str, Any] = {}
        for m, name in self._pool_names.items():
            p = s["pools"][name]
            q = self.engine.queues[name]
            p["held"] = len(q.aside) + int(q.stalled is not None and q.stalled.state == "waiting")
            p["waiting"] -= p["held"]
            p["healthy"] = sum(b["healthy"] for b in p["backends"].values())
            by_model[_json_key(m)] = p
        s["pools"] = by_model  # keyed by model ("null": the default pool), as the fleet was given
        model_of = {name: m for m, name in self._pool_names.items()}
        for b in s["backends"].values():
            b["model"] = model_of[b["pool"]]
        return s

    def flow_stats(self, flow: Hashable) -> dict[str, Any] | None:
        """One flow's row of :meth:`stats` (``None`` when it has none), in O(1) plus its wait
        percentiles: for a proxy's per-request look, where ``stats()`` walks every flow."""
        t = self.tally
        key = self._key(flow, make=False)
        row = None if key is None else t.rows.get(key)
        if row is None:
            return None
        return t.row(key, self._held(key) if row.waiting else 0)

    def _held(self, flow: Hashable) -> int:
        """Requests of ``flow`` first in line that fit no backend with room, in every pool."""
        n = 0
        for q in self.engine.queues.values():
            n += q.held(Flow(flow, DEFAULT_CLASS, q.name))  # type: ignore[arg-type]
        return n
