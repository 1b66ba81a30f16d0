"""The interface of a policy's state as the asyncio dispatcher sees it, and the in-memory one.

A :class:`~sfq.dispatch.PolicyDispatcher` keeps every meter, counter and bucket of its policy
in memory (``sfq.policy.PolicyEngine``). That is the whole state of one gateway, and what
:class:`InMemoryState` stands for: it adds nothing, and the dispatcher skips every call to it
(``shared`` is false), so a gateway without a ``state:`` section pays nothing.

A *shared* state (``shared`` true, :class:`sfq.state.RedisState`) makes several dispatchers
(several ``sfq serve`` processes) behave as one: each one's engine still orders its own
requests, and before a request the engine started locally reaches a backend, the shared
state must grant it (:meth:`SharedState.acquire`): global slots, global buckets, and the
global fair order. Admission (org rates, queue lengths) asks it first too
(:meth:`SharedState.admit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from ..policy.classify import Flow
from ..policy.config import Policy
from ..engine.pool import Request
from ..policy.spend import Hold

__all__ = ["SharedState", "InMemoryState", "Ticket", "local_policy"]

#: a limit the local engine never reaches (the shared state keeps the real one)
_UNLIMITED = 1 << 30


def local_policy(policy: Policy) -> Policy:
    """The policy a gateway's own engine runs when a shared state keeps the limits: the same
    pools, classes, orgs, weights, ages and retries, without the limits the shared state
    applies over every gateway (slots, buckets, org rates, queue lengths). The engine then
    hands every request on at once, in its flow's order, and the shared state's global order
    decides which goes next: a flow's share does not depend on which gateways its requests
    reach, nor on who else uses them."""
    pools = {n: replace(p, limits=replace(p.limits, max_in_flight=None, requests_per_minute=None,
                                          tokens_per_minute=None),
                        backends=tuple(replace(b, max_in_flight=_UNLIMITED) for b in p.backends))
             for n, p in policy.pools.items()}
    classes = {n: replace(c, max_in_flight=_UNLIMITED if c.strict else None, max_queue_length=None)
               for n, c in policy.classes.items()}
    orgs = {n: replace(o, max_in_flight=None, requests_per_minute=None) for n, o in policy.orgs.items()}
    t = policy.org_template
    return replace(policy, pools=MappingProxyType(pools), classes=MappingProxyType(classes),
                   orgs=MappingProxyType(orgs),
                   org_template=None if t is None else replace(t, max_in_flight=None, requests_per_minute=None))


class Ticket:
    """A request admitted by the shared state, before the engine has queued it: ``member`` is
    its name in the shared state."""

    __slots__ = ("member", "flow", "queued", "user", "wait")

    def __init__(self, member: str, flow: Flow, queued: bool, user: tuple[str, str] | None = None,
                 wait: float = 0.0) -> None:
        self.member = member
        self.flow = flow
        self.queued = queued  # holds a waiting place (its class has a max_queue_length)
        self.user = user  # its user's place among its team's live users (max_users): (key, member)
        #: seconds until the org's token it took ahead refills (``on_limit: wait``, over its
        #: org's rate): the request may not join its flow before (0: it may now)
        self.wait = wait


class SharedState:
    """What a :class:`~sfq.dispatch.PolicyDispatcher` asks of a policy state it shares with
    other gateways. Subclasses override everything; ``shared`` false means "in memory:
    skip every call"."""

    #: whether the dispatcher must consult this state (false: the engine alone decides)
    shared: bool = False
    #: called with a request's id when the shared admission gave its waiting place to another
    #: org's request (set by the dispatcher)
    on_evicted: Any = None
    #: the engine's ``CostEstimator`` (set by the dispatcher)
    estimator: Any = None
    #: the engine's price of a started request as its grant would charge it now
    #: (``PolicyQueue.reprice``; set by the dispatcher)
    reprice: Any = None

    async def start(self) -> None:
        """Connect (a store that cannot be reached yet is retried in the background)."""

    async def close(self) -> None:
        """Stop renewing; give back what is still held."""

    @property
    def available(self) -> bool:
        """Whether new requests may be admitted now."""
        return True

    @property
    def reason(self) -> str | None:
        """Why not (``None`` when available); while :attr:`degraded`, why the store is lost."""
        return None

    @property
    def degraded(self) -> bool:
        """The store is lost and this gateway goes on alone, within its slice of every global
        limit (``available`` stays true)."""
        return False

    async def admit(self, flow: Flow, horizon: float | None = None) -> Ticket | None:
        """Admission (org rates, queue lengths): a ticket, or ``Refused`` (``rate_limited``,
        ``queue_full``, ``state_unavailable``). ``horizon``: over its org's rate, the request
        may wait that many seconds for its token (``on_limit: wait``: the time to its deadline,
        queue age or ``max_wait``, ``inf`` for none): when the token refills sooner it is taken
        ahead and the ticket's ``wait`` says when; ``None``: refused at once."""
        return None

    def bind(self, ticket: Ticket | None, r: Request) -> None:
        """The engine accepted the ticket's request as ``r``."""

    def drop(self, ticket: Ticket | None) -> None:
        """The engine refused the ticket's request after all."""

    async def acquire(self, r: Request, backends: Sequence[tuple[str, int]], until: float | None) -> str:
        """Wait for the grant of the start the engine decided for ``r`` (already RUNNING in
        the engine); returns the backend granted (one of ``backends``). Raises
        ``Refused("queue_timeout"|"deadline")`` when ``until`` (on the dispatcher's clock)
        passes first."""
        assert r.backend is not None
        return r.backend

    def reloaded(self, policy: Any) -> None:
        """A reload put ``policy`` in force here (the same ``state`` section)."""

    def refuse_waiting(self) -> None:
        """The dispatcher closes: every :meth:`acquire` still waiting raises ``Refused("closed")``."""

    async def retry_allowed(self, r: Request) -> bool:
        """Whether the retry the engine planned for ``r`` is within its flow's retry budget
        over every gateway (``False``: it ends as failed, reason ``budget``)."""
        return True

    def attempt_over(self, r: Request, actual_tokens: float | None) -> None:
        """A started attempt of ``r`` ended (granted or not): give back what it holds."""

    def charged(self, r: Request, delta: float) -> None:
        """The engine corrected the charge of the running request ``r``'s flow by ``delta``
        cost units (``PolicyQueue.on_charge``): the shared meter moves by as much."""

    def ended(self, r: Request) -> None:
        """``r`` ended (any outcome): forget it."""

    async def reserve_spend(self, hold: Hold, budgets: Sequence[tuple[str, str, float]], keep: float) -> list[int]:
        """Reserve ``hold.amount`` in every budget of ``budgets`` over every gateway, or in
        none: ``(account, period key, limit)``, the account an org (its own budget) or
        ``org<TAB>team`` (a team's); ``keep``: seconds the periods' records must live. Returns
        the indexes of the budgets that cannot cover it (empty: reserved in all)."""
        return []

    def settle_spend(self, hold: Hold, actual: float) -> None:
        """The request of ``hold`` ended having spent ``actual`` (currency)."""

    def decider(self, pool: str) -> Any:
        """The queue whose meters decide the fleet's order of ``pool`` when this gateway holds
        it (several gateways: one decides for all, docs/design.md §5a.1); ``None`` otherwise
        (one gateway: its engine's own queue decides)."""
        return None

    def stats(self) -> dict[str, Any]:
        return {"kind": "memory"}


class InMemoryState(SharedState):
    """Today's single gateway: the engine's own memory is the whole state."""

    shared = False
