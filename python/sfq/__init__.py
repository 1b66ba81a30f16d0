"""sfq: Start-time Fair Queueing for shared LLM-serving fleets.

The scheduler core (``Scheduler``, ``ReferenceScheduler``) imports nothing heavy; the
dispatch layer (``Dispatcher``, ``OpenAIBackend``, ``CostEstimator``, ...) is loaded on
first use, so embedding only the core does not import aiohttp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._common import MAX_COST, MAX_WEIGHT, MIN_WEIGHT, SCALE, DispatchBatch
from ._core import CORE, Dispatch, Scheduler
from .errors import (
    BackendError,
    BackendHTTPError,
    BackendRateLimited,
    BackendTimeout,
    BackendUnavailable,
    DeadlineExceeded,
    DispatcherClosed,
    NoHealthyBackend,
    PolicyError,
    Refused,
    RequestTooLarge,
    SFQError,
    StreamInterrupted,
    UnknownModel,
)

__version__ = "0.1.0"

if TYPE_CHECKING:  # what the lazy names below are, for type checkers (tests/test_types.py keeps them in step)
    from .backends import Backend, OpenAIBackend, ProbeReading, SaturationProbe
    from .cost import CostEstimator, Estimate
    from .dispatch import Dispatcher, DispatchRecord
    from .dispatch import PolicyDispatcher
    from .engine import PolicyEngine
    from .policy import Policy, load_policy, parse_policy
    from ._scheduler_py import ReferenceDispatch, ReferenceScheduler

_LAZY = {
    "ReferenceDispatch": "._scheduler_py",  # the pure-Python twin (with the compiled core: on first use)
    "ReferenceScheduler": "._scheduler_py",
    "Backend": ".backends",
    "OpenAIBackend": ".backends",
    "ProbeReading": ".backends",
    "SaturationProbe": ".backends",
    "CostEstimator": ".cost",
    "Estimate": ".cost",
    "Dispatcher": ".dispatch",
    "DispatchRecord": ".dispatch",
    "Policy": ".policy",
    "PolicyDispatcher": ".dispatch",
    "PolicyEngine": ".engine",
    "load_policy": ".policy",
    "parse_policy": ".policy",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'sfq' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "CORE",
    "MAX_COST",
    "MAX_WEIGHT",
    "MIN_WEIGHT",
    "SCALE",
    "Backend",
    "BackendError",
    "BackendHTTPError",
    "BackendRateLimited",
    "BackendTimeout",
    "BackendUnavailable",
    "CostEstimator",
    "DeadlineExceeded",
    "Dispatch",
    "DispatchBatch",
    "DispatchRecord",
    "Dispatcher",
    "DispatcherClosed",
    "Estimate",
    "NoHealthyBackend",
    "OpenAIBackend",
    "Policy",
    "PolicyDispatcher",
    "PolicyEngine",
    "PolicyError",
    "ProbeReading",
    "ReferenceDispatch",
    "ReferenceScheduler",
    "Refused",
    "RequestTooLarge",
    "SFQError",
    "SaturationProbe",
    "Scheduler",
    "StreamInterrupted",
    "UnknownModel",
    "__version__",
    "load_policy",
    "parse_policy",
]
