"""Admission: validate a request, estimate it (to route it and check its size) and hand it to
the request engine; and the way back out for a caller that gives up before its request is
placed (withdrawn, uncharged). The engine decides when it goes and what it is charged."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Hashable, Mapping
from typing import Any

from .._common import unhashable_flow
from ..backends.base import CHAT_COMPLETIONS, COMPLETIONS
from ..errors import BadRequest, DispatcherClosed, NoHealthyBackend, RequestTooLarge, UnknownModel
from ..policy.classify import Flow
from ._state import ABORTED, CANCELLED, DEFAULT_CLASS, EXPIRED, PLACED, REJECTED, WAITING, DispatcherBase, Job


class PlacementFuture(asyncio.Future):  # type: ignore[type-arg]
    """The future a waiting request's task awaits until the request is placed.

    ``Task.cancel()`` cancels the future the task waits on synchronously, before the task runs
    again; a pump that runs in between (another request completes) must not place a request
    whose caller has already given up. So ``cancel()`` withdraws a still-waiting request from
    the engine at once, uncharged.
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
    def _admit(self, flow: Hashable, body: Mapping[str, Any], cost: float | None, streaming: bool,
               idempotent: bool, timeout: float | None = None) -> Job:
        """Validate, estimate, hand to the engine and pump. The job comes back placed or waiting.
        ``timeout``: its deadline, seconds from now (the engine ends it if it runs out while it
        waits)."""
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
            raise BadRequest("the request body has neither 'prompt' (/v1/completions) nor 'messages' "
                             "(/v1/chat/completions)")
        s = body.get("stream")
        if streaming:
            if s is not None and s is not True:
                raise BadRequest(f"stream() takes a streaming body: 'stream' must be true or absent, got {s!r}",
                                 param="stream")
        elif s is not None and s is not False:
            raise BadRequest(f"submit() takes a non-streaming body ('stream' is {s!r}); use stream()", param="stream")
        try:
            hash(flow)
        except TypeError:
            raise unhashable_flow(flow) from None
        try:
            est = self.estimator.estimate(body, flow)
        except BadRequest:
            raise
        except (TypeError, ValueError) as exc:
            raise BadRequest(str(exc)) from None
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
        deadline = None
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                    timeout > 0 and math.isfinite(timeout)):
                raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
            deadline = self.clock() + float(timeout)
        key = Flow(flow, DEFAULT_CLASS, pool.name)  # type: ignore[arg-type]  # the caller's flow id is the org
        job = Job(flow, key, body, endpoint, est, pool, self.clock())
        job.stream = streaming
        # the engine checks a given cost, estimates the rest at dispatch; nothing changed if it raises
        job.req = self._engine.submit(key, cost=cost, estimate=est, need=need, item=job, streaming=streaming,
                                      deadline=deadline, idempotency_key="idempotent" if idempotent else None)
        fs = self._flows.get(flow)
        if fs is None or fs.idle:
            fs = self._flow_stats(flow)
        job.fs = fs
        fs.waiting += 1
        self._pump()
        return job

    async def _wait_placed(self, job: Job) -> None:
        if job.state == REJECTED:
            raise DispatcherClosed("the dispatcher closed before this request was sent")
        if job.state == EXPIRED:
            raise self._engine.ended_error(job.req)
        fut = job.fut = PlacementFuture(self, job, asyncio.get_running_loop())
        try:
            await fut
        except asyncio.CancelledError:
            if job.state == WAITING or job.state == CANCELLED:  # never placed: uncharged
                self._withdraw(job)  # (already done when the cancellation went through the future)
            elif job.state == PLACED:  # placed while the cancellation was on its way
                self._finish(job, ABORTED)
            raise
        finally:
            job.fut = None

    def _withdraw(self, job: Job) -> None:
        """Take back a job still waiting in the engine (queued, set aside or between retries),
        uncharged (its caller gave up)."""
        if job.state != WAITING:
            return
        job.state = CANCELLED
        self._engine.cancel(job.req)
        job.fs.waiting -= 1
        job.fs.cancelled += 1
        self._maybe_idle(job.fs)
        self._pump()  # the head may have changed
