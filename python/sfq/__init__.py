"""sfq: Start-time Fair Queueing for shared LLM-serving fleets."""

from __future__ import annotations

from ._common import MAX_COST, MAX_WEIGHT, MIN_WEIGHT, SCALE
from ._core import CORE, Dispatch, ReferenceDispatch, ReferenceScheduler, Scheduler
from .errors import SFQError

__version__ = "0.1.0"

__all__ = [
    "CORE",
    "Dispatch",
    "MAX_COST",
    "MAX_WEIGHT",
    "MIN_WEIGHT",
    "ReferenceDispatch",
    "ReferenceScheduler",
    "SCALE",
    "SFQError",
    "Scheduler",
    "__version__",
]
