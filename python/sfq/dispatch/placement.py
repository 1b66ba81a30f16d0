"""The pump and placement: while a backend of a pool has room, take the next request from the
pool's scheduler (through ``DispatchHooks.select`` when hooks are set) and send it to the
least-loaded backend with room that can take it; when a request ends, free its slot and pump
again."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import BackendError
from ._state import (ABORTED, CANCELLED, DONE, FAILED, HELD, OK, OUTCOME_NAMES, PLACED, BState, DispatcherBase,
                     DispatchRecord, Job, Pool, log)


class Placement(DispatcherBase):
    def wake(self, *models: str | None) -> None:
        """Pump the pools of ``models`` again (every pool when none is given): for hooks whose
        ``select`` returned ``None`` and whose answer may have changed (a rate limit refilled,
        a flow resumed). A model no pool serves raises ``KeyError`` (nothing pumped)."""
        if self._closed:
            return
        if not models:
            pools = list(self._pools.values())
        else:
            pools = []
            for m in models:
                try:
                    pools.append(self._pools[m])
                except (KeyError, TypeError):
                    names = sorted(str(k) for k in self._pools)
                    raise KeyError(f"no pool serves model {m!r}; pools: {names}") from None
        for pool in pools:
            self._pump(pool)

    def _room(self, pool: Pool) -> BState | None:
        """The least-loaded backend of ``pool`` with room (healthy, not saturated, not paused after a
        429, below max_in_flight)."""
        best = None
        best_load = 2.0
        for bs in pool.backends:
            if bs.healthy and not bs.saturated and not bs.paused and bs.in_flight < bs.max_in_flight:
                load = bs.in_flight / bs.max_in_flight
                if load < best_load:
                    best, best_load = bs, load
        return best

    def _fit(self, pool: Pool, job: Job) -> BState | None:
        """The least-loaded backend with room that can take ``job`` (max_context)."""
        best = None
        best_load = 2.0
        need = job.need
        for bs in pool.backends:
            if (bs.healthy and not bs.saturated and not bs.paused and bs.in_flight < bs.max_in_flight
                    and (bs.max_context is None or need <= bs.max_context)):
                load = bs.in_flight / bs.max_in_flight
                if load < best_load:
                    best, best_load = bs, load
        return best

    def _select(self, pool: Pool) -> Any:
        hooks = self.hooks
        if hooks is None:
            return pool.sched.dispatch()
        try:
            return hooks.select(pool.model, pool.sched)
        except Exception:
            log.exception("sfq: DispatchHooks.select raised; nothing dispatched from pool %r for now", pool.model)
            return None

    def _pump(self, pool: Pool) -> None:
        """Dispatch one request at a time while a backend of ``pool`` has room."""
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
            d = pool.sched.dispatch() if self.hooks is None else self._select(pool)
            if d is None:
                return
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
                    job.state = HELD
                    fs.held += 1
                    aside.append(job)
                    continue
            self._send(job, bs)

    def _send(self, job: Job, bs: BState) -> None:
        job.state = PLACED
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
        if self.on_dispatch is not None or self.hooks is not None:
            rec = job.record = DispatchRecord(job.flow, job.ticket, job.cost, job.start, job.finish,
                                              job.pool.model, bs.name, wait)
            if self.hooks is not None:
                try:
                    self.hooks.sent(rec)
                except Exception:
                    log.exception("sfq: DispatchHooks.sent raised; ignored")
            if self.on_dispatch is not None:
                try:
                    self.on_dispatch(rec)
                except Exception:  # a broken hook must not break the loop (or another caller's request)
                    log.exception("sfq: the on_dispatch hook raised; ignored")

    def _finish(self, job: Job, outcome: int, err: BackendError | None = None,
                usage: Mapping[str, Any] | None = None) -> None:
        """A placed job is over: free its slot, record the outcome, dispatch more."""
        if job.state != PLACED:
            return
        job.state = CANCELLED if outcome == ABORTED else DONE
        bs = job.bs
        assert bs is not None
        bs.in_flight -= 1
        self._in_flight -= 1
        fs = job.fs
        fs.in_flight -= 1
        if outcome == OK:
            bs.completed += 1
            fs.completed += 1
            bs.backoff = self.backoff
            if usage is not None and job.est is not None:
                try:
                    self.estimator.observe(job.est, usage, job.flow)
                except Exception:  # a bad usage report must not fail a served request or stop the loop
                    log.exception("sfq: calibrating from the usage of backend %r failed; ignored", bs.name)
            if not self._closed:  # a reply: the fast path of _note_reply(bs, None, flow)
                bs.transport_failures = 0
                replies = bs.replies
                if len(replies) == replies.maxlen and replies[0][1]:
                    bs.reply_errors -= 1
                replies.append((job.flow, False))
        elif outcome == FAILED:
            bs.errors += 1
            fs.failed += 1
            bs.last_error = str(err)
            if err is not None and not self._closed:
                self._note_reply(bs, err, job.flow)
        else:
            bs.aborted += 1
            fs.aborted += 1
        if not (fs.waiting or fs.held or fs.in_flight):
            self._maybe_idle(fs)
        if self.hooks is not None and job.record is not None:
            try:
                self.hooks.ended(job.record, OUTCOME_NAMES[outcome], err, usage)
            except Exception:
                log.exception("sfq: DispatchHooks.ended raised; ignored")
        if self._closed:
            if self._in_flight == 0 and self._drained is not None:
                self._drained.set()
            return
        self._pump(job.pool)
