"""Backend health: tell "this request failed" from "this backend is down", for any driver.

A :class:`BackendMonitor` watches one backend. Its driver tells it how each request that
reached the backend ended (:meth:`BackendMonitor.replied`); the monitor decides whether the
backend is in rotation and reports every change to a :class:`HealthListener` (the request
engine of ``sfq serve``, or a dispatcher's own placement). The rules:

* a backend that cannot be connected to (refused, unreachable, connect timeout) leaves the
  rotation;
* so does one that lost ``transport_failures`` requests in a row in transport (reset, read
  timeout, a stream cut short, a reply that is not JSON), with no reply in between;
* and one where at least ``error_rate`` of its last ``error_window`` replies were 5xx (and at
  least half the threshold's count of them), not counting the flow with the most 5xx when
  other flows used it too.

A failure the driver did not see itself but was told of (``reported``: an embedder's
``grant.fail()``, or a ``BackendError`` raised inside its ``acquire`` block) is one tenant's
word: one flow's reports alone never take a backend out. When a rule above is met by a
report and the failures it counts all come from one flow, the monitor checks the backend
itself first, once (``Backend.check_health``, the health check below): the backend leaves
the rotation only if that check fails too; if it passes, the failures counted so far are
forgotten (that flow must fail as many times again before the next check). Failures from
more than one flow, and the driver's own calls, apply the rules as they are.

A 4xx, an error event inside a stream, a stream past its own total deadline or an isolated
5xx count against that request only. A 429 pauses the backend (nothing new is sent there)
for its ``Retry-After``, at most ``max_pause`` seconds (``default_pause`` without one). A
backend out of rotation is health-checked (``Backend.check_health``: ``/health``, then
``/v1/models``, then a one-token request) with backoff, ``backoff`` doubling to
``max_backoff`` (and across spells until a request succeeds there), until a check passes;
then its window is cleared and it is back. A backend with a ``SaturationProbe`` is read
every ``probe.interval`` seconds; a saturated one is held out of placement but stays in
rotation (its pool is not down).

The monitor does no placement and knows nothing of flows beyond the ids it is given; it
needs a running event loop only for its timers and tasks (:meth:`start`, :meth:`close`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from ..errors import BackendError, BackendHTTPError, BackendRateLimited
from .base import Backend
from .probe import ProbeReading

__all__ = ["BackendMonitor", "HealthListener", "HealthOptions", "ReplyWindow"]

log = logging.getLogger("sfq.backends")

#: no flow yet (a marker no flow id equals)
_NONE: Hashable = object()


def _number(name: str, v: object, *, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (
            positive and v == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class HealthOptions:
    """The thresholds of a :class:`BackendMonitor` (see the module docstring for the rules).

    ``error_window``/``error_rate``: the 5xx rule; ``transport_failures``: transport losses in
    a row; ``backoff``/``max_backoff``: seconds before the first health check of a backend out
    of rotation, doubling to the maximum while checks fail; ``max_pause``: the longest pause a
    429's ``Retry-After`` may ask for (0: a 429 pauses nothing); ``default_pause``: the pause
    after a 429 without one.
    """

    error_window: int = 20
    error_rate: float = 0.5
    transport_failures: int = 3
    backoff: float = 0.25
    max_backoff: float = 2.0
    max_pause: float = 60.0
    default_pause: float = 1.0

    def __post_init__(self) -> None:
        for what in ("error_window", "transport_failures"):
            n = getattr(self, what)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{what} must be an integer >= 1, got {n!r}")
        r = self.error_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"error_rate must be a number in (0, 1], got {r!r}")
        for what in ("backoff", "max_backoff"):
            _number(what, getattr(self, what))
        _number("max_pause", self.max_pause, positive=False)
        _number("default_pause", self.default_pause, positive=False)
        if self.max_backoff < self.backoff:
            raise ValueError(f"max_backoff ({self.max_backoff!r}) must be >= backoff ({self.backoff!r})")


class HealthListener(Protocol):
    """Who a :class:`BackendMonitor` reports to; each call names the backend."""

    def backend_down(self, name: str, reason: str) -> None:
        """The backend left the rotation (``reason`` for logs and stats)."""

    def backend_up(self, name: str) -> None:
        """The backend passed a health check and is back in rotation."""

    def backend_paused(self, name: str, seconds: float) -> None:
        """Send nothing new to the backend for ``seconds`` (a 429, already capped)."""

    def backend_unpaused(self, name: str) -> None:
        """A pause ended: the backend may take requests again."""

    def backend_saturated(self, name: str, saturated: bool) -> None:
        """The saturation probe's verdict changed."""


class ReplyWindow:
    """The last ``size`` replies of a backend as ``(flow, was a 5xx)``, and the error-rate
    rule over them (:meth:`verdict`). O(1) per reply; the verdict is O(size), asked on a 5xx."""

    __slots__ = ("replies", "errors", "error_rate")

    def __init__(self, size: int, error_rate: float) -> None:
        self.replies: deque[tuple[Hashable, bool]] = deque(maxlen=size)
        self.errors = 0  # 5xx among ``replies``
        self.error_rate = error_rate

    def record(self, flow: Hashable, error: bool) -> None:
        """Count one reply of ``flow`` (``error``: it was a 5xx)."""
        replies = self.replies
        if len(replies) == replies.maxlen and replies[0][1]:
            self.errors -= 1
        replies.append((flow, error))
        if error:
            self.errors += 1

    def clear(self) -> None:
        """Forget every reply (the backend is back in rotation)."""
        self.replies.clear()
        self.errors = 0

    def failing_flows(self) -> int:
        """How many flows have a 5xx in the window: 0, 1 or 2 (two or more)."""
        first: Hashable = _NONE
        for f, e in self.replies:
            if e:
                if first is _NONE:
                    first = f
                elif f != first:
                    return 2
        return 0 if first is _NONE else 1

    def verdict(self) -> str | None:
        """Why the recent 5xx say the backend is down, or ``None``."""
        assert self.replies.maxlen is not None
        full = max(1, math.ceil(self.error_rate * self.replies.maxlen - 1e-9))
        if self.errors < min(full, max(1, math.ceil(full / 2))):
            return None
        seen: dict[Hashable, list[int]] = {}
        for f, e in self.replies:
            c = seen.get(f)
            if c is None:
                c = seen[f] = [0, 0]
            c[0] += 1
            c[1] += e
        n, errors = len(self.replies), self.errors
        if len(seen) == 1:
            return f"{errors} of its last {n} replies were 5xx" if errors >= full else None
        top = max(seen, key=lambda f: seen[f][1])
        n -= seen[top][0]
        errors -= seen[top][1]
        if errors >= max(1, math.ceil(full / 2)) and errors >= self.error_rate * n:
            return (f"{errors} of its last {n} replies to other flows than the one failing most were 5xx "
                    f"({self.errors} of {len(self.replies)} in all)")
        return None


class BackendMonitor:
    """The health of one backend (see the module docstring), reported to ``listener``.

    ``clock``: seconds, for the pause's end in :meth:`stats` (default ``time.monotonic``);
    timers and tasks run on the running event loop.
    """

    def __init__(self, backend: Backend, listener: HealthListener, options: HealthOptions | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be an sfq.backends.Backend, got {backend!r}")
        if options is None:
            options = HealthOptions()
        if not isinstance(options, HealthOptions):
            raise TypeError(f"options must be a HealthOptions, got {options!r}")
        self.backend = backend
        self.name = backend.name
        self.listener = listener
        self.options = options
        self.clock = clock
        self.window = ReplyWindow(options.error_window, options.error_rate)
        self.healthy = True
        self.saturated = False
        self.paused = False  # a 429's pause is in force (until its timer ends it)
        self.paused_until = -math.inf  # on ``clock``, for stats
        self.transport_failures = 0  # in a row, with no reply in between
        self.backoff = options.backoff  # before the first check of the next spell out of rotation
        self.completed = 0
        self.errors = 0
        self.rate_limited = 0
        self.unhealthy_spells = 0
        self.last_error: str | None = None
        self.down_reason: str | None = None
        self.check_delay: float | None = None  # seconds to the next check while out of rotation
        self.reading: ProbeReading | None = None
        self.probe_errors = 0
        self._recover: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        #: the flows of the transport failures in a row: the first one, and whether another
        #: one failed too (one flow alone never takes the backend out)
        self._run_flow: Hashable = _NONE
        self._run_flows = 0
        #: the health check run to confirm one flow's failures (``None``: none running)
        self._confirm: asyncio.Task[None] | None = None
        self.confirmations = 0  # checks run to confirm one flow's failures
        self._pause: asyncio.TimerHandle | None = None
        self._closed = False

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the saturation probe (when the backend has one). Needs a running loop."""
        if self._closed:
            raise RuntimeError(f"the monitor of backend {self.name!r} is closed")
        if self.backend.probe is not None and self._probe is None:
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop(), name=f"sfq-probe-{self.name}")

    async def close(self) -> None:
        """Stop the probe, the health checks and the pause timer; report nothing more."""
        self._closed = True
        if self._pause is not None:
            self._pause.cancel()
            self._pause = None
        self.paused = False
        tasks = [t for t in (self._recover, self._probe, self._confirm) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---------------------------------------------------------------- replies
    def replied(self, flow: Hashable, error: BaseException | None, reported: bool = False) -> None:
        """One request of ``flow`` that reached the backend ended: ``error`` ``None`` (a
        reply), a ``BackendError`` (how it failed), or any other exception (a failure in the
        caller's own transport, counted as a transport failure). Requests the caller gave up
        on (cancelled, its own deadline) are not reported. ``reported``: the failure was told
        by an embedder, not seen by the driver (one flow's reports alone never take it out)."""
        if self._closed:
            return
        if error is None:
            self.completed += 1
            self._replied()
            self.backoff = self.options.backoff
            self.window.record(flow, False)
            return
        self.errors += 1
        self.last_error = str(error) or type(error).__name__
        if not isinstance(error, BackendError):
            self._transport_failure(flow, error, reported)
            return
        if isinstance(error, BackendRateLimited) or (isinstance(error, BackendHTTPError) and error.status == 429):
            self.rate_limited += 1
            self._replied()
            self.window.record(flow, False)
            ra = getattr(error, "retry_after", None)
            self.pause(self.options.default_pause if ra is None else float(ra))
            return
        if not error.unhealthy:  # the request's own failure (4xx, an error event, its own total)
            self._replied()
            self.window.record(flow, False)
            return
        if isinstance(error, BackendHTTPError):  # a 5xx: the server answered; counts in the error rate
            self._replied()
            self.window.record(flow, True)
            verdict = self.window.verdict()
            if verdict is not None:
                self._rule_met(f"{verdict} (last: HTTP {error.status})",
                               reported and self.window.failing_flows() <= 1)
            return
        if error.never_sent:  # could not connect at all
            self._run_of(flow)
            self._rule_met(f"cannot connect ({error})", reported and self._run_flows <= 1)
            return
        self._transport_failure(flow, error, reported)

    def _replied(self) -> None:
        """The server answered: the transport failures in a row end."""
        self.transport_failures = 0
        self._run_flow = _NONE
        self._run_flows = 0

    def _run_of(self, flow: Hashable) -> None:
        """Count ``flow`` among the flows of the transport failures in a row."""
        if self._run_flows == 0:
            self._run_flow = flow
            self._run_flows = 1
        elif self._run_flows == 1 and flow != self._run_flow:
            self._run_flows = 2

    def _transport_failure(self, flow: Hashable, error: BaseException, reported: bool) -> None:
        self.transport_failures += 1
        self._run_of(flow)
        if self.transport_failures >= self.options.transport_failures:
            self._rule_met(f"{self.transport_failures} transport failure(s) in a row (last: "
                           f"{type(error).__name__}: {error})", reported and self._run_flows <= 1)

    # ---------------------------------------------------------------- one flow's reports: confirmed
    def _rule_met(self, reason: str, one_flows_word: bool) -> None:
        """A rule says the backend is down (``reason``); ``one_flows_word``: a report met it
        and every failure it counts is one flow's: check the backend first, once; it leaves
        the rotation only if the check fails too."""
        if not one_flows_word:
            self.mark_down(reason)
            return
        if self._closed or not self.healthy or self._confirm is not None:
            return
        self.confirmations += 1
        log.info("sfq: backend %r: %s, all reported by one flow; checking its health before taking it out",
                 self.name, reason)
        self._confirm = asyncio.get_running_loop().create_task(self._confirm_loop(reason),
                                                               name=f"sfq-confirm-{self.name}")

    async def _confirm_loop(self, reason: str) -> None:
        try:
            try:
                ok = await self.backend.check_health()
            except Exception:
                ok = False
        finally:
            self._confirm = None
        if self._closed or not self.healthy:
            return
        if ok:  # the backend answers: one flow's failures are that flow's; counted again from 0
            self.window.clear()
            self._replied()
            log.info("sfq: backend %r passed its health check; it stays in rotation", self.name)
        else:
            self.mark_down(f"{reason}; its health check failed too")

    # ---------------------------------------------------------------- 429: pause
    def pause(self, seconds: float) -> None:
        """Send nothing new for ``seconds`` (capped at ``max_pause``; a longer pause already in
        force is kept)."""
        if self._closed or not (isinstance(seconds, (int, float)) and seconds == seconds):
            return
        delay = min(max(0.0, float(seconds)), self.options.max_pause)
        if delay <= 0:
            return
        until = self.clock() + delay
        if self.paused and until <= self.paused_until:
            return
        self.paused = True
        self.paused_until = until
        if self._pause is not None:
            self._pause.cancel()
        self._pause = asyncio.get_running_loop().call_later(delay, self._unpause)
        log.info("sfq: backend %r answered 429; nothing new is sent there for %.3g s", self.name, delay)
        self.listener.backend_paused(self.name, delay)

    def _unpause(self) -> None:
        self._pause = None
        self.paused = False
        if not self._closed:
            self.listener.backend_unpaused(self.name)

    # ---------------------------------------------------------------- down and back
    def mark_down(self, reason: str) -> None:
        """Take the backend out of rotation and health-check it with backoff until it passes."""
        if not self.healthy or self._closed:
            return
        self.healthy = False
        self.unhealthy_spells += 1
        self.down_reason = reason
        delay = self.backoff
        self.backoff = min(self.backoff * 2, self.options.max_backoff)
        log.warning("sfq: backend %r is out of rotation (%s); health check in %.3g s", self.name, reason, delay)
        if self._recover is None:
            self._recover = asyncio.get_running_loop().create_task(self._recover_loop(delay),
                                                                   name=f"sfq-recover-{self.name}")
        self.listener.backend_down(self.name, reason)

    async def _recover_loop(self, delay: float) -> None:
        try:
            while not self._closed:
                self.check_delay = delay
                await asyncio.sleep(delay)
                try:
                    ok = await self.backend.check_health()
                except Exception:
                    ok = False
                if ok:
                    self._back()
                    return
                delay = min(delay * 2, self.options.max_backoff)
        finally:
            self._recover = None
            self.check_delay = None

    def _back(self) -> None:
        if self._closed:
            return
        self.healthy = True
        self.down_reason = None
        self.window.clear()
        self._replied()
        log.info("sfq: backend %r passed its health check; back in rotation", self.name)
        self.listener.backend_up(self.name)

    # ---------------------------------------------------------------- saturation
    async def _probe_loop(self) -> None:
        probe = self.backend.probe
        assert probe is not None
        while not self._closed:
            try:
                reading: ProbeReading | None = probe.read(await self.backend.fetch_metrics())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.probe_errors += 1
                self.last_error = f"saturation probe: {exc}"
                reading = None  # unknown: fall back to max_in_flight alone
            self.reading = reading
            saturated = reading is not None and reading.saturated
            if saturated != self.saturated and not self._closed:
                self.saturated = saturated
                self.listener.backend_saturated(self.name, saturated)
            await asyncio.sleep(probe.interval)

    # ---------------------------------------------------------------- views
    def stats(self) -> dict[str, object]:
        """``healthy``, ``saturated``, ``paused`` and ``paused_for`` (seconds), ``completed``, ``errors``,
        ``rate_limited`` (429s), ``recent_5xx`` (in the window), ``last_error``, ``down_reason``,
        ``unhealthy_spells``, ``check_interval`` (while out of rotation, else ``None``),
        ``confirmations`` (health checks run because one flow's reports alone met a rule),
        ``probe`` (the last reading as a dict, or ``None``), ``probe_errors``."""
        return {
            "healthy": self.healthy, "saturated": self.saturated,
            "paused": self.paused, "paused_for": max(0.0, self.paused_until - self.clock()) if self.paused else 0.0,
            "completed": self.completed,
            "errors": self.errors, "rate_limited": self.rate_limited, "recent_5xx": self.window.errors,
            "last_error": self.last_error, "down_reason": self.down_reason, "unhealthy_spells": self.unhealthy_spells,
            "check_interval": self.check_delay, "confirmations": self.confirmations,
            "probe": self.reading._asdict() if self.reading is not None else None, "probe_errors": self.probe_errors,
        }
