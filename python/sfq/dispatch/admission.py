"""Admission: validate a request, estimate it (to route it and check its size), enqueue it at a
lower bound of its cost (the charge is estimated at dispatch); and the way back out for a
caller that gives up before its request is dispatched (withdrawn, uncharged)."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Mapping
from typing import Any

from .._common import unhashable_flow
from ..backends.base import CHAT_COMPLETIONS, COMPLETIONS
from ..errors import DispatcherClosed, NoHealthyBackend, RequestTooLarge, UnknownModel
from ._state import ABORTED, CANCELLED, EXPIRED, HELD, PLACED, REJECTED, TAKEN, WAITING, DispatcherBase, Job


class PlacementFuture(asyncio.Future):  # type: ignore[type-arg]
    """The future a waiting request's task awaits until the request is placed.

    ``Task.cancel()`` cancels the future the task waits on synchronously, before the task runs
    again; a pump that runs in between (another request completes) must not select a request
    whose caller has already given up. So ``cancel()`` withdraws a still-waiting request from
    the scheduler at once, uncharged.
    """

    __slots__ = ("_dispatcher", "_job")

    def __init__(self, dispatcher: DispatcherBase, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self._dispatcher = dispatcher
        self._job = job

    def cancel(self, msg: Any = None) -> bool:
        if not self.done():
            self._dispatcher._withdraw(self._job)
        return super().cancel(msg)


class Admission(DispatcherBase):
    def _admit(self, flow: Hashable, body: Mapping[str, Any], cost: float | None, streaming: bool) -> Job:
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
        if cost is None:
            # the charge is estimated at dispatch (the calibration may learn in between): enqueued at
            # a lower bound, the prompt's cost; SFQ selects by the flows' meters, not by their heads'
            # costs, so this changes no order, and the dispatch corrects the meter at once. When
            # nothing waits it is (almost always) dispatched at once: enqueued at what it will be
            # charged, so that no correction is needed (one would be exact either way)
            e = self.estimator
            c = e.input_weight * est.prompt_tokens
            if c < e.min_cost:
                c = e.min_cost
            if not pool.waiting and not (streaming and self._served):
                c = est.cost
        else:
            c = cost
        job = Job(flow, body, endpoint, est, c, pool, self.clock(), need)
        job.fixed = cost is not None
        job.stream = streaming
        job.epoch = self.estimator.epoch
        if pool.down_since is not None:  # arrives during an outage: its own unavailable_timeout
            job.t_loop = asyncio.get_running_loop().time()
        ticket = pool.sched.enqueue(flow, c, job)  # checks the cost; nothing changed if it raises
        fs = self._flows.get(flow)
        if fs is None or fs.idle:
            fs = self._flow_stats(flow)
        job.fs = fs
        job.ticket = ticket
        fs.waiting += 1
        pool.waiting[ticket] = job
        self._pump(pool)
        return job

    async def _wait_placed(self, job: Job) -> None:
        if job.state == REJECTED:
            raise DispatcherClosed("the dispatcher closed before this request was sent")
        if job.state == EXPIRED:
            raise NoHealthyBackend(f"no backend of pool {job.pool.model!r} was healthy")
        fut = job.fut = PlacementFuture(self, job, asyncio.get_running_loop())
        try:
            await fut
        except asyncio.CancelledError:
            pool = job.pool
            if job.state in (WAITING, HELD, CANCELLED):  # never dispatched: uncharged
                self._withdraw(job)  # (already done when the cancellation went through the future)
                self._pump(pool)  # the head may have changed (overtake / stalls)
            elif job.state == TAKEN:  # dispatched by a hook's own choice and charged, not sent
                pool.taken.remove(job)
                job.state = CANCELLED
                job.fs.held -= 1
                job.fs.aborted += 1
                self._work_over(job)
                self._maybe_idle(job.fs)
                self._pump(pool)
            elif job.state == PLACED:  # placed while the cancellation was on its way
                self._finish(job, ABORTED)
            raise

    def _withdraw(self, job: Job) -> None:
        """Remove a job still in its pool's scheduler (waiting, or held aside), uncharged (its caller
        gave up)."""
        if job.state != WAITING and job.state != HELD:
            return
        pool = job.pool
        pool.sched.cancel(job.ticket)
        del pool.waiting[job.ticket]
        if job.state == HELD:
            self._unhold(job)
        else:
            job.fs.waiting -= 1
        job.state = CANCELLED
        job.fs.cancelled += 1
        self._maybe_idle(job.fs)
