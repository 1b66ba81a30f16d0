"""Start and shutdown: start the backends and probes; on close, reject what was not sent,
give what is in flight ``close_grace`` seconds, then stop the probes and close the backends."""

from __future__ import annotations

import asyncio

from ..errors import DispatcherClosed
from ._state import REJECTED, WAITING, DispatcherBase, Job


class Lifecycle(DispatcherBase):
    async def start(self) -> None:
        """Start the backends and the saturation probes (``async with`` does this)."""
        if self._closed:
            raise DispatcherClosed("this dispatcher is closed")
        if self._started:
            return
        self._started = True
        await asyncio.gather(*(bs.backend.start() for bs in self._bstates))
        for bs in self._bstates:
            bs.monitor.start()  # its saturation probe, when the backend has one

    async def close(self) -> None:
        """Stop accepting requests; reject those not yet sent (``DispatcherClosed``, uncharged);
        wait up to ``close_grace`` seconds for requests in flight;
        then stop the probes and close the backends (aborting what is still running)."""
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        self._closed = True
        self._timer.cancel()
        for r in self._engine.close():  # every waiting request (and every one between retries), uncharged
            job: Job = r.item
            if job.state == WAITING:
                job.fs.waiting -= 1
                self._reject(job)
        if self._in_flight:
            self._drained = asyncio.Event()
            try:
                await asyncio.wait_for(self._drained.wait(), self.close_grace)
            except asyncio.TimeoutError:
                pass
        await asyncio.gather(*(bs.monitor.close() for bs in self._bstates), return_exceptions=True)
        await asyncio.gather(*(bs.backend.close() for bs in self._bstates), return_exceptions=True)

    def _reject(self, job: Job) -> None:
        job.state = REJECTED
        job.fs.rejected += 1
        self._maybe_idle(job.fs)
        if job.fut is not None and not job.fut.done():
            job.fut.set_exception(DispatcherClosed("the dispatcher closed before this request was sent"))

    @property
    def closed(self) -> bool:
        return self._closed
