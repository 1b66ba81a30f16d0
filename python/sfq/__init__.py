"""sfq: Start-time Fair Queueing for shared LLM-serving fleets.

The names here are the whole public face; everything else lives in its subpackage
(``sfq.errors``, ``sfq.backends``, ``sfq.policy``, ``sfq.engine``, ``sfq.state``, ...).

* the scheduler core: ``Scheduler`` (compiled), ``ReferenceScheduler`` (its pure-Python twin),
  ``Dispatch`` (what they hand out), ``CORE``, and its limits ``MAX_COST``, ``MIN_WEIGHT``,
  ``MAX_WEIGHT``;
* in front of a fleet: ``Dispatcher`` (flows are your ids), ``PolicyDispatcher`` (flows are
  ``Flow(org, cls, pool)`` under a policy file: ``load_policy``, ``parse_policy``), the
  ``Grant`` of a turn (``acquire``), the ``EventStream`` a stream is, the ``CostEstimator``
  and the ``OpenAIBackend``;
* errors: ``SFQError`` (every error has ``http_status``, ``retry_after`` and ``to_openai()``)
  and the ones a caller catches by name: ``Refused``, ``BackendError``, ``DeadlineExceeded``,
  ``PolicyError``; the rest are in ``sfq.errors``.

The scheduler core imports nothing heavy; the rest is loaded on first use, so embedding only
the core does not import aiohttp.
"""

import importlib as _importlib
import typing as _typing
import warnings as _warnings

from . import _compiled

_compiled.install()  # the engine's compiled modules, or their source (SFQ_NO_EXTENSIONS=1, a stale build)

from ._common import MAX_COST, MAX_WEIGHT, MIN_WEIGHT
from ._core import CORE, Dispatch, Scheduler
from .errors import BackendError, DeadlineExceeded, PolicyError, Refused, SFQError

__version__ = "0.1.0"

if _typing.TYPE_CHECKING:  # what the lazy names below are, for type checkers (tests/test_types.py keeps them in step)
    from ._scheduler_py import ReferenceScheduler
    from .backends import OpenAIBackend
    from .cost import CostEstimator
    from .dispatch import Dispatcher, PolicyDispatcher
    from .dispatch.stream import EventStream
    from .dispatch.policy_dispatcher import Grant
    from .policy import load_policy, parse_policy
    from .policy.classify import Flow

_LAZY = {
    "ReferenceScheduler": "._scheduler_py",  # the pure-Python twin (with the compiled core: on first use)
    "OpenAIBackend": ".backends",
    "CostEstimator": ".cost",
    "Dispatcher": ".dispatch",
    "PolicyDispatcher": ".dispatch",
    "EventStream": ".dispatch.stream",
    "Grant": ".dispatch.policy_dispatcher",
    "load_policy": ".policy",
    "parse_policy": ".policy",
    "Flow": ".policy.classify",
}

#: names the top level used to have, and where they live now (one release of warnings)
_MOVED = {
    "SCALE": "sfq._common",
    "DispatchBatch": "sfq._common",
    "ReferenceDispatch": "sfq._scheduler_py",
    "Backend": "sfq.backends",
    "ProbeReading": "sfq.backends",
    "SaturationProbe": "sfq.backends",
    "Estimate": "sfq.cost",
    "DispatchRecord": "sfq.dispatch",
    "PolicyEngine": "sfq.engine",
    "Policy": "sfq.policy",
    "BackendHTTPError": "sfq.errors",
    "BackendRateLimited": "sfq.errors",
    "BackendTimeout": "sfq.errors",
    "BackendUnavailable": "sfq.errors",
    "DispatcherClosed": "sfq.errors",
    "NoHealthyBackend": "sfq.errors",
    "RequestTooLarge": "sfq.errors",
    "StreamInterrupted": "sfq.errors",
    "UnknownModel": "sfq.errors",
}


def __getattr__(name: str) -> _typing.Any:
    mod = _LAZY.get(name)
    if mod is not None:
        value = getattr(_importlib.import_module(mod, __name__), name)
        globals()[name] = value
        return value
    moved = _MOVED.get(name)
    if moved is not None:  # not cached: every use warns, and the module's own names stay __all__
        _warnings.warn(f"sfq.{name} is {moved}.{name}; the top-level name will be removed", DeprecationWarning,
                       stacklevel=2)
        return getattr(_importlib.import_module(moved), name)
    raise AttributeError(f"module 'sfq' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "CORE",
    "MAX_COST",
    "MAX_WEIGHT",
    "MIN_WEIGHT",
    "BackendError",
    "CostEstimator",
    "DeadlineExceeded",
    "Dispatch",
    "Dispatcher",
    "EventStream",
    "Flow",
    "Grant",
    "OpenAIBackend",
    "PolicyDispatcher",
    "PolicyError",
    "ReferenceScheduler",
    "Refused",
    "SFQError",
    "Scheduler",
    "__version__",
    "load_policy",
    "parse_policy",
]
