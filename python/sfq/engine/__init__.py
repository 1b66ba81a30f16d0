"""The request engine: one synchronous state machine per gateway, on an injected clock.

It is told what happened (a request arrived, started, delivered tokens, finished with usage,
failed, was cancelled; a backend went up, down or was paused; the clock moved) and answers
what to do next (start this request on that backend; end that one with this reason; call
again at time t). It does no I/O: the gateway (``sfq serve``), the library's dispatchers and
the simulator drive it. See ``docs/design.md`` for the rules it applies.
"""

from __future__ import annotations

from .engine import NO_METRICS, UNKNOWN, NoMetrics, PolicyEngine
from .pool import BACKOFF, ENDED, RUNNING, WAITING, PolicyQueue, Request, SharedLimits

__all__ = ["BACKOFF", "ENDED", "NO_METRICS", "RUNNING", "UNKNOWN", "WAITING", "NoMetrics", "PolicyEngine",
           "PolicyQueue", "Request", "SharedLimits"]
