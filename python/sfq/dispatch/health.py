"""Health and probing: tell "this request failed" from "this backend is down".

A reply is counted in the backend's window of its last ``error_window`` replies. The backend
leaves the rotation when

* it cannot be connected to (refused, unreachable, connect timeout): at once;
* ``transport_failures`` requests in a row were lost in transport (reset, read timeout, a
  stream cut short, a reply that is not JSON), with no reply in between;
* at least ``error_rate`` of its last ``error_window`` replies were 5xx, not counting the flow
  with the most 5xx when other flows used it too (one tenant's failing requests never take a
  backend down by themselves), and at least half the threshold's count of them.

A 4xx, an error event inside a stream, a stream past its own total deadline, or an isolated
5xx count against that request only. A 429 pauses that backend (nothing new is sent there)
for its ``Retry-After``, at most ``max_pause`` seconds. A backend out of rotation is
health-checked with backoff (``backoff`` doubling to ``max_backoff``) until a check passes;
then its window is cleared. Saturation probes hold a saturated backend out of placement.

Every verdict is reported to the request engine (``backend_down``/``backend_up``/
``backend_paused``/``backend_saturated``), which decides placement: requests that wait in a
pool with no healthy backend are ended by it (``NoHealthyBackend``) after
``unavailable_timeout`` seconds, uncharged.
"""

from __future__ import annotations

import asyncio
import math

from collections.abc import Hashable

from ..backends.probe import ProbeReading
from ..errors import BackendError, BackendHTTPError, BackendRateLimited
from ._state import BState, DispatcherBase, log

#: pause after a 429 without a (parsable) Retry-After, seconds
DEFAULT_PAUSE = 1.0


class Health(DispatcherBase):
    # ---------------------------------------------------------------- replies
    def _note_reply(self, bs: BState, err: BackendError | None, flow: Hashable = None) -> None:
        """Account one request's end (completed or failed, not aborted) of ``flow`` against ``bs``."""
        if err is None or not err.unhealthy:  # a reply that is fine, or the request's own failure
            bs.transport_failures = 0
            if isinstance(err, BackendRateLimited):
                bs.rate_limited += 1
                self._pause(bs, err.retry_after)
            self._record_reply(bs, flow, False)
            return
        if isinstance(err, BackendHTTPError):  # a 5xx: the server answered; counts in the error rate
            bs.transport_failures = 0
            self._record_reply(bs, flow, True)
            verdict = self._error_rate_verdict(bs)
            if verdict is not None:
                self._mark_unhealthy(bs, f"{verdict} (last: {err})")
            return
        if err.never_sent:  # could not connect at all
            self._mark_unhealthy(bs, f"cannot connect ({err})")
            return
        bs.transport_failures += 1
        if bs.transport_failures >= self.transport_failures:
            self._mark_unhealthy(bs, f"{bs.transport_failures} transport failure(s) in a row (last: {err})")

    @staticmethod
    def _record_reply(bs: BState, flow: Hashable, error: bool) -> None:
        replies = bs.replies
        if len(replies) == replies.maxlen and replies[0][1]:
            bs.reply_errors -= 1
        replies.append((flow, error))
        if error:
            bs.reply_errors += 1

    def _error_rate_verdict(self, bs: BState) -> str | None:
        """Why ``bs``'s recent 5xx say it is down, or ``None`` (O(error_window), on a 5xx only)."""
        full = max(1, math.ceil(self.error_rate * self.error_window - 1e-9))
        if bs.reply_errors < min(full, max(1, math.ceil(full / 2))):
            return None
        seen: dict[Hashable, list[int]] = {}
        for f, e in bs.replies:
            c = seen.get(f)
            if c is None:
                c = seen[f] = [0, 0]
            c[0] += 1
            c[1] += e
        n, errors = len(bs.replies), bs.reply_errors
        if len(seen) == 1:
            return f"{errors} of its last {n} replies were 5xx" if errors >= full else None
        top = max(seen, key=lambda f: seen[f][1])
        n -= seen[top][0]
        errors -= seen[top][1]
        if errors >= max(1, math.ceil(full / 2)) and errors >= self.error_rate * n:
            return (f"{errors} of its last {n} replies to other flows than the one failing most were 5xx "
                    f"({bs.reply_errors} of {len(bs.replies)} in all)")
        return None

    # ---------------------------------------------------------------- 429: pause one backend
    def _pause(self, bs: BState, retry_after: float | None) -> None:
        delay = min(DEFAULT_PAUSE if retry_after is None else retry_after, self.max_pause)
        if delay <= 0 or self._closed:
            return
        if bs.pause_handle is not None:
            bs.pause_handle.cancel()
        bs.paused = True
        self._engine.backend_paused(bs.pool.name, bs.name, delay)
        bs.pause_handle = asyncio.get_running_loop().call_later(delay, self._unpause, bs)
        log.info("sfq: backend %r answered 429; nothing new is sent there for %.3g s", bs.name, delay)

    def _unpause(self, bs: BState) -> None:
        bs.paused = False
        bs.pause_handle = None
        if not self._closed:
            self._pump()

    # ---------------------------------------------------------------- down and back
    def _mark_unhealthy(self, bs: BState, reason: str | None = None) -> None:
        if not bs.healthy or self._closed:
            return
        bs.healthy = False
        bs.unhealthy_spells += 1
        bs.down_reason = reason or bs.last_error
        delay = bs.backoff
        log.warning("sfq: backend %r is out of rotation (%s); health check in %.3g s", bs.name, bs.down_reason,
                    delay)
        bs.backoff = min(bs.backoff * 2, self.max_backoff)
        loop = asyncio.get_running_loop()
        if bs.recover_task is None:
            bs.recover_task = loop.create_task(self._recover(bs, delay), name=f"sfq-recover-{bs.name}")
        self._engine.backend_down(bs.pool.name, bs.name, bs.down_reason)
        self._pump()  # the engine may end what waits in a pool left with no backend

    async def _recover(self, bs: BState, delay: float) -> None:
        """Health-check an unhealthy backend with capped exponential backoff until it passes."""
        try:
            while not self._closed:
                bs.check_delay = delay
                await asyncio.sleep(delay)
                try:
                    ok = await bs.backend.check_health()
                except Exception:
                    ok = False
                if ok:
                    self._back_in_rotation(bs)
                    return
                delay = min(delay * 2, self.max_backoff)
        finally:
            bs.recover_task = None
            bs.check_delay = None

    def _back_in_rotation(self, bs: BState) -> None:
        bs.healthy = True
        bs.down_reason = None
        bs.replies.clear()
        bs.reply_errors = 0
        bs.transport_failures = 0
        self._engine.backend_up(bs.pool.name, bs.name)
        log.info("sfq: backend %r passed its health check; back in rotation", bs.name)
        if not self._closed:
            self._pump()

    # ---------------------------------------------------------------- saturation
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
            if was != bs.saturated and not self._closed:
                self._engine.backend_saturated(bs.pool.name, bs.name, bs.saturated)
                if was:
                    self._pump()
            await asyncio.sleep(probe.interval)
