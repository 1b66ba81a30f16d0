"""How good the predicted wait is (``/stats``' ``predicted_wait_seconds``: ``PolicyQueue.predicted_wait``,
the model of ``deadline_unmeetable``, docs/design.md §5d): a seeded simulation of one pool through the
real engine, no I/O, deterministic.

Discrete events on an injected clock, no sleeps (as ``tests/policy/deadline_sim.py``): Poisson
arrivals per flow, attempts that hold one of 8 slots for a drawn time (log-normal, median 1 s;
``--spread``), the engine's own timers. Three flows: ``flood`` and ``steady`` send interactive
requests (weight 3), ``bulk`` keeps a batch backlog (weight 1, 40 requests, one more each time
one ends). For each interactive request the prediction at its arrival (for it: its flow, and its
drop time when it has a deadline) is recorded, then its actual wait (start - arrival); the
error is ``|predicted - actual|``, over the requests that started (one dropped at its deadline
has no wait; they are counted apart). Two loads:

* ``deadlines``: the load of ``bench_unmeetable.py``: the flood at 12 a second (about three
  times its share), the steady flow at 2, every request with a deadline of 2-20 s (uniform);
* ``no-deadlines``: the flood at 4 a second, the steady flow at 1.5, no deadline (the pool
  always full: the bulk backlog takes what they leave).

::

    python benchmarks/bench_predicted_wait.py              # seeds 0-9, both loads
    python benchmarks/bench_predicted_wait.py --seeds 3 --n 600 --json /tmp/pw.json

Results: benchmarks/README.md ("Predicted wait"), benchmarks/results/predicted_wait.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sfq.engine import PolicyEngine, Request
from sfq.policy import Flow, parse_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "policy"))
from deadline_sim import BULK, FLOOD, STEADY, arrivals_of, drive  # noqa: E402  (the simulation's events)

POLICY = """
pools:
  p:
    models: [m]
    backends: [{url: "http://127.0.0.1:9", max_in_flight: 8}]
classes:
  interactive: {weight: 3, small_cost: null}
  batch: {weight: 1, small_cost: null}
orgs:
  flood: {keys: [kf], classes: [interactive]}
  steady: {keys: [ks], classes: [interactive]}
  bulk: {keys: [kb], classes: [batch]}
"""
#: the loads: (the flood's requests a second, the steady flow's, whether each has a deadline)
LOADS: dict[str, tuple[float, float, bool]] = {"deadlines": (12.0, 2.0, True), "no-deadlines": (4.0, 1.5, False)}
#: seconds: the relative error is taken over the requests that waited at least this long
REL_FLOOR = 0.5
HERE = Path(__file__).resolve().parent


@dataclass
class Run:
    seed: int
    load: str
    sent: int = 0  # interactive requests
    unpredicted: int = 0  # no prediction at arrival (the pool had measured fewer than 8 attempts)
    dropped: int = 0  # predicted, then dropped at their deadline (no wait to compare)
    #: per started request with a prediction: (org, predicted, actual)
    pairs: list[tuple[str, float, float]] = field(default_factory=list)


def simulate(*, seed: int, load: str, n: int = 1500, spread: float = 0.5) -> Run:
    """``n`` interactive arrivals, about, of ``load`` (``LOADS``) and a batch backlog."""
    flood_rate, steady_rate, deadlines = LOADS[load]
    rng = random.Random(seed)
    clock = [0.0]
    e = PolicyEngine(parse_policy(POLICY), clock=lambda: clock[0])
    q = e.queues["p"]
    arrivals, horizon = arrivals_of(rng, ((FLOOD, flood_rate), (STEADY, steady_rate)), n, spread, deadlines)
    run = Run(seed, load)
    pred: dict[int, float] = {}
    tracked: list[Request] = []

    def arrive(now: float, f: Flow, dl: float) -> Request:
        run.sent += 1
        p = q.predicted_wait(f, now, now + dl)  # (the engine's own: as /stats gives it, for this request)
        r = e.submit(f, cost=1, deadline=now + dl if deadlines else None)
        if p is None:
            run.unpredicted += 1
        else:
            pred[r.id] = p
            tracked.append(r)
        return r

    drive(e, clock, rng, arrivals, horizon, spread, arrive)
    for r in tracked:
        if r.started_at is None:
            assert r.reason == "deadline", r
            run.dropped += 1
        else:
            run.pairs.append((r.flow.org, pred[r.id], r.started_at - r.arrival))
    assert not e.live
    return run


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank on the sorted values; ``nan`` for none)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary(pairs: list[tuple[str, float, float]]) -> dict[str, Any]:
    """The error of the predictions in ``pairs``: p50 and p90 of ``|predicted - actual|`` (s),
    of the same over the actual wait (requests that waited ``REL_FLOOR`` s or more), the median
    of ``predicted - actual`` (its bias, s), and the waits' own p50 and p90 (s)."""
    err = [abs(p - a) for _, p, a in pairs]
    rel = [abs(p - a) / a for _, p, a in pairs if a >= REL_FLOOR]
    return {"requests": len(pairs), "abs_p50": quantile(err, 0.5), "abs_p90": quantile(err, 0.9),
            "rel_p50": quantile(rel, 0.5), "rel_p90": quantile(rel, 0.9), "rel_requests": len(rel),
            "bias_p50": quantile([p - a for _, p, a in pairs], 0.5),
            "wait_p50": quantile([a for _, _, a in pairs], 0.5), "wait_p90": quantile([a for _, _, a in pairs], 0.9)}


def bench(seeds: int, n: int, spread: float, loads: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for load in loads:
        runs = [simulate(seed=s, load=load, n=n, spread=spread) for s in range(seeds)]
        every = [x for r in runs for x in r.pairs]
        out[load] = {
            "rates": {"flood": LOADS[load][0], "steady": LOADS[load][1]}, "deadlines": LOADS[load][2],
            "seeds": [{"seed": r.seed, "sent": r.sent, "unpredicted": r.unpredicted, "dropped": r.dropped,
                       **summary(r.pairs)} for r in runs],
            "all": {"sent": sum(r.sent for r in runs), "unpredicted": sum(r.unpredicted for r in runs),
                    "dropped": sum(r.dropped for r in runs), **summary(every)},
            "by_org": {org: summary([x for x in every if x[0] == org]) for org in ("flood", "steady")}}
    return out


def _row(name: str, s: dict[str, Any]) -> str:
    return (f"| {name} | {s['requests']} | {s['wait_p50']:.2f} / {s['wait_p90']:.2f} | {s['abs_p50']:.2f} "
            f"| {s['abs_p90']:.2f} | {s['rel_p50']:.0%} | {s['rel_p90']:.0%} | {s['bias_p50']:+.2f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (default 10)")
    ap.add_argument("--n", type=int, default=1500, help="interactive arrivals per run, about (default 1500)")
    ap.add_argument("--spread", type=float, default=0.5, help="log-normal sigma of service times (default 0.5)")
    ap.add_argument("--load", choices=sorted(LOADS), action="append", help="one load (default: both)")
    ap.add_argument("--json", type=lambda x: Path(x) if x else None, default=HERE / "results" / "predicted_wait.json",
                    help="where to write the results (default benchmarks/results/predicted_wait.json; '' for nowhere)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = bench(a.seeds, a.n, a.spread, a.load or list(LOADS))
    took = time.perf_counter() - t0
    for load, r in res.items():
        al = r["all"]
        print(f"\n{load}: flood {r['rates']['flood']:g}/s, steady {r['rates']['steady']:g}/s, "
              f"{'deadlines 2-20 s' if r['deadlines'] else 'no deadlines'}; {a.seeds} seeds, {al['sent']} sent, "
              f"{al['unpredicted']} before the pool had measured 8 attempts, {al['dropped']} dropped at their "
              f"deadline")
        print("| flow | started | actual wait p50 / p90 (s) | abs. error p50 (s) | abs. error p90 (s) "
              f"| rel. error p50 | rel. error p90 | bias p50 (s) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print(_row("all", al))
        for org, s in r["by_org"].items():
            print(_row(org, s))
        print("| seed | " + " | ".join(f"{s['seed']}: {s['abs_p50']:.2f} / {s['abs_p90']:.2f}" for s in r["seeds"])
              + " |  (abs. error p50 / p90, s)")
    print(f"\n({took:.1f} s; relative error over the requests that waited {REL_FLOOR} s or more)")
    if a.json:
        a.json.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
                                      "seeds": a.seeds, "n": a.n, "spread": a.spread, "slots": 8,
                                      "rel_floor_seconds": REL_FLOOR, "loads": res}, indent=1) + "\n")
        print(f"wrote {a.json}")


def test_bench_predicted_wait_smoke() -> None:
    """One short seed of each load (CI's benchmark smoke run): predictions were made and compared,
    the figures are finite; nothing is timed and no accuracy is asserted."""
    res = bench(1, 300, 0.5, list(LOADS))
    for r in res.values():
        al = r["all"]
        assert al["requests"] > 50 and al["unpredicted"] < al["sent"], al
        assert all(math.isfinite(al[k]) and al[k] >= 0 for k in ("abs_p50", "abs_p90", "rel_p50", "rel_p90")), al


if __name__ == "__main__":
    main()
