"""The pump and placement: while a backend of a pool has room, look at the request the pool's
scheduler names next (``peek``), and when a backend with room can take it, dispatch it (through
``DispatchHooks.select`` when hooks are set), charge it as the charge mode says and send it to
the least-loaded such backend; when a request ends, correct its charge (``settle``/``served``),
report its work done, free its slot and pump again."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import BackendError
from ._state import (ABORTED, CANCELLED, DONE, FAILED, HELD, OK, OUTCOME_NAMES, PLACED, TAKEN, WAITING, BState,
                     DispatcherBase, DispatchRecord, Job, Pool, log)


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

    # ------------------------------------------------------------------ the pump
    def _pump(self, pool: Pool) -> None:
        """Dispatch one request at a time while a backend of ``pool`` has room.

        Look before you pop: the request ``peek()`` names is dispatched (charged) only when a
        backend with room takes it. One that fits none waits aside, uncharged (HELD): with
        ``overtake=0`` everything waits behind it (the stall); with ``overtake=k`` up to ``k``
        such requests have their flow suspended (its requests keep waiting, uncharged) so later
        selections go out, and the flow is resumed when a backend that fits has room (it rejoins
        at ``max(S, v)``: nothing is banked while it waited aside)."""
        sched = pool.sched
        while True:
            if pool.taken and not self._place_taken(pool):
                return
            if pool.aside:
                self._release_aside(pool)
            if not pool.waiting:
                return
            bs = self._room(pool)
            if bs is None:
                return
            if pool.stalled is not None:  # let peek() decide afresh (meters may have moved)
                self._unstall(pool)
            d = sched.peek()
            if d is None:  # every waiting flow is suspended (aside, or by a policy)
                return
            job = d.item
            if pool.limited and bs.max_context is not None and job.need > bs.max_context:
                bs = self._fit(pool, job)
                if bs is None:
                    self._hold(pool, job)
                    if pool.stalled is not None:
                        return  # stall: the head waits, uncharged, first in line
                    continue
            flow = None if self._seed else job.flow
            sched.work_started(flow)  # before dispatch: taking the last waiting request keeps the busy period open
            d = sched.dispatch() if self.hooks is None else self._select(pool)
            if d is None:  # the hook dispatches nothing now
                sched.work_done(flow)
                return
            got: Job = d.item
            if got is not job:  # a hook's own choice (or a scheduler whose peek() differs): it must fit too
                if not self._seed:  # the work is the chosen request's flow's
                    sched.work_started(got.flow)
                    sched.work_done(flow)
                got.working = True
                self._dispatched(pool, got, d)
                fit = self._fit(pool, got)
                if fit is None:
                    got.state = TAKEN
                    got.fs.held += 1
                    pool.taken.append(got)
                else:
                    self._send(got, fit)
                continue
            job.working = True
            self._dispatched(pool, job, d)
            self._send(job, bs)

    def _select(self, pool: Pool) -> Any:
        """Ask the hooks to dispatch (the request ``peek()`` names fits a backend with room)."""
        try:
            return self.hooks.select(pool.model, pool.sched)  # type: ignore[union-attr]
        except Exception:
            log.exception("sfq: DispatchHooks.select raised; nothing dispatched from pool %r for now", pool.model)
            return None

    def _dispatched(self, pool: Pool, job: Job, d: Any) -> None:
        """``job`` left the scheduler (``d``): estimate its cost now and charge it."""
        del pool.waiting[job.ticket]
        fs = job.fs
        if job.state == HELD:  # a hook resumed a flow held aside and dispatched its head
            self._unhold(job)
            fs.waiting += 1
        fs.waiting -= 1
        fs.dispatched += 1
        job.start = d.start
        charge = d.cost
        finish = d.finish
        if not job.fixed:
            target = self._dispatch_cost(job)
            if target != charge:
                try:
                    pool.sched.adjust(job.flow, target - charge)
                    charge = target
                    if self.on_dispatch is not None or self.hooks is not None:  # only a record shows it
                        finish = pool.sched.meter(job.flow)
                except (OverflowError, ValueError):
                    log.exception("sfq: correcting the charge of a request of flow %r failed; charged %g",
                                  job.flow, charge)
        job.cost = job.charged = charge
        job.finish = finish
        fs.charged += charge

    def _dispatch_cost(self, job: Job) -> float:
        """The charge at dispatch: the estimate as the estimator sees it now (its calibration may
        have moved since admission); for a stream in ``served`` mode only its prompt, the output
        being charged as it is delivered."""
        est = self.estimator
        e = job.est
        if e is None:
            return job.cost
        if est.epoch != job.epoch:  # the calibration moved since admission
            try:
                e = job.est = est.reestimate(e, job.flow)
            except Exception:  # (an estimator subclass's own failure) keep the admission's estimate
                log.exception("sfq: estimating a request of flow %r at dispatch failed; charged its estimate at "
                              "admission", job.flow)
                return e.cost
        if self._served and job.stream:
            c = est.input_weight * e.prompt_tokens
            return c if c > est.min_cost else est.min_cost
        return e.cost

    def _hold(self, pool: Pool, job: Job) -> None:
        """``job`` is next in line but fits no backend with room: it waits aside, uncharged."""
        job.state = HELD
        fs = job.fs
        fs.waiting -= 1
        fs.held += 1
        if len(pool.aside) < self.overtake:
            pool.aside.append(job)
            pool.sched.suspend(job.flow)  # others may overtake; its flow keeps its requests, uncharged
        else:
            pool.stalled = job

    def _unstall(self, pool: Pool) -> None:
        job = pool.stalled
        assert job is not None
        pool.stalled = None
        job.state = WAITING
        job.fs.held -= 1
        job.fs.waiting += 1

    def _unhold(self, job: Job) -> None:
        """A HELD job leaves the aside (placed, withdrawn, expired or rejected): its flow competes
        again (at ``max(S, v)``). The caller sets its state and cancels its ticket first if it goes."""
        pool = job.pool
        if pool.stalled is job:
            pool.stalled = None
        else:
            pool.aside.remove(job)
            pool.sched.resume(job.flow)
        job.fs.held -= 1

    def _release_aside(self, pool: Pool) -> None:
        """Put back in the competition the flows whose held head now fits a backend with room."""
        for job in list(pool.aside):
            if self._fit(pool, job) is not None:
                self._unhold(job)
                job.state = WAITING
                job.fs.waiting += 1

    def _place_taken(self, pool: Pool) -> bool:
        """Send the hook-chosen requests that now fit; True when none is left waiting."""
        for job in list(pool.taken):
            bs = self._fit(pool, job)
            if bs is not None:
                pool.taken.remove(job)
                job.fs.held -= 1
                self._send(job, bs)
        return not pool.taken

    # ------------------------------------------------------------------ the charge modes
    def _correct(self, job: Job, delta: float) -> None:
        """Move ``job``'s flow's meter by ``delta`` cost units (the charge modes' corrections)."""
        if not delta:
            return
        try:
            job.pool.sched.adjust(job.flow, delta)
        except (OverflowError, ValueError):
            log.exception("sfq: correcting the charge of a request of flow %r by %g failed; ignored", job.flow, delta)
            return
        job.charged += delta
        job.fs.charged += delta

    def _served_tokens(self, job: Job, event: Mapping[str, Any]) -> None:
        """``served`` mode: charge the output tokens one event of a stream delivers. A usage
        report in the event (``completion_tokens`` so far) is taken as the count; otherwise each
        choice's text counts ``max(1, chars / chars_per_token)`` tokens. Capped at ``max_tokens``."""
        est = job.est
        if est is None:
            return
        u = event.get("usage")
        if u:
            ct = u.get("completion_tokens") if isinstance(u, Mapping) else None
            if type(ct) is int and ct >= 0:
                n = float(min(ct, est.max_tokens))
                if n != job.tokens:
                    self._correct(job, self.estimator.output_weight * (n - job.tokens))
                    job.tokens = n
                return
        choices = event.get("choices")
        if not choices or not isinstance(choices, list):
            return
        cpt = 0.0
        n = 0.0
        for ch in choices:
            if not isinstance(ch, Mapping):
                continue
            text = ch.get("text")
            if text is None:
                delta = ch.get("delta")
                if isinstance(delta, Mapping):
                    text = delta.get("content") or delta.get("reasoning_content")
            if isinstance(text, str) and text:
                if not cpt:
                    cpt = self.estimator.chars_per_token_of(est.model)
                t = len(text) / cpt
                n += t if t > 1.0 else 1.0
        if n:
            room = est.max_tokens - job.tokens
            if n > room:
                n = room
            if n > 0:
                job.tokens += n
                self._correct(job, self.estimator.output_weight * n)

    def _work_over(self, job: Job) -> None:
        """The request's work is over (whatever the outcome): the scheduler's ``work_done``."""
        if job.working:
            job.working = False
            job.pool.sched.work_done(None if self._seed else job.flow)

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
        if outcome == OK and usage is not None and not job.fixed and not self._seed:
            # settle / served: the charge becomes the cost the server reports (a failed or
            # aborted request keeps what it was charged: the estimate, or in served mode its
            # prompt and the tokens delivered before it ended)
            actual = None if job.est is None else self.estimator.actual_cost(job.est, usage)
            if actual is not None:
                self._correct(job, actual - job.charged)
        self._work_over(job)  # after the correction: a flow with work in flight is adjusted exactly
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
