"""Where a policy keeps its state: in memory (one gateway, the default) or in Redis, shared by
several gateways (``sfq serve`` replicas, or embedders' ``PolicyDispatcher`` s) that then
behave as one: global limits, buckets and fair order (``docs/API.md``, "Several gateways,
one queue"). :func:`state_for` picks the one a policy's ``state:`` section asks for."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .base import InMemoryState, SharedState, Ticket, local_policy

if TYPE_CHECKING:
    from ..policy.config import Policy
    from .redis_state import RedisState

__all__ = ["InMemoryState", "RedisState", "SharedState", "Ticket", "local_policy", "state_for"]


def state_for(policy: Policy, *, clock: Callable[[], float] | None = None, **options: Any) -> SharedState:
    """The state the policy's ``state:`` section asks for: :class:`RedisState` (needs the
    ``redis`` extra: ``pip install 'sfq[redis]'``) or, without the section,
    :class:`InMemoryState`. ``options`` go to ``RedisState``."""
    if policy.state is None or policy.state.redis is None:  # (a state file is the engine's own spend ledger)
        return InMemoryState()
    try:
        from .redis_state import RedisState
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError(f"the policy's state: section needs the redis package ({exc}); "
                          "install it with: pip install 'sfq[redis]'") from None
    if clock is not None:
        options["clock"] = clock
    return RedisState(policy.state, policy, **options)


def __getattr__(name: str) -> Any:
    if name == "RedisState":
        from .redis_state import RedisState

        return RedisState
    raise AttributeError(f"module 'sfq.state' has no attribute {name!r}")
