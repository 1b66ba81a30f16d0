"""The multi-team policy layer: who the neighbours are, what each may use, and what happens
under overload.

A trusted policy file (YAML, :func:`load_policy`) names the pools, the workload classes and
the organisations; a flow is ``(org, class, pool)`` with weight org x class. The pieces are
plain, synchronous and clock-injected (:class:`PolicyEngine`, :class:`PolicyQueue`, the
token buckets, the retry planner), so the same code runs under the asyncio
:class:`PolicyDispatcher`, in the simulator and in tests. See ``docs/policy.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .classify import Classifier, Flow
from .config import (
    BackendSpec,
    ClassSpec,
    CostSpec,
    OrgSpec,
    Policy,
    PoolLimits,
    PoolSpec,
    RetrySpec,
    StateSpec,
    load_policy,
    parse_policy,
    policy_from_mapping,
)
from .engine import PolicyEngine
from .limits import Slots, TokenBucket
from .metrics import OUTCOMES, REASONS, PolicyMetrics
from .queue import PolicyQueue, Request
from .retry import IdempotencyIndex, RetryDecision, RetryPlanner, retry_after_of, retry_safe

if TYPE_CHECKING:  # loaded lazily below; type checkers see the class
    from .dispatcher import PolicyDispatcher


def __getattr__(name: str) -> Any:
    # the asyncio layer (aiohttp, the dispatcher) loads on first use: check-config and the
    # simulator do not need it
    if name == "PolicyDispatcher":
        from .dispatcher import PolicyDispatcher

        return PolicyDispatcher
    raise AttributeError(f"module 'sfq.policy' has no attribute {name!r}")


__all__ = [
    "OUTCOMES",
    "REASONS",
    "BackendSpec",
    "Classifier",
    "ClassSpec",
    "CostSpec",
    "Flow",
    "IdempotencyIndex",
    "OrgSpec",
    "Policy",
    "PolicyDispatcher",
    "PolicyEngine",
    "PolicyMetrics",
    "PolicyQueue",
    "PoolLimits",
    "PoolSpec",
    "Request",
    "RetryDecision",
    "RetryPlanner",
    "RetrySpec",
    "Slots",
    "StateSpec",
    "TokenBucket",
    "load_policy",
    "parse_policy",
    "policy_from_mapping",
    "retry_after_of",
    "retry_safe",
]
