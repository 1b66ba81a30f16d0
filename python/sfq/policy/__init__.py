"""The multi-team policy layer: who the neighbours are, what each may use, and what happens
under overload.

A trusted policy file (YAML, :func:`load_policy`) names the pools, the workload classes and
the organisations; a flow is ``(org, class, pool)`` with weight org x class. These are the
rules and the model types: the request engine (``sfq.engine``) applies them, and the drivers
(``sfq.PolicyDispatcher``, ``sfq serve``, the simulator) sit above it. See ``docs/policy.md``.
"""

from __future__ import annotations

from .classify import Classifier, Flow
from .config import (
    BackendSpec,
    ClassSpec,
    CostSpec,
    MetricsSpec,
    OrgSpec,
    Policy,
    PoolLimits,
    PoolSpec,
    RetrySpec,
    ServerSpec,
    StateSpec,
    load_policy,
    parse_policy,
    policy_from_mapping,
)
from .limits import Slots, TokenBucket
from .metrics import OUTCOMES, REASONS, PolicyMetrics
from .retry import IdempotencyIndex, RetryDecision, RetryPlanner, retry_after_of, retry_safe

__all__ = [
    "OUTCOMES",
    "REASONS",
    "BackendSpec",
    "Classifier",
    "ClassSpec",
    "CostSpec",
    "Flow",
    "IdempotencyIndex",
    "MetricsSpec",
    "OrgSpec",
    "Policy",
    "PolicyMetrics",
    "PoolLimits",
    "PoolSpec",
    "RetryDecision",
    "RetryPlanner",
    "RetrySpec",
    "Slots",
    "ServerSpec",
    "StateSpec",
    "TokenBucket",
    "load_policy",
    "parse_policy",
    "policy_from_mapping",
    "retry_after_of",
    "retry_safe",
]
