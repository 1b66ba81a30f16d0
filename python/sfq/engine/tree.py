"""Nested shares: hierarchical SFQ, one core scheduler per inner node of a tree.

A pool's weighted flows are the leaves of a tree (docs/design.md, "Nested shares"):

    root   one entry per (org, class): weight org x class, as in a flat file
     └ org/class node   (an org with teams)  one entry per team: weight the team's
        └ team node     (users: equal)        one entry per live user: weight 1

An org without teams or users is a leaf at the root, exactly as without this module. Each
inner node is a core scheduler (``sfq.Scheduler``: the compiled core or its twin, by the
selector) that holds one entry per backlogged child; a node competes at its parent while one
of its children competes in it (it joins with ``S = max(S, v)`` at its parent, like any flow,
so nothing is banked while it was idle). A dispatch walks down from the root by smallest
start tag, charges every level its own ``cost / weight`` (the node's entry at its parent is
corrected to the leaf's charge, ``adjust``), and every correction of a charge after it
(delivered tokens, settlement) and every report of work in flight goes up the whole path.
This is Goyal, Guo and Vin's hierarchical SFQ (OSDI 1996) on the core's own rules.

:class:`TreeScheduler` offers :class:`~sfq.engine.pool.PolicyQueue` the part of the core's
interface it uses, with the leaf flows as keys; a queue uses it only when its policy nests
(``Policy.nested``), so a flat policy keeps its one scheduler and its speed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from ..policy.classify import Flow
from ..policy.config import Policy

__all__ = ["TreeScheduler"]


class Dispatched(NamedTuple):
    """A dispatch of the tree, as the core's ``Dispatch`` reads: the leaf's ``flow``, ``item``
    and ``cost``, the tree's ``ticket``, the ``start`` and ``finish`` tags at the root."""

    flow: Hashable
    item: Any
    cost: float
    ticket: int
    start: float
    finish: float


class _Node:
    """An inner node: its own scheduler over its children, and its one entry at its parent."""

    __slots__ = ("sched", "parent", "key", "token", "token_cost")

    def __init__(self, sched: Any, parent: _Node | None, key: Hashable) -> None:
        self.sched = sched
        self.parent = parent
        self.key = key  # its id in its parent's scheduler
        self.token: int | None = None  # its entry's ticket at its parent (None: not competing there)
        self.token_cost = 0.0  # the cost that entry was enqueued with


class TreeScheduler:
    """The pool's tree of schedulers (module doc). ``make`` builds a core scheduler (default
    ``sfq.Scheduler``). Not thread-safe, like the queue that owns it."""

    def __init__(self, policy: Policy, make: Callable[[], Any]) -> None:
        self.policy = policy
        self._make = make
        self.root = _Node(make(), None, None)
        self._nodes: dict[tuple[Any, ...], _Node] = {}  # (flat flow[, team]) -> node
        self._paths: dict[Flow, tuple[tuple[_Node, Hashable], ...]] = {}  # leaf -> (node, key) up to the root
        self._tickets: dict[int, tuple[_Node, int]] = {}  # our ticket -> (node, its scheduler's ticket)
        self._rev: dict[tuple[int, int], int] = {}  # (id(node), its scheduler's ticket) -> our ticket
        self._ids = itertools.count(1)

    # ------------------------------------------------------------ the tree's shape
    def _node(self, where: tuple[Any, ...], parent: _Node, key: Hashable, weight: float) -> _Node:
        n = self._nodes.get(where)
        if n is None:
            n = self._nodes[where] = _Node(self._make(), parent, key)
            if weight != 1.0:
                parent.sched.set_weight(key, weight)
        return n

    def path(self, f: Flow, keep: bool = True) -> tuple[tuple[_Node, Hashable], ...]:
        """``((node, key), ...)``: where leaf ``f`` competes, then where each of its ancestors
        does, up to the root. ``keep=False``: not remembered (a leaf whose queue the pool
        dropped, reporting its work's end or its settlement)."""
        p = self._paths.get(f)
        if p is not None:
            return p
        if len(f) == 3:
            p = ((self.root, f),)
        else:
            flat = f.flat
            org = self.policy.org(f.org)
            assert org is not None, f
            top = self._node((flat,), self.root, flat, self.policy.flow_weight(f.org, f.cls))
            if f.team is None:  # users inside the org
                p = ((top, f.user), (self.root, flat))
            else:
                team = org.teams[f.team]
                if f.user is None:  # (the team is the leaf: its weight is told to the org's node)
                    if team.weight != 1.0:
                        top.sched.set_weight(f.team, team.weight)
                    p = ((top, f.team), (self.root, flat))
                else:
                    mid = self._node((flat, f.team), top, f.team, team.weight)
                    p = ((mid, f.user), (top, f.team), (self.root, flat))
        if keep:
            self._paths[f] = p
        return p

    def release(self, f: Flow) -> None:
        """Forget the path of leaf ``f`` (the pool dropped its empty queue). Its entry in its
        node's scheduler is left to the core, which forgets an idle flow once ``v`` passes its
        meter; a leaf that comes back before rejoins with ``S = max(S, v)``, one that comes back
        after starts at ``v``: the same (docs/design.md, "Nested shares"). The inner nodes (one
        per org, class and team of the file) stay."""
        self._paths.pop(f, None)

    def _sync(self, n: _Node) -> None:
        """Make ``n``'s entry at its parent (and so on up) say whether a child competes in it."""
        while n.parent is not None:
            active = n.sched.waiting_flows > 0
            if active == (n.token is not None):
                return
            parent = n.parent
            if active:
                head = n.sched.peek()
                n.token_cost = head.cost
                n.token = parent.sched.enqueue(n.key, head.cost, n)
            else:
                parent.sched.cancel(n.token)
                n.token = None
            n = parent

    # ------------------------------------------------------------ the core's interface (leaf flows)
    @property
    def virtual_time(self) -> float:
        return float(self.root.sched.virtual_time)

    @property
    def waiting_flows(self) -> int:
        return int(self.root.sched.waiting_flows)

    def __len__(self) -> int:
        return len(self._tickets)

    def enqueue(self, flow: Flow, cost: float, item: Any = None) -> int:
        n, key = self.path(flow)[0]
        t = n.sched.enqueue(key, cost, item)
        tid = next(self._ids)
        self._tickets[tid] = (n, t)
        self._rev[(id(n), t)] = tid
        self._sync(n)
        return tid

    def cancel(self, ticket: int) -> bool:
        got = self._tickets.pop(ticket, None)
        if got is None:
            return False
        n, t = got
        del self._rev[(id(n), t)]
        ok = bool(n.sched.cancel(t))
        self._sync(n)
        return ok

    def peek(self) -> Any:
        d = self.root.sched.peek()
        while d is not None and isinstance(d.item, _Node):
            d = d.item.sched.peek()
        return d

    def dispatch(self) -> Dispatched | None:
        """The leaf the walk from the root by smallest start tag reaches, dispatched at every
        level; its ``start`` and ``finish`` are the root's (the tags every org's compare by)."""
        top = self.root.sched.dispatch()
        if top is None:
            return None
        d = top
        inner: list[_Node] = []
        while isinstance(d.item, _Node):
            n = d.item
            n.token = None
            inner.append(n)
            d = n.sched.dispatch()
            assert d is not None, "a node competing at its parent has a competing child"
        leaf = d
        for n in inner:  # each level is charged the leaf's cost (its entry's was the head's then)
            assert n.parent is not None
            delta = leaf.cost - n.token_cost
            if delta:
                n.parent.sched.adjust(n.key, delta)
        for n in reversed(inner):  # a node with another child competing re-enters, bottom up
            self._sync(n)
        tid = self._rev.pop((id(inner[-1]) if inner else id(self.root), leaf.ticket))
        del self._tickets[tid]
        start, finish = top.start, top.finish
        if inner:  # (the root's entry was enqueued at a guess; the adjust above made it the leaf's)
            finish = start + (finish - start) * (leaf.cost / top.cost)
        return Dispatched(leaf.flow, leaf.item, leaf.cost, tid, start, finish)

    def set_weight(self, flow: Flow, weight: float) -> None:
        """The weight of ``flow``'s (org, class) at the root: the org's times the class's."""
        if len(flow) == 3:
            self.root.sched.set_weight(flow, weight)
        else:
            self.path(flow)
            self.root.sched.set_weight(flow.flat, weight)

    def suspend(self, flow: Flow) -> None:
        n, key = self.path(flow)[0]
        n.sched.suspend(key)
        self._sync(n)

    def resume(self, flow: Flow) -> None:
        n, key = self.path(flow)[0]
        n.sched.resume(key)
        self._sync(n)

    def suspended(self, flow: Flow) -> bool:
        n, key = self.path(flow, keep=False)[0]
        return bool(n.sched.suspended(key))

    def adjust(self, flow: Flow, delta: float) -> None:
        """Correct the charge of ``flow`` by ``delta`` cost units at every level of its path,
        each divided by the weight at that level."""
        for n, key in self.path(flow, keep=False):
            n.sched.adjust(key, delta)

    def work_started(self, flow: Flow | None = None) -> None:
        if flow is None:
            self.root.sched.work_started()
            return
        for n, key in self.path(flow, keep=False):
            n.sched.work_started(key)

    def work_done(self, flow: Flow | None = None) -> None:
        if flow is None:
            self.root.sched.work_done()
            return
        for n, key in self.path(flow, keep=False):
            n.sched.work_done(key)

    def meter(self, flow: Flow) -> float:
        """The meter of ``flow``'s (org, class) at the root (where orgs compare)."""
        return float(self.root.sched.meter(flow if len(flow) == 3 else flow.flat))

    def running(self, flow: Flow) -> int:
        n, key = self.path(flow, keep=False)[0]
        return int(n.sched.running(key))

    def weight(self, flow: Flow) -> float:
        return float(self.root.sched.weight(flow if len(flow) == 3 else flow.flat))
