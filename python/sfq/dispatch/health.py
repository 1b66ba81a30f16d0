"""Health and probing: tell "this request failed" from "this backend is down".

The rules are :mod:`sfq.backends.health`'s, applied by one
:class:`~sfq.backends.health.BackendMonitor` per backend (the component ``sfq serve``'s
driver uses too); this module passes what the monitors report on to the request engine and
pumps. A reply is counted in the backend's window of its last ``error_window`` replies. The backend
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

from collections.abc import Hashable

from ..backends.health import HealthOptions
from ..errors import BackendError
from ._state import BState, DispatcherBase

#: pause after a 429 without a (parsable) Retry-After, seconds
DEFAULT_PAUSE = 1.0


class BackendEvents:
    """What the backends' monitors report, passed on to the dispatcher's request engine (the
    monitors' ``HealthListener``)."""

    __slots__ = ("d",)

    def __init__(self, d: Health) -> None:
        self.d = d

    def backend_down(self, name: str, reason: str) -> None:
        d = self.d
        if d._closed:
            return
        d._engine.backend_down(d._by_name[name].pool.name, name, reason)
        d._pump()  # the engine may end what waits in a pool left with no backend

    def backend_up(self, name: str) -> None:
        d = self.d
        d._engine.backend_up(d._by_name[name].pool.name, name)
        if not d._closed:
            d._pump()

    def backend_paused(self, name: str, seconds: float) -> None:
        d = self.d
        d._engine.backend_paused(d._by_name[name].pool.name, name, seconds)

    def backend_unpaused(self, name: str) -> None:
        if not self.d._closed:
            self.d._pump()

    def backend_saturated(self, name: str, saturated: bool) -> None:
        d = self.d
        if d._closed:
            return
        d._engine.backend_saturated(d._by_name[name].pool.name, name, saturated)
        if not saturated:
            d._pump()


class Health(DispatcherBase):
    def _health_options(self) -> HealthOptions:
        """The monitors' thresholds, from the dispatcher's arguments."""
        return HealthOptions(error_window=self.error_window, error_rate=self.error_rate,
                             transport_failures=self.transport_failures, backoff=self.backoff,
                             max_backoff=self.max_backoff, max_pause=self.max_pause, default_pause=DEFAULT_PAUSE)

    def _note_reply(self, bs: BState, err: BackendError | None, flow: Hashable = None) -> None:
        """Account one request's end (completed or failed, not aborted) of ``flow`` against ``bs``."""
        bs.monitor.replied(flow, err)

    def _mark_unhealthy(self, bs: BState, reason: str | None = None) -> None:
        bs.monitor.mark_down(reason or bs.last_error or "marked down")
