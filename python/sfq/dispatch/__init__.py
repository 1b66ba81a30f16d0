"""The asyncio driver: sfq's request engine in front of a fleet of inference servers.

A request travels one way: policy -> estimator -> engine (scheduler) -> driver -> backend.
The request engine (:mod:`sfq.engine`, no I/O) decides who the flow is, every limit, whose
request goes next and on which backend, what it is charged and how the charge is settled,
retries and deadlines. One asyncio driver carries its answers out
(:class:`PolicyDispatcher`, in ``policy_dispatcher``; what it hands out for one request, the
``Grant`` of ``acquire`` and the ``EventStream`` of ``open_stream``/``stream``, in
``policy_calls``; the ``Permit`` that waits for a grant, in ``permit``), for ``sfq serve``
and for embedders alike.

:class:`Dispatcher` is that driver's face for a fleet without a policy file (``dispatcher``):
the policy its fleet makes (one pool per model, one class, each flow id its own org), the
caller's flow ids and bounded per-flow statistics. Both faces share every primitive:
``submit``, ``stream``, ``acquire``, ``open_stream``; ``timeout`` is the request's deadline
from the call; errors are :class:`sfq.SFQError` s.

=====================  ==============================================================
``policy_dispatcher``  the driver: the pump, admission, the turn, retries, endings, close
``policy_calls``       ``Grant`` (``acquire``), the ``EventStream`` of a stream
``permit``             ``Permit``: waits for a grant (``acquire``)
``dispatcher``         ``Dispatcher``: the fleet's policy, flow ids
``tally``              ``FlowTally``: a ``Dispatcher``'s per-flow statistics
``stream``             ``EventStream``: the protocol every stream offers
``_wake``              the one timer that wakes the pump when the engine asks
=====================  ==============================================================
"""

from __future__ import annotations

from .dispatcher import Dispatcher, DispatchRecord
from .policy_dispatcher import PolicyDispatcher

__all__ = ["Dispatcher", "DispatchRecord", "PolicyDispatcher"]
