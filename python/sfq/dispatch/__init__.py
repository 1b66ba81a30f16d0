"""The asyncio dispatch adapter: sfq in front of a fleet of inference servers.

A request travels one way: policy -> estimator -> scheduler -> dispatcher -> backend.

* **cost** - each request's cost is estimated when it arrives (``CostEstimator``) and charged,
  unchanged, when it is dispatched;
* **ordering** - one scheduler (``sfq.Scheduler``) per *pool*, the backends that serve the same
  model; it decides only whose request goes next;
* **placement** - the dispatched request goes to the least-loaded healthy backend of its pool
  that has room (``max_in_flight``; not saturated according to its probe; big enough for the
  request when backends declare ``max_context``).

The loop is event-driven: on every arrival and every completion (and when a backend recovers
or stops being saturated) the pool dispatches one request at a time while a backend has room.
If the selected request fits on no backend with room (``max_context``), the default is to
**stall**: it waits aside, charged and first in line, and nothing else is dispatched until it
is placed, so the meters alone explain every decision. ``overtake=k`` lets later selections
go out while up to ``k`` such requests wait aside.

Meters change only at dispatch. Completions feed the estimator's calibration and the
statistics; failures and cancellations after dispatch only the statistics. A caller that
gives up (its task is cancelled) before dispatch leaves the queue uncharged; after dispatch
the backend call is aborted (the connection closes, the server stops generating). Every
accepted request ends as exactly one of: completed, failed (an ``sfq.errors.BackendError``),
cancelled (before or after dispatch) or rejected (``DispatcherClosed`` when the dispatcher
closes before it was placed).

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
  strict classes via ``sched.peek()``); ``sent(record)`` / ``ended(record, outcome, error,
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

from ._state import DispatchRecord
from .dispatcher import Dispatcher
from .hooks import DispatchHooks

__all__ = ["Dispatcher", "DispatchHooks", "DispatchRecord"]
