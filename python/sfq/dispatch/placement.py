"""The pump and placement. The request engine decides (``PolicyEngine.poll``: whose request goes
next and on which backend, looking before it pops; what it is charged); the pump carries out
its answers: it sends each started request to its backend, answers the ones the engine ended
(no healthy backend for ``unavailable_timeout``), and sets a timer for the next time the
engine may have something new (a 429's pause ends, a wait runs out). When a request ends it
tells the engine (completed with its usage, failed, aborted), frees the backend's slot and
pumps again."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from ..errors import BackendError, NoHealthyBackend
from ._state import ABORTED, CANCELLED, DONE, EXPIRED, FAILED, OK, PLACED, WAITING, BState, DispatcherBase, \
    DispatchRecord, Job, log


class Placement(DispatcherBase):
    def wake(self, *models: str | None) -> None:
        """Pump again (``models``: the pools to look at; every pool when none is given): after a
        limit freed outside a completion. A model no pool serves raises ``KeyError``."""
        if self._closed:
            return
        for m in models:
            if m not in self._pools:
                names = sorted(str(k) for k in self._pools)
                raise KeyError(f"no pool serves model {m!r}; pools: {names}")
        self._pump()

    # ------------------------------------------------------------------ the pump
    def _pump(self) -> None:
        """Send what the engine starts; end what it dropped; arm the timer for its next wake-up."""
        if self._pumping or self._closed:
            return
        self._pumping = True
        try:
            e = self._engine
            for r in e.poll():
                job: Job = r.item
                self._send(job, self._by_name[r.backend])  # type: ignore[index]
            for r in e.dropped:
                self._expired(r.item)
            self._timer.arm(e.wake_at())
        finally:
            self._pumping = False

    def _expired(self, job: Job) -> None:
        """The engine ended a waiting job: no backend of its pool was healthy for
        ``unavailable_timeout``, or its deadline ran out."""
        if job.state != WAITING:
            return
        job.state = EXPIRED
        fs = job.fs
        fs.waiting -= 1
        r = job.req
        if r.reason == "unavailable":
            fs.unavailable += 1
            err: Exception = NoHealthyBackend(
                f"no backend of pool {job.pool.model!r} was healthy for {self.unavailable_timeout:g} s while this "
                "request waited")
        else:
            fs.expired += 1
            err = self._engine.ended_error(r)
        self._maybe_idle(fs)
        if job.fut is not None and not job.fut.done():
            job.fut.set_exception(err)

    def _send(self, job: Job, bs: BState) -> None:
        r = job.req
        job.state = PLACED
        job.bs = bs
        job.sent_charge = r.charged
        bs.in_flight += 1
        bs.dispatched += 1
        self._in_flight += 1
        fs = job.fs
        fs.waiting -= 1
        fs.in_flight += 1
        fs.dispatched += 1
        fs.charged += r.charged
        wait = self.clock() - job.t_enq
        fs.waits.append(wait)
        fut = job.fut
        if fut is not None and not fut.done():
            fut.set_result(None)
        if self.on_dispatch is not None:
            start = r.start_tag
            w = self._engine.policy.flow_weight(job.flow, r.flow.cls)  # type: ignore[arg-type]
            rec = DispatchRecord(job.flow, r.id, r.charged, start, start + r.charged / w, job.pool.model,
                                 bs.name, wait)
            try:
                self.on_dispatch(rec)
            except Exception:  # a broken hook must not break the loop (or another caller's request)
                log.exception("sfq: the on_dispatch hook raised; ignored")

    def _finish(self, job: Job, outcome: int, err: BackendError | None = None,
                usage: Mapping[str, Any] | None = None, text_chars: int | None = None,
                retryable: bool = True) -> float | None:
        """A placed job's attempt is over: tell the engine (it settles the charge, or plans a
        retry), free the slot, record the outcome, pump. Returns the retry's delay when the
        engine retries it (the caller then waits in ``_retry``), else ``None``."""
        if job.state != PLACED:
            return None
        r = job.req
        e = self._engine
        retry = False
        delay = 0.0
        if outcome == OK:
            e.complete(r, usage, output_text_chars=text_chars)
        elif outcome == FAILED:
            assert err is not None
            decision = e.fail(r, err, retryable=retryable and not self._closed)
            retry, delay = decision.retry, decision.delay
        else:
            e.cancel(r, work_tokens=r.delivered or None)
        bs = job.bs
        assert bs is not None
        bs.in_flight -= 1
        self._in_flight -= 1
        fs = job.fs
        fs.in_flight -= 1
        fs.charged += r.charged - job.sent_charge
        if outcome == OK:
            job.state = DONE
            bs.completed += 1
            fs.completed += 1
            if not self._closed:  # a reply
                bs.monitor.replied(job.flow, None)
        elif outcome == FAILED:
            bs.errors += 1
            bs.last_error = str(err)
            if err is not None and not self._closed:
                self._note_reply(bs, err, job.flow)
            if retry:
                job.state = WAITING
                fs.retried += 1
                fs.waiting += 1
            else:
                job.state = DONE
                fs.failed += 1
        else:
            job.state = CANCELLED
            bs.aborted += 1
            fs.aborted += 1
        if not (fs.waiting or fs.in_flight):
            self._maybe_idle(fs)
        if self._closed:
            if self._in_flight == 0 and self._drained is not None:
                self._drained.set()
        else:
            self._pump()
        return delay if retry else None

    async def _retry(self, job: Job, delay: float) -> None:
        """Wait out a retry's delay, then put the request back into its own flow (it waits its
        turn again); returns once it is placed. Raises what ended it meanwhile."""
        r = job.req
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self._withdraw(job)
            raise
        if job.state != WAITING:  # the dispatcher closed meanwhile
            await self._wait_placed(job)
            return
        if r.outcome is None:
            self._engine.requeue(r)
        if r.outcome is not None:  # it could not go back (no backend in rotation, its deadline)
            job.state = EXPIRED
            job.fs.waiting -= 1
            if r.reason == "unavailable":
                job.fs.unavailable += 1
            else:
                job.fs.expired += 1
            self._maybe_idle(job.fs)
            raise self._engine.ended_error(r)
        self._pump()
        if job.state != PLACED:
            await self._wait_placed(job)
