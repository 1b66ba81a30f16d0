"""The asyncio dispatch adapter: sfq in front of a fleet of inference servers.

A request travels one way: policy -> estimator -> scheduler -> dispatcher -> backend.

* **cost** - each request is estimated when it arrives (``CostEstimator``: to route it and
  check its size) and enqueued at a lower bound of its cost (its prompt's); it is estimated
  again, and charged, when it is dispatched (the calibration may have learned in between; SFQ
  selects by the flows' meters, not by the cost of their heads, so the lower bound changes no
  order and the meter is corrected with the core's ``adjust`` right after ``dispatch``);
* **ordering** - one scheduler (``sfq.Scheduler``) per *pool*, the backends that serve the same
  model; it decides only whose request goes next;
* **placement** - the dispatched request goes to the least-loaded healthy backend of its pool
  that has room (``max_in_flight``; not saturated according to its probe; big enough for the
  request when backends declare ``max_context``).

The loop is event-driven: on every arrival and every completion (and when a backend recovers
or stops being saturated) the pool dispatches one request at a time while a backend has room.
It **looks before it pops**: the request the scheduler names next (``peek()``) is dispatched,
and charged, only when a backend with room can take it. One that fits none (``max_context``)
waits aside, *uncharged* ("held"): by default everything **stalls** behind it, so the meters
alone explain every decision; ``overtake=k`` lets later selections go out while up to ``k``
such requests wait aside: their flows are suspended in the scheduler (their requests keep
waiting, uncharged) and resumed when a backend that fits has room, rejoining at
``max(S, v)``, so nothing is banked while they waited.

**Charge modes** (``Dispatcher(charge=...)``):

* ``"served"`` (default): a stream is charged its prompt at dispatch and its output tokens as
  the stream delivers them (the server's running ``usage`` when it reports one, else each
  event's text through the estimator's characters per token, at least one token per event),
  reconciled with the final usage report at completion; a non-streamed request is charged its
  estimate at dispatch and settled from ``usage`` at completion. This is the virtual token
  counter (Sheng et al., OSDI 2024) kept at the balancer, without touching the engine.
* ``"settle"``: the estimate at dispatch, corrected to the usage report at completion.
* ``"seed"``: the estimate at dispatch, never corrected (docs/design.md §2-§4).

A request that fails or is cancelled after dispatch keeps what it was charged: the estimate
(``seed``, ``settle``, a non-streamed request in ``served``), or its prompt and the tokens
delivered before it ended (a stream in ``served``). A request whose ``cost=`` the caller gives
is charged that, never re-estimated or corrected. Usage reports are clamped as the
estimator's calibration clamps them (``CostEstimator.actual_cost``).

**The busy period stays open while the fleet works**: every request that reaches a backend is
reported to the scheduler, ``work_started(flow)`` just before its ``dispatch()`` (so taking
the last waiting request does not close the busy period) and ``work_done(flow)`` when it ends,
whatever the outcome (``seed``: without the flow). The idle rule then fires when the *system*
is idle, and in ``settle``/``served`` a flow whose request still runs keeps its meter, lag
included, when its next request arrives.

Every accepted request ends as exactly one of: completed, failed (an
``sfq.errors.BackendError``), cancelled (before or after dispatch) or rejected
(``DispatcherClosed`` when the dispatcher closes before it was placed).

Time: waits are measured with the injected ``clock`` (seconds, default ``time.monotonic``).

Modules, one job each (``Dispatcher`` combines them as mixins over ``_state.DispatcherBase``):

==============  ==================================================================
``admission``   validate, estimate, route to a pool, enqueue; withdraw on cancel
``placement``   the pump: select (via the hooks), place on a backend, send, finish
``health``      take failing backends out, health-check them back, saturation probes
``stats``       per-flow counters (bounded) and the ``stats()`` snapshot
``calls``       ``submit`` and ``stream``: the backend call, exactly one outcome
``lifecycle``   ``start`` and ``close`` (reject, drain within ``close_grace``, close)
``hooks``       ``DispatchHooks``: the seam for a policy layer
==============  ==================================================================

Seams for a policy layer (stable):

* ``Dispatcher(..., hooks=DispatchHooks subclass)``: ``select(model, sched)`` decides whose
  request goes next in a pool, or that none may go now (rate limits, pool-wide limits,
  strict classes via ``sched.peek()``); it is asked only when the request ``peek()`` names
  can be placed (a request a hook dispatches instead that fits nowhere waits aside, charged,
  and nothing passes it); ``sent(record)`` / ``ended(record, outcome, error,
  usage)`` bracket every request that reached a backend (per-org/per-class concurrency,
  token-bucket corrections, per-flow error accounting).
* ``Dispatcher.scheduler_of(model)``: the pool's scheduler, for ``suspend``/``resume`` of a
  flow held back by its own limit (it leaves the competition without banking credit).
* ``Dispatcher.wake(*models)``: pump again after a limit freed outside a completion.
* ``Dispatcher(..., on_dispatch=...)``: a read-only callback per send (``DispatchRecord``).

The policy layer sits above ``submit``/``stream`` for admission (refusals, deadlines, retries
back into the flow): the dispatcher never retries a request by itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._state import DispatchRecord
from .dispatcher import Dispatcher

if TYPE_CHECKING:
    from .policy_dispatcher import PolicyDispatcher


def __getattr__(name: str) -> Any:
    # the policy's driver (prometheus-client, the shared state) loads on first use
    if name == "PolicyDispatcher":
        from .policy_dispatcher import PolicyDispatcher

        return PolicyDispatcher
    raise AttributeError(f"module 'sfq.dispatch' has no attribute {name!r}")


__all__ = ["Dispatcher", "DispatchRecord", "PolicyDispatcher"]
