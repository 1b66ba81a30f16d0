"""``DispatchHooks``: the seam through which a policy layer makes per-pool decisions.

The dispatcher's pump asks ``select`` whose request goes next each time a backend of a pool
has room and the pool has waiting requests; ``sent`` and ``ended`` bracket every request that
reached a backend (exactly one ``ended`` per ``sent``). The hooks run synchronously on the
event loop, inside the pump: keep them short, never block, never await.

What a policy does with them (examples):

* concurrency limits per org or class: count in ``sent``/``ended``; when a flow reaches its
  limit, ``sched.suspend(flow)`` (it leaves the competition without banking credit) and
  ``sched.resume(flow)`` in ``ended`` when it drops below, then ``Dispatcher.wake(model)``;
* rate limits: ``select`` returns ``None`` while the pool's bucket is empty, and the policy
  calls ``Dispatcher.wake(model)`` when it refills;
* strict classes first: ``select`` looks at ``sched.peek()`` (or at a second scheduler of
  its own) before calling ``sched.dispatch()``.

The pump calls ``select`` only when the request ``sched.peek()`` names fits a backend with
room, and reports the work (``sched.work_started``) just before: a ``select`` that returns that
request (``sched.dispatch()``) is always placed at once. With ``overtake > 0`` the dispatcher
itself suspends the flow of a request that waits aside and resumes it when it fits: a policy
that suspends flows too should not suspend those (``Dispatcher.stats()``: ``held``).

The request's path stays one-way: the hooks only decide *whether* and *whose*; the request
itself is always taken from the pool's scheduler (``sched.dispatch()``) and placed by the
dispatcher.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import BackendError
from ._state import DispatchRecord

__all__ = ["DispatchHooks"]


class DispatchHooks:
    """Default hooks: plain SFQ order, no limits. Subclass and override what you need.

    A hook that raises is logged and treated as its default (``select``: nothing is
    dispatched until the next ``wake``/arrival/completion); the request in hand is not lost.
    """

    def select(self, model: str | None, sched: Any) -> Any:
        """Take the next request of pool ``model`` from ``sched`` (the pool's scheduler): return
        ``sched.dispatch()``'s ``Dispatch``, or ``None`` to dispatch nothing now.

        Called only when a backend of the pool has room for the request ``sched.peek()`` names. The returned
        ``Dispatch`` must come from this ``sched.dispatch()`` call (its ``item`` is the
        dispatcher's own record of the request). After a ``None``, the pool is pumped again at
        the next arrival, completion, recovery, or ``Dispatcher.wake(model)``.
        """
        return sched.dispatch()

    def sent(self, record: DispatchRecord) -> None:
        """A request was sent to ``record.backend`` (its charge at dispatch is ``record.cost``;
        ``settle``/``served`` correct it later)."""

    def ended(self, record: DispatchRecord, outcome: str, error: BackendError | None,
              usage: Mapping[str, Any] | None) -> None:
        """A request that was ``sent`` is over: ``outcome`` is ``"completed"`` (``usage`` is the
        server's report when it sent one), ``"failed"`` (``error``) or ``"aborted"`` (its caller
        gave up, or the dispatcher closed). Its slot is already free."""
