"""The one timer a driver keeps for its engine: "call me again at t" (``PolicyEngine.wake_at``)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

__all__ = ["WakeTimer"]


class WakeTimer:
    """Calls ``pump`` at the earliest time it was armed for (``clock`` seconds), once; arming it
    for a later time than one already set changes nothing."""

    __slots__ = ("_pump", "_clock", "_handle", "_at")

    def __init__(self, pump: Callable[[], None], clock: Callable[[], float]) -> None:
        self._pump = pump
        self._clock = clock
        self._handle: asyncio.TimerHandle | None = None
        self._at = math.inf  # clock seconds of the call set (inf: none)

    def arm(self, at: float | None) -> None:
        if at is None or (self._handle is not None and self._at <= at):
            return
        if self._handle is not None:
            self._handle.cancel()
        self._at = at
        delay = max(0.0, at - self._clock()) + 1e-4
        self._handle = asyncio.get_running_loop().call_later(delay, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._at = math.inf

    def _fire(self) -> None:
        self._handle = None
        self._at = math.inf
        self._pump()
