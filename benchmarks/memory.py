"""Memory held by the SFQ core, per idle known flow and per queued request, via tracemalloc.

The compiled core allocates its C arrays (flow records, heaps, rings, the ticket table) with
``PyMem_*``, which tracemalloc traces like any Python object, so one measurement method covers
the compiled core, the pure-Python twin and the heapq baseline alike.

Method: every object the *caller* owns -- flow ids, payload items, cost floats -- is built
before the first snapshot and stays alive, so it is not counted ("payload objects aside").
What is counted is everything the scheduler allocates and keeps: C arrays and their slack
from growing by doubling, its dict from flow id to slot (entries, and the int objects it
stores), Python objects of the pure-Python implementations. Transient objects (``Dispatch``
records, returned tickets) are freed before the second snapshot.

* **idle known flow**: a flow with no waiting request whose meter is above ``v``, so the core
  must remember it. n flows each enqueue one request (cost 1000) and are dispatched while an
  anchor flow (meter 1) keeps ``v`` at 0; bytes(after) - bytes(before), divided by n.
* **dormant flow**: idle, meter <= v, but with a non-default weight (``set_weight(f, 2.0)``).
* **queued request**: 1,000 flows each already waiting with one request; then m more requests
  are enqueued round-robin over them; the growth divided by m.

Usage: ``python benchmarks/memory.py [--json] [--impls compiled,twin,heapq] [--sizes 10000,100000]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tracemalloc
import warnings
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # reported below through sfq.CORE
    try:
        import sfq
    except ImportError:  # not installed: use the checkout (with its in-place build, if any)
        sys.path.insert(0, str(HERE.parent / "python"))
        import sfq

from heapq_sfq import HeapqSFQ  # noqa: E402

IMPLS: dict[str, Callable] = {"compiled": sfq.Scheduler, "twin": sfq.ReferenceScheduler, "heapq": HeapqSFQ}
QUEUE_FLOWS = 1_000


class Payload:
    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n


def _traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def idle_flow_bytes(cls: Callable, n: int) -> float:
    """Bytes the core keeps per idle flow whose meter is above v."""
    keys = list(range(1 << 40, (1 << 40) + n))  # the caller's flow ids
    cost = 1000.0
    tracemalloc.start()
    try:
        s = cls()
        s.enqueue("anchor", 1.0)
        s.enqueue("anchor", 1.0)
        s.dispatch()  # anchor: meter 1, one request still waiting; v = 0 from now on
        before = _traced()
        enqueue, dispatch = s.enqueue, s.dispatch
        for k in keys:
            enqueue(k, cost)
        for _ in range(n):
            dispatch()  # every new flow (meter 0) goes before the anchor (meter 1)
        after = _traced()
        assert s.virtual_time == 0.0 and len(s) == 1, "the idle flows must stay above v"
        if hasattr(s, "known_flows"):
            assert s.known_flows == n + 1, (s.known_flows, n + 1)
        del s
    finally:
        tracemalloc.stop()
    return (after - before) / n


def dormant_flow_bytes(cls: Callable, n: int) -> float:
    """Bytes the core keeps per flow that has only a non-default weight to remember."""
    keys = list(range(1 << 40, (1 << 40) + n))
    tracemalloc.start()
    try:
        s = cls()
        before = _traced()
        set_weight = s.set_weight
        for k in keys:
            set_weight(k, 2.0)
        after = _traced()
        if hasattr(s, "known_flows"):
            assert s.known_flows == n
        del s
    finally:
        tracemalloc.stop()
    return (after - before) / n


def queued_request_bytes(cls: Callable, m: int) -> float:
    """Bytes the core keeps per waiting request (flows already waiting, payload aside)."""
    flows = list(range(QUEUE_FLOWS))
    costs = [float(1 + (i * 7919) % 1000) for i in range(m)]  # the caller's cost objects
    items = [Payload(i) for i in range(m)]
    first = [Payload(-1) for _ in flows]
    tracemalloc.start()
    try:
        s = cls()
        for f in flows:
            s.enqueue(f, 1.0, first[f])
        before = _traced()
        enqueue = s.enqueue
        for i in range(m):
            enqueue(i % QUEUE_FLOWS, costs[i], items[i])
        after = _traced()
        assert len(s) == m + QUEUE_FLOWS
        del s
    finally:
        tracemalloc.stop()
    return (after - before) / m


def measure(impls: list[str], sizes: list[int]) -> dict:
    out: dict = {"core": sfq.CORE, "queue_flows": QUEUE_FLOWS, "results": {}}
    for name in impls:
        cls = IMPLS[name]
        r: dict = {"idle_flow": {}, "dormant_flow": {}, "queued_request": {}}
        for n in sizes:
            r["idle_flow"][str(n)] = round(idle_flow_bytes(cls, n), 1)
            r["dormant_flow"][str(n)] = round(dormant_flow_bytes(cls, n), 1)
            r["queued_request"][str(n)] = round(queued_request_bytes(cls, n), 1)
        out["results"][name] = r
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", default="compiled,twin,heapq")
    ap.add_argument("--sizes", default="10000,100000", help="n idle flows / m queued requests")
    ap.add_argument("--json", action="store_true", help="print JSON only")
    a = ap.parse_args(argv)
    impls = [x for x in a.impls.split(",") if x]
    for x in impls:
        if x not in IMPLS:
            ap.error(f"unknown implementation {x!r}; known: {sorted(IMPLS)}")
    sizes = [int(x.replace("_", "")) for x in a.sizes.split(",") if x]
    out = measure(impls, sizes)
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"sfq.Scheduler is the {out['core']} core; bytes per ... (payload objects aside)")
    print(f"{'impl':10} {'n':>8} {'idle flow':>10} {'dormant flow':>13} {'queued request':>15}")
    for name, r in out["results"].items():
        for n in map(str, sizes):
            print(f"{name:10} {n:>8} {r['idle_flow'][n]:>10.1f} {r['dormant_flow'][n]:>13.1f} {r['queued_request'][n]:>15.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
