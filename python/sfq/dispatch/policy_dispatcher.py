"""``PolicyDispatcher``: the policy in front of a fleet, on asyncio, built on ``sfq.Dispatcher``.

The request's path is one-way: **policy** (classification, admission, org/class/pool limits,
rate buckets, strict classes, size buckets, deadlines, retries) -> **estimator**
(``sfq.CostEstimator``) -> **scheduler** (the SFQ core inside each pool's
:class:`~sfq.engine.PolicyQueue`) -> **dispatcher** -> **backend**. The policy decides
who goes next and on which backend; each backend is driven by its own one-backend
``sfq.Dispatcher``, which does the calls, streaming, health checks and the cancellation of
aborted calls. A request reaches a dispatcher only when the policy has started it, so that
dispatcher places it at once.

Usage::

    async with PolicyDispatcher(load_policy("policy.yaml")) as pd:
        reply = await pd.submit("sk-product-1", {"model": "llama-3-8b", "prompt": "hi"},
                                cls="interactive", timeout=30)
        async for event in pd.stream("sk-analytics-1", {..., "stream": True}):
            ...
    pd.registry    # the Prometheus registry (mount it: prometheus_client.generate_latest)
    pd.stats()     # cheap snapshot

Errors: ``Refused`` (``reason``: unauthenticated, class_not_allowed, unknown_model,
bad_request, too_large, rate_limited, queue_full, queue_timeout, deadline, closed; with
``retry_after`` where trying later helps), ``DeadlineExceeded`` (the deadline ran out while
running), ``BackendError`` subclasses (the backends failed after the retries allowed).
Cancelling the awaiting task cancels the request: before start it never reaches a backend;
after, the backend call is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from ..backends import Backend, OpenAIBackend
from ..cost import CostEstimator
from .dispatcher import Dispatcher
from ..errors import BackendError, DeadlineExceeded, NoHealthyBackend, PolicyError, Refused
from ..policy.classify import Flow
from ..policy.config import Policy, load_policy
from ..engine import PolicyEngine
from ..engine.pool import RUNNING, Request
from ..policy.retry import IdempotencyIndex
from ..state import SharedState, local_policy, state_for

__all__ = ["PolicyDispatcher"]

#: seconds between re-checks of backend health while some backend is out of rotation
HEALTH_TICK = 0.25


class PolicyDispatcher:
    """Parameters
    ----------
    policy:
        a :class:`Policy`, or the path of a policy file.
    backends:
        optional ``{backend name: Backend}`` overriding the ``OpenAIBackend`` built from the
        file for that name (a custom transport, or a test double); names default to the URL.
    clock:
        seconds (default ``time.monotonic``, the event loop's clock); deadlines and queue
        ages are measured on it.
    estimator:
        the ``CostEstimator`` (default: from the file's ``cost`` section).
    registry:
        the Prometheus registry for the policy's metrics (default: a new one, ``.registry``).
    dispatcher_options:
        keyword arguments for every per-backend ``sfq.Dispatcher`` (``backoff``,
        ``unavailable_timeout``, ``close_grace``, ...).
    rng, scheduler:
        the retry jitter's random source; the core factory (default ``sfq.Scheduler``).
    state:
        where the policy's state lives (``sfq.state``): default, what the file's ``state:``
        section asks for (Redis, shared with the other gateways of the same prefix) or, without
        it, memory (nothing is consulted: no cost).
    """

    def __init__(self, policy: Policy | str | Path, *, backends: Mapping[str, Backend] | None = None,
                 clock: Callable[[], float] = time.monotonic, estimator: CostEstimator | None = None,
                 registry: CollectorRegistry | None = None, dispatcher_options: Mapping[str, Any] | None = None,
                 rng: Any = None, scheduler: Callable[[], Any] | None = None,
                 state: SharedState | None = None) -> None:
        if not isinstance(policy, Policy):
            policy = load_policy(policy)
        self.policy = policy
        self.clock = clock
        if state is None:
            state = state_for(policy, clock=clock)
        if not isinstance(state, SharedState):
            raise TypeError(f"state must be an sfq.state.SharedState, got {state!r}")
        self.state: SharedState = state
        self._shared = bool(state.shared)
        # shared: the engine orders each flow's requests and hands them on; the shared state
        # applies the limits and the order over every gateway
        self.engine = PolicyEngine(local_policy(policy) if self._shared else policy, clock=clock,
                                   scheduler=scheduler, rng=rng, registry=registry)
        self.registry = self.engine.metrics.registry
        cs = policy.cost
        self.estimator = estimator if estimator is not None else CostEstimator(
            cs.input_weight, cs.output_weight, default_max_tokens=cs.default_max_tokens, prior_ratio=cs.prior_ratio)
        given = dict(backends or {})
        known = {b.name for p in policy.pools.values() for b in p.backends}
        extra = sorted(set(given) - known)
        if extra:
            raise ValueError(f"backends {extra} are not in the policy; its backends: {sorted(known)}")
        opts = dict(dispatcher_options or {})
        # the pool-level bound on a wait with no backend in rotation (the per-backend
        # dispatchers never see such a request: it waits here, in the policy's queue)
        ut = opts.get("unavailable_timeout", 30.0)
        self._unavailable_timeout = float("inf") if ut is None else float(ut)
        for q in self.engine.queues.values():
            q.unavailable_timeout = self._unavailable_timeout
        self._dispatchers: dict[str, Dispatcher] = {}
        self._pool_of: dict[str, str] = {}
        probed = False
        for pool in policy.pools.values():
            for i, spec in enumerate(pool.backends):
                key = None
                if spec.api_key_env is not None and spec.name not in given:
                    key = os.environ.get(spec.api_key_env)
                    if not key:
                        raise PolicyError(f"pools.{pool.name}.backends[{i}].api_key_env",
                                          f"the environment variable {spec.api_key_env!r} is not set (or empty)")
                be = given.get(spec.name) or OpenAIBackend(spec.url, name=spec.name, max_in_flight=spec.max_in_flight,
                                                           max_context=spec.max_context, api_key=key)
                probed = probed or be.probe is not None
                self._dispatchers[spec.name] = Dispatcher([be], estimator=self.estimator, clock=clock, **opts)
                self._pool_of[spec.name] = pool.name
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._health_dirty = True  # a failure happened since the last look at the backends' health
        self._down: set[str] = set()  # backends out of rotation at the last look
        self._probed = probed  # some backend has a saturation probe: look at every pump
        self._idem: IdempotencyIndex[asyncio.Future[dict[str, Any]]] = IdempotencyIndex()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._started = False
        self._closed = False
        self._pumping = False
        if self._shared:
            self.engine.on_attempt_over = state.attempt_over
            self.engine.on_end = state.ended
            self.engine.retry.local_budget = False  # the shared state applies it over every gateway
            self.engine.defer_start = True  # a request starts when the shared state grants it

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._closed:
            raise Refused("closed", "this dispatcher is closed")
        if not self._started:
            if self._shared:
                await self.state.start()  # PolicyError: the other gateways of the prefix run another policy
            self._started = True
            await asyncio.gather(*(d.start() for d in self._dispatchers.values()))

    async def close(self) -> None:
        """Refuse new requests; end every waiting one as refused (``closed``); let the running
        ones finish within each dispatcher's ``close_grace``; close the backends."""
        if self._closed:
            return
        self._closed = True
        for r in self.engine.close():
            fut = self._waiters.pop(r.id, None)
            if fut is not None and not fut.done():
                fut.set_exception(Refused("closed", "the dispatcher closed before this request started"))
        if self._shared:
            self.state.refuse_waiting()  # those the engine started that wait for the shared state's grant
        if self._timer is not None:
            self._timer.cancel()
        await asyncio.gather(*(d.close() for d in self._dispatchers.values()), return_exceptions=True)
        if self._shared:
            await self.state.close()

    async def __aenter__(self) -> PolicyDispatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ the pump
    def _sync_health(self) -> bool:
        """Mirror each backend's rotation state (its dispatcher's) into the policy's queues, when
        it may have changed: after a failure, while some backend is out of rotation, and always
        when a backend has a saturation probe. Returns whether one is out of rotation (or
        saturated) now."""
        if not (self._health_dirty or self._down or self._probed):
            return False
        self._health_dirty = False
        down = set()
        in_rotation: dict[str, bool] = {}
        for name, d in self._dispatchers.items():
            b = d.stats()["backends"][name]
            ok = bool(b["healthy"]) and not b["saturated"]
            pool = self._pool_of[name]
            self.engine.queues[pool].set_healthy(name, ok)
            in_rotation[pool] = in_rotation.get(pool, False) or bool(b["healthy"])
            if not ok:
                down.add(name)
        for pool, up in in_rotation.items():
            self.engine.queues[pool].set_available(up)
        self._down = down
        return bool(down)

    def _pump(self) -> None:
        """Start what may start; fail the waiters of what was dropped; arm the next timer."""
        if self._pumping:
            return
        self._pumping = True
        try:
            down = self._sync_health()
            for r in self.engine.poll():
                fut = self._waiters.pop(r.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            for r in self.engine.dropped:
                fut = self._waiters.pop(r.id, None)
                if fut is not None and not fut.done() and r.reason == "unavailable":
                    fut.set_exception(NoHealthyBackend(
                        f"no backend of pool {r.flow.pool!r} was in rotation for {self._unavailable_timeout:g} s"))
                elif fut is not None and not fut.done():
                    fut.set_exception(Refused(r.reason or "queue_timeout",
                                              f"the request's {'deadline' if r.reason == 'deadline' else 'queue age'}"
                                              " ran out before it started"))
            at = self.engine.wake_at()
            if down:
                tick = self.clock() + HEALTH_TICK
                at = tick if at is None else min(at, tick)
            self._arm(at)
        finally:
            self._pumping = False

    def _arm(self, at: float | None) -> None:
        if at is None or self._closed:
            return
        if self._timer is not None and self._timer_at <= at and not self._timer.cancelled():
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        delay = max(0.0, at - self.clock()) + 1e-4
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        self._pump()

    # ------------------------------------------------------------ admission
    def _deadline(self, timeout: float | None) -> float | None:
        if timeout is None:
            return None
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or not math.isfinite(
                timeout):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        return self.clock() + float(timeout)

    def classify(self, credential: str | None, body: Mapping[str, Any], cls: str | None = None) -> Flow:
        """The flow of a request (``Refused`` when the key, the class or the model is refused)."""
        if not isinstance(body, Mapping):
            raise TypeError(f"the request body must be a mapping (a JSON object), got {type(body).__name__}")
        return self.engine.classify(credential, cls, body.get("model"))

    def _admit(self, flow: Flow, body: Mapping[str, Any], deadline: float | None, key: str | None) -> Request:
        if self._closed:
            self.engine.refuse(flow, "closed")
            raise Refused("closed", "this dispatcher is closed")
        try:
            est = self.estimator.estimate(body, flow)
        except (TypeError, ValueError) as exc:
            self.engine.refuse(flow, "bad_request")
            raise Refused("bad_request", str(exc)) from None
        per_seq = est.max_tokens // max(1, est.copies)
        r = self.engine.submit(flow, cost=est.cost, tokens=est.prompt_tokens + est.max_tokens,
                               need=est.prompt_tokens + per_seq, deadline=deadline, idempotency_key=key)
        self._waiters[r.id] = asyncio.get_running_loop().create_future()
        self._pump()
        return r

    async def _admit_any(self, flow: Flow, body: Mapping[str, Any], deadline: float | None,
                         key: str | None) -> Request:
        """``_admit``, asking the shared state first (org rates, queue lengths) when there is one."""
        if not self._shared:
            return self._admit(flow, body, deadline, key)
        if self._closed:
            self.engine.refuse(flow, "closed")
            raise Refused("closed", "this dispatcher is closed")
        try:
            ticket = await self.state.admit(flow)
        except Refused as exc:
            self.engine.refuse(flow, exc.reason)
            raise
        try:
            r = self._admit(flow, body, deadline, key)
        except BaseException:
            self.state.drop(ticket)
            raise
        self.state.bind(ticket, r)
        return r

    async def _retry_allowed(self, r: Request) -> bool:
        """The shared state's word on a retry the engine planned (the flow's retry budget over
        every gateway); when it says no, the request ends as failed (``budget``)."""
        if not self._shared:
            return True
        if await self.state.retry_allowed(r):
            return True
        if r.outcome is None:
            self.engine.end_retry(r, "budget")
        return False

    async def _granted(self, r: Request) -> None:
        """The shared state's grant of the start the engine decided for ``r``: global slots,
        buckets and order (several gateways); ``r`` may be moved to the backend granted."""
        q = self.engine.queues[r.flow.pool]
        now = self.clock()
        limit = {b.name: b.max_in_flight for b in self.policy.pools[r.flow.pool].backends}  # the real ones
        fits = [(b.name, limit[b.name]) for b in q.backends.values()
                if b.healthy and b.paused_until <= now and (b.max_context is None or r.need <= b.max_context)]
        if not fits:  # the one the engine chose (it was fit then)
            assert r.backend is not None
            fits = [(r.backend, limit[r.backend])]
        until = None if r.drop_at == math.inf else r.drop_at
        try:
            backend = await self.state.acquire(r, fits, until)
        except Refused as exc:
            self.engine.abandon(r, "refused" if r.tries <= 1 else "failed", exc.reason)
            self._pump()
            raise
        except BaseException:
            if r.state == RUNNING:
                self.engine.abandon(r, "cancelled_before_start" if r.tries <= 1 else "cancelled_during_execution")
                self._pump()
            raise
        if backend != r.backend and backend in q.backends:
            q.move(r, backend)
        self.engine.granted(r)

    async def _until_started(self, r: Request) -> None:
        fut = self._waiters.get(r.id)
        if fut is None:
            if r.state == RUNNING:
                if self._shared:
                    await self._granted(r)
                return
            fut = self._waiters[r.id] = asyncio.get_running_loop().create_future()
            self._pump()
        await fut  # bounded: the pump's timer drops it when its queue age or deadline runs out
        if self._shared:
            await self._granted(r)

    def _remaining(self, r: Request) -> float | None:
        return None if r.deadline is None else r.deadline - self.clock()

    def _gave_up(self, r: Request, work_tokens: float | None = None) -> None:
        """The caller's task was cancelled (or the generator closed): end the request."""
        self._waiters.pop(r.id, None)
        if r.outcome is None:
            self.engine.cancel(r, work_tokens=work_tokens)
            self._pump()

    async def _retried(self, r: Request, exc: BaseException, *, retryable: bool = True) -> bool:
        """A backend error ended this attempt of ``r``: ``True`` once it is back in its flow
        after its backoff (the caller tries again), ``False`` when the caller should raise."""
        self._health_dirty = True
        decision = self.engine.fail(r, exc, retryable=retryable)
        self._pump()
        if not decision.retry or not await self._retry_allowed(r):
            return False
        await self._backoff(r, decision.delay)
        return True

    def _failed_otherwise(self, r: Request, exc: BaseException) -> None:
        """Any other error while ``r`` ran: it ends as failed, never retried."""
        if r.state == RUNNING:
            self.engine.fail(r, exc, retryable=False)
            self._pump()

    async def _backoff(self, r: Request, delay: float) -> None:
        """Wait out a retry's delay, then put the request back into its flow. ``close()`` (or a
        reload that ends the request) ends the wait at once through its waiter."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[r.id] = fut
        try:
            await asyncio.wait_for(asyncio.shield(fut), delay)
        except asyncio.TimeoutError:
            pass
        finally:
            if self._waiters.get(r.id) is fut:
                del self._waiters[r.id]
        if r.outcome is None:  # (close() ends it as failed, reason closed)
            self.engine.requeue(r)
        if r.outcome is not None:  # its deadline passed meanwhile, or a reload took its flow away
            if r.reason == "deadline":
                raise DeadlineExceeded("the request's deadline ran out while it waited to be retried")
            raise Refused(r.reason or "closed", f"the request ended ({r.reason}) while it waited to be retried")
        self._waiters[r.id] = asyncio.get_running_loop().create_future()
        self._pump()

    # ------------------------------------------------------------ calls
    async def submit(self, credential: str | None, body: Mapping[str, Any], *, cls: str | None = None,
                     timeout: float | None = None, idempotency_key: str | None = None,
                     on_admit: Callable[[Request], None] | None = None) -> dict[str, Any]:
        """Classify, admit, wait for the turn, call the backend; the backend's JSON reply.

        ``cls``: the class the client states (default: its org's first); ``timeout``: the
        request's deadline in seconds from now; ``idempotency_key``: a second request with the
        same key from the same org while the first runs joins it (same reply, not sent again).
        ``on_admit``: called with the policy's :class:`Request` once it is accepted (its
        ``flow``, ``cost``, ``queued_at``, ``started_at``, ``tries``, ``outcome`` and ``reason``
        are filled in as it goes: an access log reads them at the end); not called for a
        request that joined another (``idempotency_key``) or was refused.
        """
        if not self._started:
            await self.start()
        flow = self.classify(credential, body, cls)
        return await self.submit_flow(flow, body, timeout=timeout, idempotency_key=idempotency_key,
                                      on_admit=on_admit)

    async def submit_flow(self, flow: Flow, body: Mapping[str, Any], *, timeout: float | None = None,
                          idempotency_key: str | None = None,
                          on_admit: Callable[[Request], None] | None = None) -> dict[str, Any]:
        """``submit`` for an embedder that classified the request itself (``flow`` must be one
        the policy allows)."""
        if not self._started:
            await self.start()
        deadline = self._deadline(timeout)
        if idempotency_key:
            first = self._idem.get(flow.org, idempotency_key)
            if first is not None:
                # the joiner keeps its own deadline; when the first one's caller leaves (its
                # future is cancelled), the joiner goes on as a request of its own
                done, _ = await asyncio.wait((first,), timeout=None if deadline is None else deadline - self.clock())
                if not done:
                    raise DeadlineExceeded("the request's deadline ran out while it waited for the running request "
                                           "with the same Idempotency-Key")
                if not first.cancelled():
                    return dict(first.result())
                if self._idem.get(flow.org, idempotency_key) is not None:  # another joiner took over first
                    return await self.submit_flow(flow, body, timeout=None if deadline is None else max(
                        deadline - self.clock(), 1e-9), idempotency_key=idempotency_key, on_admit=on_admit)
        r = await self._admit_any(flow, body, deadline, idempotency_key)
        if on_admit is not None:
            on_admit(r)
        joined: asyncio.Future[dict[str, Any]] | None = None
        if idempotency_key:
            joined = asyncio.get_running_loop().create_future()
            self._idem.add(flow.org, idempotency_key, joined)
        try:
            reply = await self._submit(r, body)
        except BaseException as exc:
            if joined is not None and not joined.done():
                if isinstance(exc, asyncio.CancelledError):
                    joined.cancel()
                else:
                    joined.set_exception(exc)
                    joined.exception()  # retrieved: no "never retrieved" warning when nobody joined
            raise
        else:
            if joined is not None and not joined.done():
                joined.set_result(reply)
            return reply
        finally:
            if joined is not None:
                self._idem.discard(flow.org, idempotency_key or "", joined)

    async def _submit(self, r: Request, body: Mapping[str, Any]) -> dict[str, Any]:
        try:
            while True:
                await self._until_started(r)
                assert r.backend is not None
                d = self._dispatchers[r.backend]
                left = self._remaining(r)
                try:
                    call = d.submit(r.flow, body, cost=r.cost, idempotent=bool(r.idempotency_key))
                    reply = await (call if left is None else asyncio.wait_for(call, max(left, 0.0)))
                except asyncio.TimeoutError:
                    self.engine.fail(r, DeadlineExceeded("deadline"), deadline_hit=True)
                    self._pump()
                    raise DeadlineExceeded("the request's deadline ran out while it was running; the backend "
                                           "call was aborted") from None
                except (BackendError, NoHealthyBackend) as exc:
                    if not await self._retried(r, exc):
                        raise
                    continue
                except Exception as exc:
                    self._failed_otherwise(r, exc)
                    raise
                self.engine.complete(r, reply.get("usage") if isinstance(reply, dict) else None)
                self._pump()
                return reply
        except asyncio.CancelledError:
            self._gave_up(r)
            raise
        finally:
            if r.outcome is None and r.state != RUNNING:  # e.g. an unexpected error while waiting
                self._gave_up(r)

    def stream(self, credential: str | None, body: Mapping[str, Any], *, cls: str | None = None,
               timeout: float | None = None,
               on_admit: Callable[[Request], None] | None = None) -> AsyncIterator[dict[str, Any]]:
        """Like ``submit`` for a streaming body; yields the backend's events. Stopping early
        (``break`` then ``aclose()``, or ``contextlib.aclosing``) cancels the request. A failed
        attempt is retried (by the same rules) only while no event has been yielded.
        ``on_admit``: as in ``submit``."""
        return self._stream(credential, body, cls, timeout, on_admit)

    async def _stream(self, credential: str | None, body: Mapping[str, Any], cls: str | None,
                      timeout: float | None,
                      on_admit: Callable[[Request], None] | None = None) -> AsyncIterator[dict[str, Any]]:
        if not self._started:
            await self.start()
        flow = self.classify(credential, body, cls)
        r = await self._admit_any(flow, body, self._deadline(timeout), None)
        if on_admit is not None:
            on_admit(r)
        so = body.get("stream_options")
        wants_usage = isinstance(so, Mapping) and bool(so.get("include_usage"))
        b2 = dict(body)
        b2["stream_options"] = {**(so if isinstance(so, Mapping) else {}), "include_usage": True}
        chunks = 0
        try:
            while True:
                await self._until_started(r)
                assert r.backend is not None
                d = self._dispatchers[r.backend]
                usage: Mapping[str, Any] | None = None
                it = d.stream(r.flow, b2, cost=r.cost).__aiter__()
                try:
                    while True:
                        left = self._remaining(r)
                        try:
                            nxt = it.__anext__()
                            event = await (nxt if left is None else asyncio.wait_for(nxt, max(left, 0.0)))
                        except StopAsyncIteration:
                            break
                        u = event.get("usage")
                        if u:
                            usage = u
                            if not wants_usage and not event.get("choices"):
                                continue
                        chunks += 1
                        yield event
                except asyncio.TimeoutError:
                    self.engine.fail(r, DeadlineExceeded("deadline"), deadline_hit=True)
                    self._pump()
                    raise DeadlineExceeded("the request's deadline ran out while it was streaming; the backend "
                                           "call was aborted") from None
                except (BackendError, NoHealthyBackend) as exc:
                    if not await self._retried(r, exc, retryable=chunks == 0):
                        raise
                    continue
                except Exception as exc:
                    self._failed_otherwise(r, exc)
                    raise
                finally:
                    with contextlib.suppress(Exception):
                        await it.aclose()
                self.engine.complete(r, usage)
                self._pump()
                return
        except (asyncio.CancelledError, GeneratorExit):
            self._gave_up(r, work_tokens=float(chunks))
            raise
        finally:
            if r.outcome is None and r.state != RUNNING:
                self._gave_up(r)

    # ------------------------------------------------------------ reload
    def reload(self, policy: Policy | str | Path) -> list[Request]:
        """Put a new policy in force (keys, weights, classes, orgs, limits, retries) without
        losing a request: waiting ones keep their place in arrival order and their queue age,
        running ones keep their slots (see :meth:`PolicyEngine.reloaded`). The waiting
        requests of a flow the new policy no longer allows are refused (``unauthenticated``
        or ``class_not_allowed``) and returned. A bad file or a change that needs a restart
        (pools' backends, ``cost``, ``state``) raises ``PolicyError`` (or ``OSError``) and the
        policy in force stays as it was."""
        if not isinstance(policy, Policy):
            policy = load_policy(policy)
        if self._closed:
            raise Refused("closed", "this dispatcher is closed")
        engine, ended = self.engine.reloaded(local_policy(policy) if self._shared else policy)
        self.engine = engine
        self._health_dirty = True  # the new queues start with every backend healthy: look again
        self.policy = policy
        if self._shared:
            self.state.reloaded(policy)
        for r in ended:
            fut = self._waiters.pop(r.id, None)
            if fut is not None and not fut.done():
                fut.set_exception(Refused(r.reason or "closed", f"the policy was reloaded and no longer allows "
                                                                f"flow {r.flow.org}/{r.flow.cls}/{r.flow.pool}"))
        self._pump()
        return ended

    # ------------------------------------------------------------ views
    def stats(self) -> dict[str, Any]:
        """The policy's snapshot (``PolicyEngine.stats``) plus each backend's dispatcher view."""
        s = self.engine.stats()
        s["backends"] = {name: d.stats()["backends"][name] for name, d in self._dispatchers.items()}
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

    def dispatcher_of(self, backend: str) -> Dispatcher:
        """The one-backend ``sfq.Dispatcher`` driving ``backend``."""
        return self._dispatchers[backend]
