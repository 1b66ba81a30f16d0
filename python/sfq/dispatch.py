"""The asyncio dispatch adapter: sfq in front of a fleet of inference servers (seed 000 §5, §7.1).

Three layers, kept apart (seed 000 §5.2):

* **cost** - each request's cost is estimated when it arrives (``CostEstimator``) and charged,
  unchanged, when it is dispatched;
* **ordering** - one scheduler (``sfq.Scheduler``) per *pool*, the backends that serve the same
  model; it decides only whose request goes next;
* **placement** - the dispatched request goes to the least-loaded healthy backend of its pool
  that has room (``max_in_flight``; not saturated according to its probe; big enough for the
  request when backends declare ``max_context``).

The loop is event-driven: on every arrival and every completion (and when a backend recovers
or stops being saturated) the pool dispatches one request at a time while a backend has room.
If the selected request fits on no backend with room (``max_context``), the default is to
**stall**: it waits aside, charged and first in line, and nothing else is dispatched until it
is placed, so the meters alone explain every decision. ``overtake=k`` lets later selections
go out while up to ``k`` such requests wait aside.

Meters change only at dispatch. Completions feed the estimator's calibration and the
statistics; failures and cancellations after dispatch only the statistics. A caller that
gives up (its task is cancelled) before dispatch leaves the queue uncharged; after dispatch
the backend call is aborted (the connection closes, the server stops generating). Every
accepted request ends as exactly one of: completed, failed (an ``sfq.errors.BackendError``),
cancelled (before or after dispatch) or rejected (``DispatcherClosed`` when the dispatcher
closes before it was placed).

Time: waits are measured with the injected ``clock`` (seconds, default ``time.monotonic``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from ._common import unhashable_flow
from ._core import Scheduler
from .backends.base import CHAT_COMPLETIONS, COMPLETIONS, Backend
from .backends.openai import OpenAIBackend
from .backends.probe import ProbeReading
from .cost import CostEstimator, Estimate
from .errors import BackendError, DispatcherClosed, RequestTooLarge, UnknownModel

__all__ = ["Dispatcher", "DispatchRecord"]

log = logging.getLogger("sfq.dispatch")

# job states
_WAITING, _HELD, _PLACED, _DONE, _CANCELLED, _REJECTED = range(6)
# outcomes of a placed job
_OK, _FAILED, _ABORTED = range(3)


class DispatchRecord(NamedTuple):
    """What ``on_dispatch`` receives when a request is sent to a backend.

    ``start``/``finish``: the flow's meter before and after the charge (cost units, the
    scheduler's ``Dispatch``); ``wait``: seconds from submit to send (injected clock).
    """

    flow: Hashable
    ticket: int
    cost: float
    start: float
    finish: float
    model: str | None
    backend: str
    wait: float


class _BState:
    """The dispatcher's view of one backend."""

    __slots__ = ("backend", "name", "pool", "index", "max_in_flight", "max_context", "in_flight", "healthy",
                 "saturated", "dispatched", "completed", "errors", "aborted", "last_error", "backoff",
                 "recover_task", "probe_task", "reading", "probe_errors", "unhealthy_spells")

    def __init__(self, backend: Backend, pool: _Pool, index: int, backoff: float) -> None:
        self.backend = backend
        self.name = backend.name
        self.pool = pool
        self.index = index
        self.max_in_flight = backend.max_in_flight
        self.max_context = backend.max_context
        self.in_flight = 0
        self.healthy = True
        self.saturated = False
        self.dispatched = 0
        self.completed = 0
        self.errors = 0
        self.aborted = 0
        self.last_error: str | None = None
        self.backoff = backoff  # seconds before the next health probe when it next turns unhealthy
        self.recover_task: asyncio.Task[None] | None = None
        self.probe_task: asyncio.Task[None] | None = None
        self.reading: ProbeReading | None = None
        self.probe_errors = 0
        self.unhealthy_spells = 0


class _Pool:
    """Backends serving one model, and the scheduler that orders their requests."""

    __slots__ = ("model", "sched", "backends", "aside", "limited", "largest_context", "waiting")

    def __init__(self, model: str | None, sched: Any) -> None:
        self.model = model
        self.sched = sched
        self.backends: list[_BState] = []
        self.aside: list[_Job] = []  # selected (charged), waiting for a backend that fits
        self.limited = False  # some backend declares max_context
        self.largest_context: float = float("inf")
        self.waiting: dict[int, _Job] = {}  # ticket -> job still in the scheduler


class _Job:
    __slots__ = ("flow", "body", "endpoint", "est", "cost", "pool", "ticket", "t_enq", "state", "bs", "fut",
                 "need", "start", "finish", "fs")

    def __init__(self, flow: Hashable, body: dict[str, Any], endpoint: str, est: Estimate | None, cost: float,
                 pool: _Pool, t_enq: float, need: float) -> None:
        self.flow = flow
        self.body = body
        self.endpoint = endpoint
        self.est = est
        self.cost = cost
        self.pool = pool
        self.t_enq = t_enq
        self.need = need
        self.fs: _FlowStats = None  # type: ignore[assignment]  # set once enqueued
        self.ticket = 0
        self.state = _WAITING
        self.bs: _BState | None = None
        self.fut: asyncio.Future[None] | None = None
        self.start = 0.0
        self.finish = 0.0


class _Placement(asyncio.Future):  # type: ignore[type-arg]
    """The future a waiting request's task awaits until the request is placed.

    ``Task.cancel()`` cancels the future the task waits on synchronously, before the task runs
    again; a pump that runs in between (another request completes) must not select a request
    whose caller has already given up. So ``cancel()`` withdraws a still-waiting request from
    the scheduler at once, uncharged.
    """

    __slots__ = ("_dispatcher", "_job")

    def __init__(self, dispatcher: Dispatcher, job: _Job, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self._dispatcher = dispatcher
        self._job = job

    def cancel(self, msg: Any = None) -> bool:
        if not self.done():
            self._dispatcher._withdraw(self._job)
        return super().cancel(msg)


class _FlowStats:
    __slots__ = ("waiting", "held", "in_flight", "dispatched", "completed", "failed", "cancelled", "aborted",
                 "rejected", "charged", "waits")

    def __init__(self, window: int) -> None:
        self.waiting = 0  # in the scheduler
        self.held = 0  # selected and charged, waiting aside for a backend that fits
        self.in_flight = 0  # sent to a backend
        self.dispatched = 0  # selected by the scheduler (charged)
        self.completed = 0
        self.failed = 0
        self.cancelled = 0  # given up before dispatch: uncharged
        self.aborted = 0  # given up after dispatch: charged, backend call aborted
        self.rejected = 0  # removed when the dispatcher closed
        self.charged = 0.0  # cost units charged at dispatch
        self.waits: deque[float] = deque(maxlen=window)  # seconds from submit to send


class Dispatcher:
    """Fair dispatch of OpenAI-style requests to a fleet of backends.

    Parameters
    ----------
    backends:
        the fleet: ``Backend`` instances, or URLs (each becomes ``OpenAIBackend(url)``).
        Backends with the same ``model`` form a pool with one scheduler; backends with
        ``model=None`` form the default pool, which takes every model name no other pool
        serves. Names must be unique.
    estimator:
        the ``CostEstimator`` (default: ``CostEstimator()``, cost in tokens).
    clock:
        seconds, for waits (default ``time.monotonic``).
    overtake:
        0 (default): stall when the selected request fits on no backend with room; ``k > 0``:
        up to ``k`` such requests wait aside while later selections go out.
    backoff, max_backoff:
        seconds before the first health probe of a backend that failed, doubling up to
        ``max_backoff`` while probes fail (and across spells until a request succeeds there).
    scheduler:
        the scheduler class/factory (default ``sfq.Scheduler``).
    on_dispatch:
        called with a ``DispatchRecord`` each time a request is sent (synchronously: keep it short).
    wait_window:
        the last this-many waits per flow are kept for the percentiles in ``stats()``.
    close_grace:
        seconds ``close()`` waits for requests in flight before closing the backends (aborting them).
    max_flow_stats:
        per-flow statistics are kept for at most about this many flows: beyond it, the flows with
        nothing waiting, held or in flight are forgotten, oldest first (a proxy keyed by API key
        must not grow with every key it ever saw). Flows with work in progress are always kept.
    """

    def __init__(
        self,
        backends: Iterable[Backend | str],
        *,
        estimator: CostEstimator | None = None,
        clock: Callable[[], float] = time.monotonic,
        overtake: int = 0,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        scheduler: Callable[[], Any] | None = None,
        on_dispatch: Callable[[DispatchRecord], None] | None = None,
        wait_window: int = 10_000,
        close_grace: float = 30.0,
        max_flow_stats: int = 100_000,
    ) -> None:
        fleet: list[Backend] = [OpenAIBackend(b) if isinstance(b, str) else b for b in backends]
        backends = fleet
        if not backends:
            raise ValueError("a Dispatcher needs at least one backend")
        for b in backends:
            if not isinstance(b, Backend):
                raise TypeError(f"backends must be sfq.backends.Backend instances or URLs, got {b!r}")
        names = [b.name for b in backends]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"backend names must be unique; repeated: {dup}")
        if isinstance(overtake, bool) or not isinstance(overtake, int) or overtake < 0:
            raise ValueError(f"overtake must be an integer >= 0, got {overtake!r}")
        for what, v in (("backoff", backoff), ("max_backoff", max_backoff), ("close_grace", close_grace)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{what} must be a number > 0, got {v!r}")
        if max_backoff < backoff:
            raise ValueError(f"max_backoff ({max_backoff!r}) must be >= backoff ({backoff!r})")
        if isinstance(wait_window, bool) or not isinstance(wait_window, int) or wait_window < 1:
            raise ValueError(f"wait_window must be an integer >= 1, got {wait_window!r}")
        if isinstance(max_flow_stats, bool) or not isinstance(max_flow_stats, int) or max_flow_stats < 1:
            raise ValueError(f"max_flow_stats must be an integer >= 1, got {max_flow_stats!r}")
        self._max_flow_stats = max_flow_stats
        if not callable(clock):
            raise TypeError(f"clock must be callable, got {clock!r}")
        if estimator is not None and not isinstance(estimator, CostEstimator):
            raise TypeError(f"estimator must be a CostEstimator, got {estimator!r}")
        self.estimator = estimator if estimator is not None else CostEstimator()
        self.clock = clock
        self.overtake = overtake
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.close_grace = float(close_grace)
        self.on_dispatch = on_dispatch
        self._window = wait_window
        make = scheduler if scheduler is not None else Scheduler
        self._pools: dict[str | None, _Pool] = {}
        self._bstates: list[_BState] = []
        for i, b in enumerate(backends):
            pool = self._pools.get(b.model)
            if pool is None:
                pool = self._pools[b.model] = _Pool(b.model, make())
            bs = _BState(b, pool, i, self.backoff)
            pool.backends.append(bs)
            self._bstates.append(bs)
        for pool in self._pools.values():
            ctx = [bs.max_context for bs in pool.backends]
            pool.limited = any(c is not None for c in ctx)
            sizes = [c for c in ctx if c is not None]
            pool.largest_context = float("inf") if len(sizes) < len(ctx) else float(max(sizes))
        self._default = self._pools.get(None)
        self._only = self._default if len(self._pools) == 1 else None
        self._flows: dict[Hashable, _FlowStats] = {}
        self._started = False
        self._closed = False
        self._in_flight = 0
        self._drained: asyncio.Event | None = None
        self._close_task: asyncio.Task[None] | None = None

    # ================================================================= lifecycle
    async def start(self) -> None:
        """Start the backends and the saturation probes (``async with`` does this)."""
        if self._closed:
            raise DispatcherClosed("this dispatcher is closed")
        if self._started:
            return
        self._started = True
        await asyncio.gather(*(bs.backend.start() for bs in self._bstates))
        for bs in self._bstates:
            if bs.backend.probe is not None:
                bs.probe_task = asyncio.create_task(self._probe_loop(bs), name=f"sfq-probe-{bs.name}")

    async def close(self) -> None:
        """Stop accepting requests; reject those not yet sent (``DispatcherClosed``; uncharged
        unless already selected); wait up to ``close_grace`` seconds for requests in flight;
        then stop the probes and close the backends (aborting what is still running)."""
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            for ticket, job in list(pool.waiting.items()):
                pool.sched.cancel(ticket)
                job.fs.waiting -= 1
                self._reject(job)
            pool.waiting.clear()
            for job in pool.aside:
                job.fs.held -= 1
                self._reject(job)
            pool.aside.clear()
        if self._in_flight:
            self._drained = asyncio.Event()
            try:
                await asyncio.wait_for(self._drained.wait(), self.close_grace)
            except asyncio.TimeoutError:
                pass
        tasks = [t for bs in self._bstates for t in (bs.recover_task, bs.probe_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(bs.backend.close() for bs in self._bstates), return_exceptions=True)

    def _reject(self, job: _Job) -> None:
        job.state = _REJECTED
        job.fs.rejected += 1
        if job.fut is not None and not job.fut.done():
            job.fut.set_exception(DispatcherClosed("the dispatcher closed before this request was sent"))

    async def __aenter__(self) -> Dispatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # ================================================================= requests
    async def submit(self, flow: Hashable, body: Mapping[str, Any], *, cost: float | None = None) -> dict[str, Any]:
        """Queue a non-streaming request of ``flow`` and return the backend's JSON reply.

        ``body`` is an OpenAI ``/v1/completions`` (``prompt``) or ``/v1/chat/completions``
        (``messages``) request; ``cost`` overrides the estimator's cost (cost units).
        Raises ``BackendError`` subclasses for backend failures, ``DispatcherClosed``,
        ``UnknownModel``, ``RequestTooLarge``, or ``ValueError``/``TypeError`` for bad input
        (nothing queued then).
        """
        if not self._started:
            await self.start()
        job = self._admit(flow, body, cost, False)
        if job.state != _PLACED:
            await self._wait_placed(job)
        bs = job.bs
        assert bs is not None
        try:
            reply = await bs.backend.complete(job.endpoint, job.body)
        except asyncio.CancelledError:
            self._finish(job, _ABORTED)
            raise
        except BackendError as exc:
            self._finish(job, _FAILED, exc)
            raise
        except Exception as exc:
            err = BackendError(f"backend {bs.name!r} raised {type(exc).__name__}: {exc}", backend=bs.name)
            self._finish(job, _FAILED, err)
            raise err from exc
        self._finish(job, _OK, None, reply.get("usage") if isinstance(reply, dict) else None)
        return reply

    async def stream(self, flow: Hashable, body: Mapping[str, Any], *,
                     cost: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """Queue a streaming request of ``flow`` and yield the backend's events (JSON objects).

        The request is queued when iteration starts. Stopping early (``break``, or closing the
        generator: use ``contextlib.aclosing``) or cancelling the consuming task aborts it.
        Usage is always asked of the backend; the usage-only final chunk is passed on only
        when the body asked for it (``stream_options.include_usage``).
        """
        if not self._started:
            await self.start()
        job = self._admit(flow, body, cost, True)
        if job.state != _PLACED:
            await self._wait_placed(job)
        bs = job.bs
        assert bs is not None
        so = job.body.get("stream_options")
        wants_usage = isinstance(so, Mapping) and bool(so.get("include_usage"))
        usage = None
        outcome, err = _ABORTED, None
        agen = None
        try:
            agen = bs.backend.stream(job.endpoint, job.body)  # may raise before returning an iterator
            async for event in agen:
                u = event.get("usage")
                if u:
                    usage = u
                    if not wants_usage and not event.get("choices"):
                        continue
                yield event
            outcome = _OK
        except BackendError as exc:
            outcome, err = _FAILED, exc
            raise
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            outcome = _FAILED
            err = BackendError(f"backend {bs.name!r} raised {type(exc).__name__}: {exc}", backend=bs.name)
            raise err from exc
        finally:
            aclose = getattr(agen, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                self._finish(job, outcome, err, usage)

    def _admit(self, flow: Hashable, body: Mapping[str, Any], cost: float | None, streaming: bool) -> _Job:
        """Validate, estimate, enqueue and pump. The job comes back placed or waiting."""
        if self._closed:
            raise DispatcherClosed("this dispatcher is closed")
        if type(body) is not dict:
            if not isinstance(body, Mapping):
                raise TypeError(f"the request body must be a mapping (a JSON object), got {type(body).__name__}")
            body = dict(body)
        if "messages" in body:
            endpoint = CHAT_COMPLETIONS
        elif "prompt" in body:
            endpoint = COMPLETIONS
        else:
            raise ValueError("the request body has neither 'prompt' (/v1/completions) nor 'messages' "
                             "(/v1/chat/completions)")
        s = body.get("stream")
        if streaming:
            if s is not None and s is not True:
                raise ValueError(f"stream() takes a streaming body: 'stream' must be true or absent, got {s!r}")
        elif s is not None and s is not False:
            raise ValueError(f"submit() takes a non-streaming body ('stream' is {s!r}); use stream()")
        try:
            hash(flow)
        except TypeError:
            raise unhashable_flow(flow) from None
        est = self.estimator.estimate(body, flow)
        pool = self._only
        if pool is None:
            pool = self._pools.get(est.model or None)
            if pool is None:
                pool = self._default
                if pool is None:
                    raise UnknownModel(f"no backend serves model {est.model!r}; pools: "
                                       f"{sorted(str(m) for m in self._pools)}")
        per_seq = est.max_tokens // est.copies  # context is per sequence: n (and a batch) do not add up
        need = est.prompt_tokens + per_seq
        if need > pool.largest_context:
            raise RequestTooLarge(
                f"the request needs about {need:.0f} tokens (prompt {est.prompt_tokens:.0f} + max_tokens "
                f"{per_seq}), more than any backend of pool {pool.model!r} takes "
                f"(largest max_context {pool.largest_context:.0f})")
        c = est.cost if cost is None else cost
        job = _Job(flow, body, endpoint, est, c, pool, self.clock(), need)
        ticket = pool.sched.enqueue(flow, c, job)  # checks the cost; nothing changed if it raises
        fs = self._flows.get(flow)
        if fs is None:
            if len(self._flows) >= self._max_flow_stats:
                self._forget_idle_flow_stats()
            fs = self._flows[flow] = _FlowStats(self._window)
        job.fs = fs
        job.ticket = ticket
        fs.waiting += 1
        pool.waiting[ticket] = job
        self._pump(pool)
        return job

    def _forget_idle_flow_stats(self) -> None:
        """Drop the statistics of idle flows, oldest first, down to 90% of ``max_flow_stats``
        (amortised: one sweep per tenth of the limit of new flows)."""
        excess = len(self._flows) - int(self._max_flow_stats * 0.9)
        idle = [f for f, fs in self._flows.items() if not (fs.waiting or fs.held or fs.in_flight)][:excess]
        for f in idle:
            del self._flows[f]

    async def _wait_placed(self, job: _Job) -> None:
        if job.state == _REJECTED:
            raise DispatcherClosed("the dispatcher closed before this request was sent")
        fut = job.fut = _Placement(self, job, asyncio.get_running_loop())
        try:
            await fut
        except asyncio.CancelledError:
            pool = job.pool
            if job.state in (_WAITING, _CANCELLED):  # never dispatched: uncharged
                self._withdraw(job)  # (already done when the cancellation went through the future)
                self._pump(pool)  # the head may have changed (overtake / stalls)
            elif job.state == _HELD:  # selected and charged, not sent
                pool.aside.remove(job)
                job.state = _CANCELLED
                job.fs.held -= 1
                job.fs.aborted += 1
                self._pump(pool)  # a stall may be over
            elif job.state == _PLACED:  # placed while the cancellation was on its way
                self._finish(job, _ABORTED)
            raise

    def _withdraw(self, job: _Job) -> None:
        """Remove a still-waiting job from its pool's scheduler, uncharged (its caller gave up)."""
        if job.state != _WAITING:
            return
        pool = job.pool
        pool.sched.cancel(job.ticket)
        del pool.waiting[job.ticket]
        job.state = _CANCELLED
        job.fs.waiting -= 1
        job.fs.cancelled += 1

    # ================================================================= the loop
    def _room(self, pool: _Pool) -> _BState | None:
        """The least-loaded backend of ``pool`` with room (healthy, not saturated, below max_in_flight)."""
        best = None
        best_load = 2.0
        for bs in pool.backends:
            if bs.healthy and not bs.saturated and bs.in_flight < bs.max_in_flight:
                load = bs.in_flight / bs.max_in_flight
                if load < best_load:
                    best, best_load = bs, load
        return best

    def _fit(self, pool: _Pool, job: _Job) -> _BState | None:
        """The least-loaded backend with room that can take ``job`` (max_context)."""
        best = None
        best_load = 2.0
        need = job.need
        for bs in pool.backends:
            if (bs.healthy and not bs.saturated and bs.in_flight < bs.max_in_flight
                    and (bs.max_context is None or need <= bs.max_context)):
                load = bs.in_flight / bs.max_in_flight
                if load < best_load:
                    best, best_load = bs, load
        return best

    def _pump(self, pool: _Pool) -> None:
        """Dispatch one request at a time while a backend of ``pool`` has room."""
        sched = pool.sched
        aside = pool.aside
        while True:
            if aside:
                for job in list(aside):
                    bs = self._fit(pool, job)
                    if bs is None:
                        if not self.overtake:
                            return  # stall: the selected head waits for a backend that fits
                        continue
                    aside.remove(job)
                    job.fs.held -= 1
                    self._send(job, bs)
                if len(aside) > self.overtake:
                    return
            if not pool.waiting:
                return
            bs = self._room(pool)
            if bs is None:
                return
            d = sched.dispatch()
            job = d.item
            del pool.waiting[job.ticket]
            job.start = d.start
            job.finish = d.finish
            fs = job.fs
            fs.waiting -= 1
            fs.dispatched += 1
            fs.charged += d.cost
            if pool.limited and bs.max_context is not None and job.need > bs.max_context:
                bs = self._fit(pool, job)
                if bs is None:
                    job.state = _HELD
                    fs.held += 1
                    aside.append(job)
                    continue
            self._send(job, bs)

    def _send(self, job: _Job, bs: _BState) -> None:
        job.state = _PLACED
        job.bs = bs
        bs.in_flight += 1
        bs.dispatched += 1
        self._in_flight += 1
        fs = job.fs
        fs.in_flight += 1
        wait = self.clock() - job.t_enq
        fs.waits.append(wait)
        fut = job.fut
        if fut is not None and not fut.done():
            fut.set_result(None)
        if self.on_dispatch is not None:
            try:
                self.on_dispatch(DispatchRecord(job.flow, job.ticket, job.cost, job.start, job.finish,
                                                job.pool.model, bs.name, wait))
            except Exception:  # a broken hook must not break the loop (or another caller's request)
                log.exception("sfq: the on_dispatch hook raised; ignored")

    def _finish(self, job: _Job, outcome: int, err: BackendError | None = None,
                usage: Mapping[str, Any] | None = None) -> None:
        """A placed job is over: free its slot, record the outcome, dispatch more."""
        if job.state != _PLACED:
            return
        job.state = _CANCELLED if outcome == _ABORTED else _DONE
        bs = job.bs
        assert bs is not None
        bs.in_flight -= 1
        self._in_flight -= 1
        fs = job.fs
        fs.in_flight -= 1
        if outcome == _OK:
            bs.completed += 1
            fs.completed += 1
            bs.backoff = self.backoff
            if usage is not None and job.est is not None:
                try:
                    self.estimator.observe(job.est, usage, job.flow)
                except Exception:  # a bad usage report must not fail a served request or stop the loop
                    log.exception("sfq: calibrating from the usage of backend %r failed; ignored", bs.name)
        elif outcome == _FAILED:
            bs.errors += 1
            fs.failed += 1
            bs.last_error = str(err)
            if err is not None and err.unhealthy:
                self._mark_unhealthy(bs)
        else:
            bs.aborted += 1
            fs.aborted += 1
        if self._closed:
            if self._in_flight == 0 and self._drained is not None:
                self._drained.set()
            return
        self._pump(job.pool)

    # ================================================================= health and probes
    def _mark_unhealthy(self, bs: _BState) -> None:
        if not bs.healthy or self._closed:
            return
        bs.healthy = False
        bs.unhealthy_spells += 1
        delay = bs.backoff
        log.warning("sfq: backend %r is unhealthy (%s); health check in %.3g s", bs.name, bs.last_error, delay)
        bs.backoff = min(bs.backoff * 2, self.max_backoff)
        if bs.recover_task is None:
            bs.recover_task = asyncio.get_running_loop().create_task(self._recover(bs, delay),
                                                                      name=f"sfq-recover-{bs.name}")

    async def _recover(self, bs: _BState, delay: float) -> None:
        """Probe an unhealthy backend with exponential backoff until it answers its health check."""
        try:
            while not self._closed:
                await asyncio.sleep(delay)
                try:
                    ok = await bs.backend.check_health()
                except Exception:
                    ok = False
                if ok:
                    bs.healthy = True
                    log.info("sfq: backend %r passed its health check; back in rotation", bs.name)
                    if not self._closed:
                        self._pump(bs.pool)
                    return
                delay = min(delay * 2, self.max_backoff)
        finally:
            bs.recover_task = None

    async def _probe_loop(self, bs: _BState) -> None:
        probe = bs.backend.probe
        assert probe is not None
        while not self._closed:
            try:
                reading: ProbeReading | None = probe.read(await bs.backend.fetch_metrics())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                bs.probe_errors += 1
                bs.last_error = f"saturation probe: {exc}"
                reading = None  # unknown: fall back to max_in_flight alone
            bs.reading = reading
            was = bs.saturated
            bs.saturated = reading is not None and reading.saturated
            if was and not bs.saturated and not self._closed:
                self._pump(bs.pool)
            await asyncio.sleep(probe.interval)

    # ================================================================= control and stats
    def set_weight(self, flow: Hashable, weight: float) -> None:
        """Set ``flow``'s weight (> 0, default 1) in every pool, for its future charges."""
        pools = list(self._pools.values())
        pools[0].sched.set_weight(flow, weight)  # validates; raises before anything changed
        for pool in pools[1:]:
            pool.sched.set_weight(flow, weight)

    def stats(self) -> dict[str, Any]:
        """A snapshot.

        ``flows[flow]``: ``waiting`` (queued), ``held`` (selected, waiting aside for a backend that
        fits), ``in_flight``, ``dispatched`` (charged), ``completed``, ``failed``, ``cancelled``
        (before dispatch, uncharged), ``aborted`` (after dispatch), ``rejected`` (at close),
        ``charged_cost`` (cost units), ``wait_p50``/``wait_p95``/``wait_p99`` (seconds from
        submit to send over the last ``wait_window`` sends; ``None`` before any).
        ``backends[name]``: ``model``, ``in_flight``, ``max_in_flight``, ``healthy``,
        ``saturated``, ``dispatched``, ``completed``, ``errors``, ``aborted``, ``last_error``,
        ``unhealthy_spells``, ``probe`` (the last reading as a dict, or ``None``), ``probe_errors``.
        ``pools[model]``: ``waiting``, ``held``, ``virtual_time``, ``backends`` (names).
        """
        flows = {}
        for flow, fs in self._flows.items():
            p50: float | None
            p95: float | None
            p99: float | None
            if fs.waits:
                p50, p95, p99 = (float(x) for x in np.percentile(np.fromiter(fs.waits, float, len(fs.waits)),
                                                                 (50, 95, 99)))
            else:
                p50 = p95 = p99 = None
            flows[flow] = {
                "waiting": fs.waiting, "held": fs.held, "in_flight": fs.in_flight, "dispatched": fs.dispatched,
                "completed": fs.completed, "failed": fs.failed, "cancelled": fs.cancelled, "aborted": fs.aborted,
                "rejected": fs.rejected, "charged_cost": fs.charged,
                "wait_p50": p50, "wait_p95": p95, "wait_p99": p99,
            }
        backends = {}
        for bs in self._bstates:
            backends[bs.name] = {
                "model": bs.pool.model, "in_flight": bs.in_flight, "max_in_flight": bs.max_in_flight,
                "healthy": bs.healthy, "saturated": bs.saturated, "dispatched": bs.dispatched,
                "completed": bs.completed, "errors": bs.errors, "aborted": bs.aborted, "last_error": bs.last_error,
                "unhealthy_spells": bs.unhealthy_spells,
                "probe": bs.reading._asdict() if bs.reading is not None else None, "probe_errors": bs.probe_errors,
            }
        pools = {
            model: {"waiting": len(p.waiting), "held": len(p.aside), "virtual_time": p.sched.virtual_time,
                    "backends": [bs.name for bs in p.backends]}
            for model, p in self._pools.items()
        }
        return {"flows": flows, "backends": backends, "pools": pools}
