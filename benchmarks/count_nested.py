"""The request engine's own work per request, flat and under nested shares: ``N`` requests
through ``PolicyEngine`` (submit, start, complete with usage; no I/O) on a policy of 50 orgs
of two classes, flat (100 flows) or with two teams of two users each per org (400 leaves,
``teams`` and ``users: equal``), or flat with a deadline on every request (``deadlines``: the
flow's EDF heap instead of its FIFO, docs/design.md §5d). Run it under callgrind twice, with ``N`` and with 0, and
subtract: what is left is per-request work, free of the machine's noise::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null python benchmarks/count_nested.py 4000 flat
    valgrind --tool=callgrind --callgrind-out-file=/dev/null python benchmarks/count_nested.py 0 flat

Results: benchmarks/README.md ("Nested shares").
"""

from __future__ import annotations

import sys
import time

from sfq import Flow
from sfq.engine.engine import PolicyEngine
from sfq.policy.config import parse_policy

ORGS = 50


def main(n: int, kind: str) -> None:
    if kind in ("flat", "deadlines"):
        orgs = "".join(f"  o{i}: {{keys: [k{i}], classes: [batch, interactive]}}\n" for i in range(ORGS))
        flows = [Flow(f"o{i}", c, "gpu") for i in range(ORGS) for c in ("batch", "interactive")]
    elif kind == "nested":
        orgs = "".join(f"  o{i}: {{classes: [batch, interactive], users: equal, "
                       f"teams: {{a: {{keys: [ka{i}]}}, b: {{keys: [kb{i}]}}}}}}\n" for i in range(ORGS))
        flows = [Flow(f"o{i}", c, "gpu", t, f"u{k}") for i in range(ORGS) for c in ("batch", "interactive")
                 for t in "ab" for k in range(2)]
    else:
        raise SystemExit(f"kind must be flat, deadlines or nested, got {kind!r}")
    policy = parse_policy("pools: {gpu: {models: [m], backends: [{url: \"http://127.0.0.1:1\", max_in_flight: 8}]}}\n"
                          "classes: {batch: {weight: 1}, interactive: {weight: 4}}\norgs:\n" + orgs)
    e = PolicyEngine(policy, clock=time.monotonic)
    est = e.estimator.estimate_tokens(200, 100)
    timeout = 3600.0 if kind == "deadlines" else None
    for k in range(n):
        e.submit(flows[k % len(flows)], estimate=est, deadline=None if timeout is None else e.clock() + timeout)
        for r in e.poll():
            e.complete(r, {"prompt_tokens": 200, "completion_tokens": 50})


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "flat")
