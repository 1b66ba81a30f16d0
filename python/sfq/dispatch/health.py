"""Health and probing: take a failing backend out of rotation, health-check it with capped
backoff until it answers, and read saturation probes (a saturated backend gets nothing new)."""

from __future__ import annotations

import asyncio

from ..backends.probe import ProbeReading
from ._state import BState, DispatcherBase, log


class Health(DispatcherBase):
    def _mark_unhealthy(self, bs: BState) -> None:
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

    async def _recover(self, bs: BState, delay: float) -> None:
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

    async def _probe_loop(self, bs: BState) -> None:
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
