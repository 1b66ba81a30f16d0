"""``PolicyDispatcher``: a policy file in front of a fleet of OpenAI-compatible servers, on asyncio.

The request engine (:class:`sfq.engine.PolicyEngine`) decides everything: who the flow is,
every limit, who goes next and on which backend, what the request is charged and how the
charge is settled, retries, deadlines. This module is its asyncio driver and does only the
I/O, in the style of h11's drivers: it tells the engine what happened (a request arrived; it
started; it passed n output tokens to its client; it ended with this usage; it failed with
this error; its caller left; a backend went down, came back, was paused or saturated) and
carries out what the engine answers (start this request on that backend; answer this one
with that error; wake me at t). It calls the backends (:mod:`sfq.backends`) itself, streams
their events through, applies the pool's upstream timeouts, and keeps one
:class:`~sfq.backends.health.BackendMonitor` per backend, which reports health to the engine.

Two primitives are the core, and every call is built on them:

* :meth:`PolicyDispatcher.acquire`: wait your turn and learn where to send the request (an
  embedder's own HTTP client does the call); :meth:`submit` / :meth:`submit_flow` are
  ``acquire`` plus this module's own call, with retries.
* :meth:`PolicyDispatcher.open_stream`: a stream admitted and answered by its upstream before
  it returns, so a refusal is still an HTTP status; :meth:`stream` / :meth:`stream_flow`
  return the same :class:`EventStream`, opened on first use.

Usage::

    async with PolicyDispatcher(load_policy("policy.yaml")) as pd:
        reply = await pd.submit("sk-product-1", {"model": "llama-3-8b", "prompt": "hi"},
                                cls="interactive", timeout=30)
        async with pd.stream("sk-analytics-1", {..., "stream": True}) as events:
            async for event in events:
                ...
    pd.registry    # the Prometheus registry (mount it: prometheus_client.generate_latest)
    pd.stats()     # cheap snapshot

Errors are :class:`sfq.errors.SFQError` s: ``Refused`` (``reason``: unauthenticated,
class_not_allowed, unknown_model, bad_request (``BadRequest``), too_large, rate_limited,
queue_full, queue_timeout, deadline, closed; with ``retry_after`` where trying later helps),
``NoHealthyBackend`` (no backend of the pool is in rotation; with ``retry_after``),
``DeadlineExceeded`` (the deadline ran out while running), ``BackendError`` subclasses (the
backends failed after the retries allowed). Cancelling the awaiting task cancels the request:
while it waits it never reaches a backend and is not charged; after, the backend call is
aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Gauge

from ..backends import Backend, OpenAIBackend
from ..backends.base import JSONBody
from ..backends.health import BackendMonitor, HealthOptions
from ..cost import CostEstimator, Estimate
from ..engine import NoMetrics, PolicyEngine
from ..engine.pool import BACKOFF, RUNNING, WAITING, Request
from ..errors import (
    BackendError,
    BackendTimeout,
    BadRequest,
    DeadlineExceeded,
    DispatcherClosed,
    InvalidCost,
    InvalidCostType,
    InvalidTimeout,
    NoHealthyBackend,
    PolicyError,
    Refused,
)
from .._common import MAX_COST, check_cost
from ..policy.classify import Flow
from ..policy.config import Policy, UpstreamTimeouts, load_policy
from ..policy.metrics import PolicyMetrics
from ..policy.retry import IdempotencyIndex
from ..policy.spend import Hold
from ..state import SharedState, local_policy, state_for
from .permit import Permit
from .policy_calls import BackendAddress, Grant, PolicyEventStream, Reply, _check_body, _endpoint, _Expired, \
    _text_chars, _within
from ._wake import WakeTimer
from .stream import EventStream

__all__ = ["BackendAddress", "EventStream", "Grant", "Permit", "PolicyDispatcher"]

log = logging.getLogger("sfq.dispatch")
_Self = TypeVar("_Self", bound="PolicyDispatcher")


class _Joined:
    """A request running under an ``Idempotency-Key``, and how many callers wait for it."""

    __slots__ = ("task", "waiters")

    def __init__(self, task: asyncio.Task[Reply]) -> None:
        self.task = task
        self.waiters = 0


class _TurnFuture(asyncio.Future):  # type: ignore[type-arg]
    """What a request's task awaits until its turn. ``Task.cancel()`` cancels it at once, before
    the task runs again; a pump in between (another request completes) must not start a request
    whose caller has already left. So its ``cancel()`` withdraws a waiting request at once,
    uncharged. Made by :func:`_turn_future` (no ``__init__`` of its own: a Python one costs
    about 1 µs a wait)."""

    __slots__ = ("_pd", "_r")
    _pd: PolicyDispatcher  # the dispatcher that waits it
    _r: Request  # the request whose turn it is

    def cancel(self, msg: Any = None) -> bool:
        if not self.done() and self._r.state == WAITING:
            self._pd._gave_up(self._r)
        return super().cancel(msg)


def _turn_future(pd: PolicyDispatcher, r: Request) -> _TurnFuture:
    fut = _TurnFuture(loop=asyncio.get_running_loop())
    fut._pd = pd
    fut._r = r
    return fut


class _Listener:
    """What the backend monitors of one pool report, passed on to the engine in force."""

    __slots__ = ("pd", "pool")

    def __init__(self, pd: PolicyDispatcher, pool: str) -> None:
        self.pd = pd
        self.pool = pool

    def backend_down(self, name: str, reason: str) -> None:
        self.pd.engine.backend_down(self.pool, name, reason)
        self.pd._pump()

    def backend_up(self, name: str) -> None:
        self.pd.engine.backend_up(self.pool, name)
        self.pd._pump()

    def backend_paused(self, name: str, seconds: float) -> None:
        self.pd.engine.backend_paused(self.pool, name, seconds)

    def backend_unpaused(self, name: str) -> None:
        self.pd._pump()

    def backend_saturated(self, name: str, saturated: bool) -> None:
        self.pd.engine.backend_saturated(self.pool, name, saturated)
        self.pd._pump()


def _check_cost(cost: object) -> None:
    """A request's ``cost=`` checked by the scheduler core's own rule and message, raised as an
    sfq error (400): :class:`InvalidCostType` (a ``TypeError``) for a non-number, else
    :class:`InvalidCost` (a ``ValueError``). Before anything is counted or queued."""
    try:
        check_cost(cost)
    except TypeError as exc:
        raise InvalidCostType(str(exc)) from None
    except (ValueError, OverflowError) as exc:
        raise InvalidCost(str(exc)) from None


def _seconds(what: str, value: object) -> float:
    """A request's ``timeout=`` or ``max_wait=``: a finite number of seconds > 0, else an sfq
    error (400): :class:`InvalidTimeout` (a ``ValueError``) naming the argument and the value.
    Before anything is counted or queued."""
    if type(value) is float and 0.0 < value < math.inf:  # (the common case in one test: NaN fails it)
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            f = float(value)
        except OverflowError:  # (an int past the largest float)
            f = math.inf
        if 0.0 < f < math.inf:
            return f
    raise InvalidTimeout(f"{what} must be a finite number of seconds > 0, got {value!r}")


#: seconds between a started dispatcher's own ``forget_idle()`` runs (event-loop time)
FORGET_EVERY = 30.0


class PolicyDispatcher:
    """A policy file applied in front of a fleet: fair queueing, limits, retries and the charge
    of delivered service, for ``sfq serve`` and for embedders with their own server.

    ``policy``: a :class:`Policy`, or the path of a policy file. ``backends``: optional
    ``{backend name: Backend}`` overriding the ``OpenAIBackend`` built from the file for that
    name (a custom transport, or a test double); names default to the URL. ``clock``: seconds
    (default ``time.monotonic``, the event loop's clock); deadlines and queue ages are measured
    on it. ``estimator``: the ``CostEstimator`` (default: from the file's ``cost`` section).
    ``registry``: the Prometheus registry for the policy's metrics (default: a new one,
    ``.registry``). ``health``: the backends' health rules (``HealthOptions``: the 5xx and
    transport thresholds, the health checks' backoff, and ``max_pause``, the longest an
    upstream's ``Retry-After`` may pause one of its backends, default 60 s). ``close_grace``: seconds :meth:`close` lets running requests finish.
    ``rng``, ``scheduler``: the retry jitter's random source; the core factory (default
    ``sfq.Scheduler``). ``state``: where the policy's state lives (``sfq.state``): default,
    what the file's ``state:`` section asks for (Redis, shared with the other gateways of the
    same prefix) or, without it, memory (nothing is consulted: no cost).
    """

    def __init__(self, policy: Policy | str | Path, *, backends: Mapping[str, Backend] | None = None,
                 clock: Callable[[], float] = time.monotonic, estimator: CostEstimator | None = None,
                 registry: CollectorRegistry | None = None, health: HealthOptions | None = None,
                 close_grace: float = 30.0, rng: random.Random | None = None,
                 scheduler: Callable[[], Any] | None = None, state: SharedState | None = None,
                 metrics: PolicyMetrics | NoMetrics | None = None) -> None:
        if not isinstance(policy, Policy):
            policy = load_policy(policy)
        if isinstance(close_grace, bool) or not isinstance(close_grace, (int, float)) or not (
                math.isfinite(close_grace) and close_grace >= 0):
            raise ValueError(f"close_grace must be a finite number of seconds >= 0, got {close_grace!r}")
        if health is None:  # the policy file's longest pause (retry.max_pause_seconds)
            health = HealthOptions(max_pause=policy.retry.max_pause_seconds)
        if not isinstance(health, HealthOptions):
            raise TypeError(f"health must be an sfq.backends.health.HealthOptions, got {health!r}")
        self.policy = policy
        self.clock = clock
        self.close_grace = float(close_grace)
        #: the backends' health rules
        self.health = health
        if state is None:
            state = state_for(policy, clock=clock)
        if not isinstance(state, SharedState):
            raise TypeError(f"state must be an sfq.state.SharedState, got {state!r}")
        self.state: SharedState = state
        self._shared = bool(state.shared)
        cs = policy.cost
        self.estimator = estimator if estimator is not None else CostEstimator(
            cs.input_weight, cs.output_weight, default_max_tokens=cs.default_max_tokens, prior_ratio=cs.prior_ratio,
            cached_input_weight=cs.cached_input_weight)
        # shared: the engine orders each flow's requests and hands them on; the shared state
        # applies the limits and the order over every gateway
        self.engine = PolicyEngine(local_policy(policy) if self._shared else policy, clock=clock,
                                   scheduler=scheduler, rng=rng, registry=registry, estimator=self.estimator,
                                   max_pause=health.max_pause, metrics=metrics)
        reg = self.engine.metrics.registry
        #: the Prometheus registry of the policy's metrics (empty when ``metrics`` keeps none)
        self.registry: CollectorRegistry = reg if reg is not None else CollectorRegistry(auto_describe=True)
        #: called with each request the engine starts, as it starts (a face's ``on_dispatch``)
        self.on_start: Callable[[Request], None] | None = None
        given = dict(backends or {})
        known = {b.name for p in policy.pools.values() for b in p.backends}
        extra = sorted(set(given) - known)
        if extra:
            raise ValueError(f"backends {extra} are not in the policy; its backends: {sorted(known)}")
        self._backends: dict[str, Backend] = {}
        self._addresses: dict[str, BackendAddress] = {}
        self._monitors: dict[str, BackendMonitor] = {}
        self._pool_of: dict[str, str] = {}
        self._sent: dict[str, list[int]] = {}  # backend -> [attempts started there, aborted there]
        for pool in policy.pools.values():
            listener = _Listener(self, pool.name)
            t = pool.timeouts
            for i, spec in enumerate(pool.backends):
                key = None
                if spec.api_key_env is not None and spec.name not in given:
                    key = os.environ.get(spec.api_key_env)
                    if not key:
                        raise PolicyError(f"pools.{pool.name}.backends[{i}].api_key_env",
                                          f"the environment variable {spec.api_key_env!r} is not set (or empty)")
                be = given.get(spec.name)
                if be is None:
                    # the driver bounds first byte, silence and total itself (the pool's timeouts)
                    be = OpenAIBackend(spec.url, name=spec.name, max_in_flight=spec.max_in_flight,
                                       max_context=spec.max_context, api_key=key, connect_timeout=t.connect,
                                       timeout=None, stream_timeout=None)
                if isinstance(be, OpenAIBackend):
                    address = BackendAddress(spec.name, be.url, be.headers)
                else:
                    address = BackendAddress(spec.name, spec.url.rstrip("/").removesuffix("/v1"), {})
                self._backends[spec.name] = be
                self._addresses[spec.name] = address
                self._monitors[spec.name] = BackendMonitor(be, listener, health, clock=clock)
                self._pool_of[spec.name] = pool.name
                self._sent[spec.name] = [0, 0]
        self._waiters: dict[int, asyncio.Future[None]] = {}  # request id -> wakes its task
        self._idem: IdempotencyIndex[_Joined] = IdempotencyIndex()
        self._timer = WakeTimer(self._pump, clock)
        self._drained: asyncio.Event | None = None
        self._started = False
        self._forgetting: asyncio.TimerHandle | None = None  # the timer of forget_idle()
        self._closed = False
        self._pumping = False
        self._again = False
        if self._shared:
            self.engine.on_attempt_over = state.attempt_over
            self.engine.on_end = state.ended
            self.engine.retry.local_budget = False  # the shared state applies it over every gateway
            self.engine.defer_start = True  # a request starts when the shared state grants it
            self.engine.decider = state.decider  # the fleet's queues (predicted waits), where this one decides
            for q in self.engine.queues.values():  # the engine's charges reach the shared meters
                q.on_charge = state.charged
                q.refund_floors = False  # the shared ledger applies them, in its global order
            state.on_evicted = self._evicted
            self.engine.spend.on_settle = state.settle_spend  # budgets: the shared ledger
            state.estimator = self.estimator  # the refund floor's "a guess" is the engine's
            if reg is not None:
                Gauge("sfq_state_degraded", "1 while the shared state (Redis) cannot be reached and this gateway "
                      "serves alone, within its slice of every global limit (state.on_loss: local)",
                      registry=reg).set_function(lambda: 1.0 if state.degraded else 0.0)
            state.reprice = self._reprice  # a candidate is charged the calibration's price at its grant

    def _reprice(self, r: Request) -> float:
        """The charge the shared state's grant of ``r`` is to make: its price now (the engine's)."""
        return self.engine.queues[r.flow.pool].reprice(r)

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the backends and their monitors (``async with`` does this)."""
        if self._closed:
            raise DispatcherClosed()
        if self._started:
            return
        if self._shared:
            await self.state.start()  # PolicyError: the other gateways of the prefix run another policy
        self._started = True
        await asyncio.gather(*(b.start() for b in self._backends.values()))
        for m in self._monitors.values():
            m.start()
        self._forgetting = asyncio.get_running_loop().call_later(FORGET_EVERY, self._forget_tick)

    def _forget_tick(self) -> None:
        self._forgetting = None
        if self._closed:
            return
        try:
            self.forget_idle()
        except Exception:  # (never the timer's end: memory is only an optimisation)
            log.exception("sfq: forgetting idle flows failed")
        self._forgetting = asyncio.get_running_loop().call_later(FORGET_EVERY, self._forget_tick)

    def forget_idle(self) -> int:
        """Forget what is kept of flows with nothing waiting or running and no recent activity
        (``PolicyEngine.forget_idle``: their retry budgets after a minute; the core forgets a
        meter once virtual time passes it; of the orgs made from the policy's
        ``org_template``, their specs, rate buckets and slots, and their counters and series
        once idle for the metrics' window); returns how many. Runs every ``FORGET_EVERY``
        seconds by itself while the dispatcher is started; call it after moving an injected
        clock. Nothing a decision needs is lost: a forgotten flow is a fresh one."""
        n = self.engine.forget_idle()
        p = self.policy
        if p is not self.engine.policy and p.org_template is not None:  # (shared: the state's own copy)
            n += p.forget_orgs({r.flow.org for r in self.engine.live.values()})
        return n

    async def close(self) -> None:
        """Refuse new requests; end every waiting one as refused (``closed``); let the running
        ones finish within ``close_grace`` seconds; then close the backends (aborting what
        still runs)."""
        if self._closed:
            return
        self._closed = True
        if self._forgetting is not None:
            self._forgetting.cancel()
            self._forgetting = None
        for r in self.engine.close():
            self._wake(r)
        for rid in list(self._waiters):  # those waiting out a retry's backoff end now
            fut = self._waiters.pop(rid)
            if not fut.done():
                fut.set_result(None)
        if self._shared:
            self.state.refuse_waiting()  # those the engine started that wait for the shared state's grant
        self._timer.cancel()
        if self._running():
            self._drained = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._drained.wait(), self.close_grace)
        await asyncio.gather(*(m.close() for m in self._monitors.values()), return_exceptions=True)
        await asyncio.gather(*(b.close() for b in self._backends.values()), return_exceptions=True)
        self.engine.spend.flush()  # (a state file: the spend so far)
        if self._shared:
            await self.state.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (new requests are refused)."""
        return self._closed

    async def __aenter__(self: _Self) -> _Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _running(self) -> int:
        return sum(q.in_flight for q in self.engine.queues.values())

    # ------------------------------------------------------------ the pump
    def _wake(self, r: Request) -> None:
        fut = self._waiters.pop(r.id, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _pump(self) -> None:
        """Start what may start, wake the tasks of what started or ended, arm the next timer."""
        if self._pumping:
            self._again = True
            return
        if not self.engine.has_waiting():  # nothing to start or drop; no timer to move
            return
        self._pumping = True
        try:
            while True:
                self._again = False
                started = self.engine.poll()
                if started:
                    sent = self._sent
                    for r in started:
                        sent[r.backend][0] += 1  # type: ignore[index]
                    if self.on_start is not None:
                        for r in started:
                            self._started_hook(r)
                    for r in started:
                        self._wake(r)
                for r in self.engine.dropped:
                    self._wake(r)
                if not self._again:
                    break
            self._arm(self.engine.wake_at())
        finally:
            self._pumping = False

    def _started_hook(self, r: Request) -> None:
        assert self.on_start is not None
        try:
            self.on_start(r)
        except Exception:  # a broken hook must not break the pump (or another caller's request)
            log.exception("sfq: the on_dispatch hook raised; ignored")

    def _arm(self, at: float | None) -> None:
        if not self._closed:
            self._timer.arm(at)

    def _settled(self) -> None:
        """An attempt let go of its slot: start what may start (and tell close() when none runs)."""
        if self._pumping or self.engine.has_waiting():  # (_pump's own first tests)
            self._pump()
        if self._drained is not None and not self._running():
            self._drained.set()

    # ------------------------------------------------------------ admission
    def _deadline(self, timeout: float | None) -> float | None:
        """The clock time of a request's ``timeout=`` (seconds from now; ``None``: none);
        :class:`InvalidTimeout` (400) for a bad one."""
        if timeout is None:
            return None
        return self.clock() + _seconds("timeout", timeout)

    def classify(self, credential: str | None, body: Mapping[str, Any], cls: str | None = None) -> Flow:
        """The flow of a request (``Refused`` when the key, the class or the model is refused)."""
        _check_body(body)
        return self.engine.classify(credential, cls, body.get("model"))

    def _check_flow(self, flow: Flow) -> Flow:
        """An embedder's flow checked by the policy's own rule (``Classifier.check``): the org
        known or made from the file's template (else ``Refused("unknown_org")``, 403), the
        class one it may use (``""``/``None``: its default), the pool declared."""
        return self.engine.classifier.check(flow)

    def _checked(self, flow: Flow) -> Flow:
        """``flow`` as an ``sfq.Flow`` the policy allows; a refusal (recorded) otherwise."""
        try:
            return self._check_flow(flow)
        except Refused as exc:
            self.engine.refuse(flow, exc.reason)
            raise

    def _estimate(self, body: Mapping[str, Any], flow: Flow) -> Estimate:
        try:
            return self.estimator.estimate(body, flow)
        except BadRequest:
            self.engine.refuse(flow, "bad_request")
            raise
        except (TypeError, ValueError, OverflowError) as exc:
            self.engine.refuse(flow, "bad_request")
            raise BadRequest(str(exc)) from None

    async def _admit(self, flow: Flow, body: Mapping[str, Any] | None, timeout: float | None, key: str | None,
                     streaming: bool | None, cost: float | None = None, max_wait: float | None = None) -> Request:
        """Everything that can refuse the request, then its place in its flow's queue.
        ``streaming``: ``True`` (a stream), ``False`` (a plain reply), ``None`` (a permit: the
        body says); ``body`` ``None``: a permit without one (``cost`` is then its charge)."""
        if not self._started:
            await self.start()
        if not self._shared:
            return self._admit_now(flow, body, timeout, key, streaming, cost, max_wait)
        flow, deadline, est, streaming, wait = self._checks(flow, body, timeout, streaming, cost, max_wait)
        hold = await self._reserve(flow, est)  # the budget over every gateway
        try:  # org rates, queue lengths over every gateway
            ticket = await self.state.admit(flow, self._rate_horizon(flow, deadline, wait))
        except Refused as exc:
            self.engine.spend.release(hold)
            self.engine.refuse(flow, exc.reason)
            raise
        # over its org's rate, its token taken ahead (on_limit: wait): parked until it refills
        ready = self.clock() + ticket.wait if ticket is not None and ticket.wait > 0 else None
        try:
            r = self.engine.submit(flow, cost=cost, estimate=est, streaming=streaming, deadline=deadline,
                                   idempotency_key=key, start=True, hold=hold, max_wait=wait, ready_at=ready)
        except OverflowError as exc:  # a figure too large for the scheduler: the body's fault
            self.state.drop(ticket)
            self.engine.spend.release(hold)
            self.engine.refuse(flow, "bad_request")
            raise BadRequest(f"the request is too large to schedule: {exc}") from None
        except BaseException:
            self.state.drop(ticket)
            self.engine.spend.release(hold)
            raise
        self.state.bind(ticket, r)
        return self._queued(r)

    def _rate_horizon(self, flow: Flow, deadline: float | None, max_wait: float | None) -> float | None:
        """Seconds a request of ``flow`` may wait for its org's token over the org's
        ``requests_per_minute`` (``on_limit: wait``): to its deadline, queue age or ``max_wait``,
        the soonest (``inf``: none); ``None``: refused at once (``on_limit: refuse``). The shared
        state's admission takes the token ahead when it refills within it."""
        p = self.policy
        if not p.waits_for_rate(flow.org, flow.cls):
            return None
        now = self.clock()
        age = p.classes[flow.cls].max_queue_age_seconds
        bound = math.inf if age is None else age
        if max_wait is not None and max_wait < bound:
            bound = max_wait
        if deadline is not None and deadline - now < bound:
            bound = deadline - now
        return bound

    def _admit_now(self, flow: Flow, body: Mapping[str, Any] | None, timeout: float | None, key: str | None,
                   streaming: bool | None, cost: float | None = None, max_wait: float | None = None) -> Request:
        """:meth:`_admit` of a started dispatcher on its own state: nothing to await (the
        uncontended request's path: it returns running, on ``r.backend``)."""
        if body is None and cost is not None and timeout is None and max_wait is None:  # (_checks in short)
            if not (type(cost) is float and 0.0 < cost <= MAX_COST):  # (the common case in one test)
                _check_cost(cost)
            flow = self._checked(flow)
            if self._closed:
                self.engine.refuse(flow, "closed")
                raise DispatcherClosed()
            deadline, est, streaming, wait = None, None, False, None
        else:
            flow, deadline, est, streaming, wait = self._checks(flow, body, timeout, streaming, cost, max_wait)
        try:  # (engine.submit, its arguments in order)
            r = self.engine._submit(flow, cost, None, None, deadline, None, key, est, streaming, True, None, wait)
        except OverflowError as exc:  # a figure too large for the scheduler: the body's fault
            self.engine.refuse(flow, "bad_request")
            raise BadRequest(f"the request is too large to schedule: {exc}") from None
        if r.state == RUNNING and self.on_start is None:  # (_queued's first case, without the call)
            self._sent[r.backend][0] += 1  # type: ignore[index]
            return r
        return self._queued(r)

    def _checks(self, flow: Flow, body: Mapping[str, Any] | None, timeout: float | None, streaming: bool | None,
                cost: float | None, max_wait: float | None = None
                ) -> tuple[Flow, float | None, Estimate | None, bool, float | None]:
        """What refuses a request before it is submitted: its cost, timeout and max_wait, its
        body, its flow, a closed dispatcher; ``(flow checked, deadline, estimate, streaming,
        max_wait in seconds)``."""
        if cost is not None and not (type(cost) is float and 0.0 < cost <= MAX_COST):
            _check_cost(cost)
        seconds = None if timeout is None else _seconds("timeout", timeout)
        wait = None if max_wait is None else _seconds("max_wait", max_wait)
        if body is None:
            if cost is None:
                raise BadRequest("a request needs a body (a JSON object), or cost= for a permit without one")
        else:
            _check_body(body)
            s = body.get("stream")
            if streaming is None:
                streaming = s is True
            elif streaming and s is not None and s is not True:
                raise BadRequest(f"a stream takes a streaming body: 'stream' must be true or absent, got {s!r}",
                                 param="stream")
            elif not streaming and s is not None and s is not False:
                raise BadRequest(f"a plain request takes a non-streaming body ('stream' is {s!r}); use stream() or "
                                 "open_stream()",
                                 param="stream")
        flow = self._checked(flow)
        if self._closed:
            self.engine.refuse(flow, "closed")
            raise DispatcherClosed()
        deadline = None if seconds is None else self.clock() + seconds
        est = None if body is None else self._estimate(body, flow)
        return flow, deadline, est, bool(streaming), wait

    def _queued(self, r: Request) -> Request:
        """A request the engine accepted: counted as sent when it started at once; else the
        pump runs when something may start, or its deadline is armed while its pool is full."""
        if r.state == RUNNING:  # nothing else waited in its pool: the engine started it at once
            self._sent[r.backend][0] += 1  # type: ignore[index]
            if self.on_start is not None:
                self._started_hook(r)
        elif self.engine.may_start(r.flow.pool):
            self._pump()
        elif r.drop_at < math.inf:  # its pool is full: nothing starts until a slot frees (which pumps)
            self._arm(r.drop_at)
        return r

    async def _reserve(self, flow: Flow, est: Estimate | None) -> Hold | None:
        """A shared state's budget reservation for a request of ``flow`` (``None``: its pool
        has no prices): in its org's budget and its team's, both or neither;
        ``Refused("budget_exhausted"|"state_unavailable")``, recorded."""
        book = self.engine.spend
        now = book.wall_clock()
        q = book.quote(flow, est, now)
        if q is None:
            return None
        hold, limit, end = q
        budgets: list[tuple[str, str, float]] = []
        said: list[tuple[str, float, str, str, float]] = []
        if hold.budgeted:
            budgets.append((flow.org, hold.key, limit))
            said.append(book.said_org(hold, limit, end))
        team = book.team_quote(flow, hold, now)
        if team is not None:
            budgets.append((f"{flow.org}\t{flow.team}", hold.team_key, team[0]))
            said.append(team[1])
        if not budgets:
            return hold
        last = max(e for *_, e in said)
        try:
            refused = await self.state.reserve_spend(hold, budgets, last - now + 2 * 86400)
        except Refused as exc:
            self.engine.refuse(flow, exc.reason)
            raise
        if refused:
            self.engine.refuse(flow, "budget_exhausted")
            raise book.refused(hold, [said[i] for i in refused])
        return hold

    def _ended_error(self, r: Request) -> Exception:
        """The error for a request the engine ended before (or between) its attempts."""
        return self.engine.ended_error(r)

    async def _turn(self, r: Request, failed: BackendError | None = None) -> None:
        """Wait until the engine starts ``r`` (and the shared state grants it); the error the
        engine ended it with otherwise (chained from ``failed``, the last attempt's failure,
        when it waited to be retried). Cancelling the task here removes it uncharged."""
        try:
            while r.state != RUNNING:
                if r.outcome is not None:
                    raise self._ended_error(r) from failed
                fut = self._waiters[r.id] = _turn_future(self, r)
                await fut  # bounded: the timer drops it when its queue age or deadline runs out
            if self._shared:
                await self._granted(r)
        except asyncio.CancelledError:
            self._gave_up(r)
            raise

    async def _granted(self, r: Request) -> None:
        """The shared state's grant of the start the engine decided for ``r``: global slots,
        buckets and order (several gateways); ``r`` may be moved to the backend granted."""
        q = self.engine.queues[r.flow.pool]
        limit = {b.name: b.max_in_flight for b in self.policy.pools[r.flow.pool].backends}  # the real ones
        fits = [(name, limit[name]) for name in self.engine.candidates(r)]
        if not fits:  # the one the engine chose (it was fit then)
            assert r.backend is not None
            fits = [(r.backend, limit[r.backend])]
        until = None if r.drop_at == math.inf else r.drop_at
        try:
            backend = await self.state.acquire(r, fits, until)
        except Refused as exc:
            if r.state == RUNNING:
                self.engine.abandon(r, "refused" if r.tries <= 1 else "failed", exc.reason)
                self._settled()
            raise
        except BaseException:
            if r.state == RUNNING:
                self.engine.abandon(r, "cancelled_before_start" if r.tries <= 1 else "cancelled_during_execution")
                self._settled()
            raise
        if backend != r.backend and backend in q.backends:
            q.move(r, backend)
        self.engine.granted(r)

    # ------------------------------------------------------------ endings
    def _evicted(self, rid: int) -> None:
        """The shared state gave the place of waiting request ``rid`` to another org's request
        (its org held the most places of a full class, over every gateway)."""
        r = self.engine.live.get(rid)
        if r is not None and r.state == WAITING:
            self.engine.evict(r)
            self._pump()

    def _gave_up(self, r: Request) -> None:
        """The caller left (its task was cancelled, or its stream closed early)."""
        self._waiters.pop(r.id, None)
        if r.outcome is None:
            running = r.state == RUNNING
            if running and r.backend in self._sent:
                self._sent[r.backend][1] += 1
            self.engine.cancel(r, work_tokens=r.delivered if running else None)
            if running:
                self._settled()
            else:
                self._pump()

    def _abort(self, r: Request, exc: BaseException) -> None:
        """An error that is no backend's (a bug, an error of the caller's own code) ended the
        call of ``r``: it ends as failed, never retried; its backend's health is untouched."""
        self._waiters.pop(r.id, None)
        if r.state == RUNNING:
            self.engine.fail(r, exc, retryable=False)
            self._settled()
        elif r.outcome is None:
            self._gave_up(r)

    def _completed(self, r: Request, usage: Mapping[str, Any] | None, text_chars: int | None) -> None:
        if r.state != RUNNING:
            return
        backend = r.backend
        assert backend is not None
        if usage is not None and type(usage) is not dict and not isinstance(usage, Mapping):
            usage = None
        # (output_text_chars; bad input raises there, before anything changed)
        self.engine.complete(r, usage, None if usage is not None else text_chars)
        self._monitors[backend].replied(r.flow, None)
        self._settled()

    def _deadline_hit(self, r: Request, what: str) -> DeadlineExceeded:
        """``r``'s deadline ran out while it ran: the attempt ends, never retried."""
        err = DeadlineExceeded(f"the request's deadline ran out while it was {what}; the backend call was aborted")
        if r.state == RUNNING:
            self.engine.fail(r, err, deadline_hit=True)
            self._settled()
        return err

    def _attempt_failed(self, r: Request, exc: BaseException, *, retryable: bool,
                        reported: bool = False) -> float | None:
        """An attempt of ``r`` failed with ``exc``: its backend's health hears of it and the
        engine plans a retry: the seconds to wait before it, or ``None`` (``r`` ended).
        ``reported``: an embedder told of the failure (a grant's), the driver did not see it."""
        if r.state != RUNNING:
            return None
        assert r.backend is not None
        self._monitors[r.backend].replied(r.flow, exc, reported)
        decision = self.engine.fail(r, exc, retryable=retryable and not self._closed)
        self._settled()
        return decision.delay if decision.retry else None

    async def _retry(self, r: Request, exc: BaseException, *, retryable: bool = True) -> None:
        """Fail the attempt; return once ``r`` is back in its flow after its backoff (the caller
        waits its turn again), or raise ``exc`` (no retry) or the error that ended ``r``."""
        delay = self._attempt_failed(r, exc, retryable=retryable)
        if delay is None:
            raise exc
        if self._shared and not await self._retry_allowed(r):
            raise exc
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[r.id] = fut  # close() (or a reload that ends it) ends the wait at once
        try:
            await asyncio.wait_for(asyncio.shield(fut), delay)
        except asyncio.TimeoutError:
            pass
        except asyncio.CancelledError:
            self._gave_up(r)
            raise
        finally:
            if self._waiters.get(r.id) is fut:
                del self._waiters[r.id]
        if r.outcome is None and r.state == BACKOFF:  # (close() ends it as failed, reason closed)
            self.engine.requeue(r)
        if r.outcome is not None:  # its deadline passed meanwhile, or the pool lost its backends
            raise self._ended_error(r) from exc
        self._pump()

    async def _retry_allowed(self, r: Request) -> bool:
        """The shared state's word on a retry the engine planned (the flow's retry budget over
        every gateway); when it says no, the request ends as failed (``budget``)."""
        if await self.state.retry_allowed(r):
            return True
        if r.outcome is None:
            self.engine.end_retry(r, "budget")
        return False

    # ------------------------------------------------------------ the upstream's time
    def _timeouts(self, r: Request) -> UpstreamTimeouts:
        return self.policy.pools[r.flow.pool].timeouts

    def _bound(self, r: Request, step: float | None, total_until: float | None) -> tuple[float | None, str]:
        """Seconds the next wait on the upstream may take, and what bounds it: ``deadline``
        (the request's own), ``total`` (the attempt's), ``step`` (first byte or between events)."""
        now = self.clock()
        best: float | None = None
        why = "step"
        if step is not None:
            best = step
        if total_until is not None and (best is None or total_until - now < best):
            best, why = total_until - now, "total"
        if r.deadline is not None and (best is None or r.deadline - now <= best):
            best, why = r.deadline - now, "deadline"
        return (None if best is None else max(best, 0.0)), why

    def _upstream_timeout(self, r: Request, why: str, what: str, limit: float | None) -> BackendTimeout:
        name = r.backend or ""
        if why == "total":
            return BackendTimeout(f"backend {name!r}: the attempt passed the pool's total upstream timeout "
                                  f"({self._timeouts(r).total:g} s) while {what}", backend=name, unhealthy=False)
        return BackendTimeout(f"backend {name!r}: nothing within the pool's upstream timeout ({limit:g} s) while "
                              f"{what}", backend=name)

    def _total_until(self, r: Request) -> float | None:
        total = self._timeouts(r).total
        return None if total is None else self.clock() + total

    def _wrap(self, r: Request, exc: Exception) -> BackendError:
        """A backend's failure as a ``BackendError`` (a transport's own bug is one too)."""
        if isinstance(exc, BackendError):
            return exc
        name = r.backend or ""
        err = BackendError(f"backend {name!r} raised {type(exc).__name__}: {exc}", backend=name)
        err.__cause__ = exc
        return err

    # ------------------------------------------------------------ acquire
    def acquire(self, flow: Flow, body: Mapping[str, Any] | None = None, *, cost: float | None = None,
                timeout: float | None = None, max_wait: float | None = None) -> Permit:
        """Wait for ``flow``'s turn and learn where to send the request, for an embedder who
        makes the call with its own HTTP client::

            async with pd.acquire(flow, body, timeout=30) as grant:
                reply = await my_client.post(grant.url, json=body, headers=grant.backend.headers)
                grant.finish(reply["usage"])

        A permit with or without a body: ``body`` (a chat/completions request, estimated and
        charged by the policy's ``cost``) or ``cost=`` (cost units: a fixed charge, for any
        other call: embeddings, the Responses API, ...; with a body too, it replaces the
        estimate). ``timeout``: the request's deadline, seconds from now (it bounds the whole
        request); ``max_wait``: seconds it may wait for its turn (a ``Refused``,
        ``queue_timeout``, 504, when it runs out first; never cuts a granted call). Entering is
        where everything that can refuse the request happens (``BadRequest``, limits, queue
        age, ``max_wait``, ``timeout``, ``NoHealthyBackend``); cancelling the
        task while it waits there removes the request uncharged, and nothing reaches an
        upstream. Leaving without :meth:`Grant.finish` settles the charge from what
        :meth:`Grant.delivered` reported (else the estimate). An upstream failure counts
        toward the backend's health only when reported: :meth:`Grant.fail`, or an
        ``sfq.BackendError`` raised in the block; any other exception of the embedder's own
        frees the slot (the request ends as failed) and never counts against the backend.
        Nobody retries it but you.
        """
        return Permit(self, flow, body, cost, timeout, max_wait)

    # ------------------------------------------------------------ submit
    async def submit(self, credential: str | None, body: Mapping[str, Any], *, cls: str | None = None,
                     timeout: float | None = None, idempotency_key: str | None = None,
                     on_admit: Callable[[Request], None] | None = None, max_wait: float | None = None) -> Reply:
        """Classify, admit, wait for the turn, call the backend; the backend's JSON reply.

        ``cls``: the class the client states (default: its org's first); ``timeout``: the
        request's deadline in seconds from now (it bounds the whole request: 504 ``Refused``,
        reason ``deadline``, if it runs out while it waits, ``DeadlineExceeded`` while it
        runs); ``max_wait``: seconds it may wait for each start (its own queue age bound, next
        to its class's ``max_queue_age_seconds``: the smaller applies; 504 ``Refused``, reason
        ``queue_timeout``, when it runs out; a running request is never cut by it; a request
        joining another under its ``idempotency_key`` waits on that one's bounds and its own
        ``timeout``); ``idempotency_key``: a second request with the
        same key from the same org while the first runs joins it (same reply, not sent again;
        each caller waits at most its own ``timeout``, and the request goes on while one of
        them waits). ``on_admit``: called with the engine's :class:`Request` once it is
        accepted (its ``flow``, ``cost``, ``queued_at``, ``started_at``, ``tries``,
        ``outcome`` and ``reason`` are filled in as it goes: an access log reads them at the
        end); not called for a request that joined another or was refused. A failure before
        the reply is retried by the policy's ``retry`` rules, preferably on another backend.
        """
        flow = self.classify(credential, body, cls)
        return await self.submit_flow(flow, body, timeout=timeout, idempotency_key=idempotency_key,
                                      on_admit=on_admit, max_wait=max_wait)

    async def submit_flow(self, flow: Flow, body: Mapping[str, Any], *, timeout: float | None = None,
                          idempotency_key: str | None = None, cost: float | None = None,
                          on_admit: Callable[[Request], None] | None = None,
                          max_wait: float | None = None) -> Reply:
        """:meth:`submit` for a request the embedder classified itself (``flow``: an
        ``sfq.Flow`` the policy allows; no credential needed). ``cost``: a fixed charge in
        cost units instead of the estimate (never corrected from usage)."""
        if idempotency_key:
            return await self._joined(flow, body, timeout, idempotency_key, on_admit, cost, max_wait)
        return await self._submit(flow, body, timeout, None, on_admit, cost, max_wait)

    def running_key(self, org: str, idempotency_key: str) -> bool:
        """Whether a request of ``org`` under ``idempotency_key`` is running: one submitted now
        with that key joins it (its outcome is that request's, not one of its own)."""
        return self._idem.get(org, idempotency_key) is not None

    async def _joined(self, flow: Flow, body: Mapping[str, Any], timeout: float | None, key: str,
                      on_admit: Callable[[Request], None] | None, cost: float | None = None,
                      max_wait: float | None = None) -> Reply:
        """A request under an ``Idempotency-Key``: the first runs it in a task of its own, so
        that it goes on while any of its callers waits; each caller waits its own timeout."""
        self._deadline(timeout)  # a bad timeout (or max_wait) is refused before anything runs
        if max_wait is not None:
            _seconds("max_wait", max_wait)
        flow = self._checked(flow)
        org = flow.org
        entry = self._idem.get(org, key)
        first = entry is None
        if entry is None:
            task = asyncio.get_running_loop().create_task(self._submit(flow, body, timeout, key, on_admit, cost,
                                                                       max_wait))
            entry = _Joined(task)
            self._idem.add(org, key, entry)
            task.add_done_callback(functools.partial(self._joined_done, org, key, entry))
        entry.waiters += 1
        try:
            if first or timeout is None:  # the first's deadline is the request's own
                reply = await asyncio.shield(entry.task)
            else:
                try:
                    reply = await asyncio.wait_for(asyncio.shield(entry.task), timeout)
                except asyncio.TimeoutError:
                    raise DeadlineExceeded("this request's deadline ran out while it waited for the running "
                                           "request with the same Idempotency-Key") from None
            return dict(reply)
        finally:
            entry.waiters -= 1
            if entry.waiters == 0 and not entry.task.done():
                entry.task.cancel()  # the last caller left: so does the request

    def _joined_done(self, org: str, key: str, entry: _Joined, task: asyncio.Task[Reply]) -> None:
        self._idem.discard(org, key, entry)
        if not task.cancelled():
            task.exception()  # retrieved: no "never retrieved" warning when every caller left

    async def _submit(self, flow: Flow, body: Mapping[str, Any], timeout: float | None, key: str | None,
                      on_admit: Callable[[Request], None] | None, cost: float | None = None,
                      max_wait: float | None = None) -> Reply:
        if self._started and not self._shared:
            r = self._admit_now(flow, body, timeout, key, False, cost, max_wait)
        else:
            r = await self._admit(flow, body, timeout, key, False, cost, max_wait)
        if on_admit is not None:
            on_admit(r)
        endpoint = _endpoint(body)
        send = body if type(body) is JSONBody else dict(body)  # (a JSONBody is its caller's, unchanged)
        failed: BackendError | None = None
        try:
            while True:
                if r.state != RUNNING or self._shared:  # (started at once on its own state: its turn is now)
                    await self._turn(r, failed)
                try:
                    reply = await self._call(r, endpoint, send)
                except BackendError as exc:
                    await self._retry(r, exc)
                    failed = exc
                    continue
                usage = reply.get("usage")
                if type(usage) is dict or isinstance(usage, Mapping):  # (the text is counted only without usage)
                    self._completed(r, usage, None)
                else:
                    self._completed(r, None, _text_chars(reply.get("choices")))
                return reply
        except asyncio.CancelledError:
            self._gave_up(r)
            raise
        except BaseException as exc:
            self._abort(r, exc)
            raise

    async def _call(self, r: Request, endpoint: str, body: dict[str, Any]) -> Reply:
        """One attempt of a plain request, bounded by the pool's upstream timeouts and the
        request's deadline (a plain reply comes whole: its first byte is its end)."""
        assert r.backend is not None
        t = self.policy.pools[r.flow.pool].timeouts
        if t.first_byte is None and t.total is None and r.deadline is None:
            limit, why = None, "step"  # (unbounded here: the backend's own timeouts apply)
        else:
            limit, why = self._bound(r, t.first_byte, self._total_until(r))
        try:
            be = self._backends[r.backend]
            # a request the caller says may run twice (an idempotency key) may be resent after a lost connection
            call = be.complete(endpoint, body, idempotent=True) if r.idempotency_key else be.complete(endpoint, body)  # type: ignore[call-arg]
            if limit is None:
                return await call
            return await _within(call, limit)
        except _Expired:
            if why == "deadline":
                raise self._deadline_hit(r, "running") from None
            raise self._upstream_timeout(r, why, "waiting for the reply", limit) from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise self._wrap(r, exc) from exc

    # ------------------------------------------------------------ streams
    def stream(self, credential: str | None, body: Mapping[str, Any], *, cls: str | None = None,
               timeout: float | None = None, on_admit: Callable[[Request], None] | None = None,
               max_wait: float | None = None) -> EventStream:
        """Like :meth:`submit` for a streaming body: the backend's events, as an
        :class:`EventStream`. It opens when entered (``async with``) or at the first
        iteration; every refusal raises there. Closing it early (``aclose()``, leaving the
        ``async with``) cancels the request. A failed attempt is retried (by the same rules)
        only while no event has been passed on. ``on_admit``, ``timeout``, ``max_wait``: as in
        ``submit``."""
        return PolicyEventStream(self, None, credential, cls, body, timeout, on_admit, None, max_wait)

    def stream_flow(self, flow: Flow, body: Mapping[str, Any], *, timeout: float | None = None,
                    cost: float | None = None, on_admit: Callable[[Request], None] | None = None,
                    max_wait: float | None = None) -> EventStream:
        """:meth:`stream` for a request the embedder classified itself (``cost``: as in
        :meth:`submit_flow`)."""
        return PolicyEventStream(self, flow, None, None, body, timeout, on_admit, cost, max_wait)

    def open_stream(self, flow: Flow, body: Mapping[str, Any], *, timeout: float | None = None,
                    cost: float | None = None, max_wait: float | None = None) -> EventStream:
        """A stream that is admitted, and answered by its upstream, before the ``async with``
        body runs, so that every refusal can still be an HTTP status::

            async with pd.open_stream(flow, body, timeout=30) as events:
                ...                     # the first event is in hand: send 200 now
                async for event in events:
                    ...

        Entering raises what can refuse the request (``BadRequest``, limits, queue age,
        ``max_wait``, ``timeout``, ``NoHealthyBackend``) and the upstream's error before its
        first event (after the retries the policy allows), all ``SFQError`` s. Cancelling the
        task while it waits there removes the request uncharged, and nothing reaches an
        upstream. ``timeout``, ``max_wait``: as in :meth:`submit`."""
        return PolicyEventStream(self, flow, None, None, body, timeout, None, cost, max_wait)

    # ------------------------------------------------------------ reload
    def reload(self, policy: Policy | str | Path) -> list[Request]:
        """Put a new policy in force (keys, weights, classes, orgs, limits, retries, upstream
        timeouts) without losing a request: waiting ones keep their place in arrival order and
        their queue age, running ones keep their slots (see :meth:`PolicyEngine.reloaded`).
        The waiting requests of a flow the new policy no longer allows are refused
        (``unauthenticated`` or ``class_not_allowed``) and returned. A bad file or a change
        that needs a restart (pools' backends, ``cost``, ``state``) raises ``PolicyError`` (or
        ``OSError``) and the policy in force stays as it was."""
        if not isinstance(policy, Policy):
            policy = load_policy(policy)
        if self._closed:
            raise DispatcherClosed()
        engine, ended = self.engine.reloaded(local_policy(policy) if self._shared else policy)
        self.engine = engine
        self.policy = policy
        if self._shared:
            self.state.reloaded(policy)
        for r in ended:
            self._wake(r)
        self._pump()
        return ended

    # ------------------------------------------------------------ views
    def stats(self) -> dict[str, Any]:
        """The engine's snapshot (``PolicyEngine.stats``: ``flows``, ``pools``, ``limits``,
        ``unclassified``, ...) plus ``backends[name]``: ``pool``, ``in_flight``,
        ``max_in_flight`` and the monitor's view (``BackendMonitor.stats``: ``healthy``,
        ``saturated``, ``paused_for``, ``recent_5xx``, ``down_reason``, ...)."""
        s = self.engine.stats()
        backends: dict[str, Any] = {}
        for name, m in self._monitors.items():
            pool = self._pool_of[name]
            running = self.engine.queues[pool].backends[name].in_flight
            limit = next(x.max_in_flight for x in self.policy.pools[pool].backends if x.name == name)
            sent, aborted = self._sent[name]
            backends[name] = {"pool": pool, "in_flight": running, "max_in_flight": limit, "dispatched": sent,
                              "aborted": aborted, **m.stats()}
        s["backends"] = backends
        if self._shared:  # the limits in force are the shared state's; requests it has not granted yet wait
            st = self.state.stats()
            s["state"] = st
            for name, p in s["pools"].items():
                spec = self.policy.pools[name]
                held = st.get("candidates_by_pool", {}).get(name, 0)
                p["max_in_flight"] = spec.limits.max_in_flight
                p["waiting"] += held
                p["in_flight"] -= held
                for b in spec.backends:
                    if b.name in p["backends"]:
                        p["backends"][b.name]["max_in_flight"] = b.max_in_flight
            s["limits"] = {}
        return s

    def monitor_of(self, backend: str) -> BackendMonitor:
        """The health monitor of ``backend`` (a name of the policy's backends)."""
        return self._monitors[backend]

    def backend_of(self, backend: str) -> Backend:
        """The transport the dispatcher calls ``backend`` with."""
        return self._backends[backend]
