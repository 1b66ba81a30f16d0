"""A fleet is as fair as one engine (issue 27): the shares of delivered service through 1, 2
and 4 ``sfq serve`` processes (alternating and sticky), side by side, with the added latency.

The harness is ``tests/support/fleet.py`` (that of ``tests/fleet/test_fleet_fair.py``), run
longer: loopback engines (``--speeds``, 4 requests at a time each) that count every org's
service as they deliver it (prompt + 2 x output tokens), one real ``redis-server``, the
gateways (one keeping its state in memory, the reference; the others with
``state: {redis: ...}``), the official ``openai`` client. The workload is issue 27's: four
equal orgs, A plain answers of ``--tokens`` tokens, B and C streams, D mixed, honest
``max_tokens``, ``--clients`` closed-loop clients each; plus an interactive org I (a short
stream every 0.25 s, not backlogged). Alternating: each org's requests round-robin over the
gateways, per request; sticky: each org always to one gateway (A, B, C, D dealt in order; I
with A).

Reported per configuration, over ``--rounds`` rounds (the configurations interleaved within
each round, so that a shared machine's load drifts over all of them alike):

* each backlogged org's share of their delivered service after ``--warmup`` s (the mean over
  the rounds), the largest deviation from the fair share in points (the worst round), Jain's
  index (the worst round);
* the interactive org's time to first token, p99 (per round, then the median of the rounds;
  with ~40 requests a round the p99 is about the worst);
* the added latency: one client, sequential one-token requests on the idle fleet, in pairs:
  straight to an engine, then through a gateway (in turn); the median of the differences,
  all rounds pooled.

Run from the repository root (``redis-server`` installed: ``apt-get install redis-server``)::

    python benchmarks/bench_fleet.py                       # ~4 minutes: 2 rounds of 6 configurations
    python benchmarks/bench_fleet.py --rounds 3 --seconds 15
    python benchmarks/bench_fleet.py --quick               # a smoke run (numbers not for quoting)
    # issue 27's targets: A over-declaring 10x, engines of 10 and 25 ms a step, 15-s windows after 10 s
    python benchmarks/bench_fleet.py --workload over --speeds 2.5,1 --warmup 10 --window 15 --seconds 30 --rounds 1
    python benchmarks/bench_fleet.py --workload weighted --gateways 1,2   # 2:1:1, A on one gateway, B and C on another

Results go to ``benchmarks/results/fleet.json`` (not with ``--quick``) and a markdown table on
stdout. Under pytest (CI's benchmark smoke run) ``test_bench_fleet_smoke`` runs a tiny version
once, skipping when ``redis-server`` is missing; nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # the fleet harness of the tests (tests/support)
if not os.environ.get("PYTHONPATH"):
    try:
        import sfq  # noqa: F401
    except ImportError:  # a checkout without an install: the child gateways need python/ too
        os.environ["PYTHONPATH"] = str(ROOT / "python")

from support.fleet import (ALTERNATING, STICKY, Scenario, four_to_one_orgs, issue27_orgs,  # noqa: E402
                           over_declared_first_orgs, run_scenario, weighted_orgs)
from support.processes import REDIS, RedisServer  # noqa: E402

#: (gateways, routing, state): the reference first
CONFIGS = [(1, "-", "memory"), (1, "-", "redis"), (2, ALTERNATING, "redis"), (2, STICKY, "redis"),
           (4, ALTERNATING, "redis"), (4, STICKY, "redis"), (8, ALTERNATING, "redis"), (8, STICKY, "redis")]
#: the fault rows (``--faults``): three gateways, requests alternating, and a fault a third of
#: the way into the measured time: Redis SIGKILLed and restarted empty after a third of it
#: (``redis-lost``), or one gateway SIGKILLed and started again 3 s later (``gateway-killed``)
FAULTS = [(3, ALTERNATING, "redis-lost"), (3, ALTERNATING, "gateway-killed")]


#: the workloads (``--workload``): the orgs, and for sticky routing which gateway each reaches
WORKLOADS: dict[str, Any] = {
    # four equal orgs: A plain, B and C streamed, D mixed, honest max_tokens
    "issue27": (lambda tokens, clients: issue27_orgs(tokens=tokens, clients=clients), None),
    # the same, A declaring 10x the output it uses (plain requests charged their estimate)
    "over": (lambda tokens, clients: over_declared_first_orgs(tokens=tokens, clients=clients), None),
    # weights A:B:C = 2:1:1, B over-declared; sticky: A reaches only the first gateway, B and C the second
    "weighted": (lambda tokens, clients: weighted_orgs(tokens=tokens, clients=clients), {"A": 0, "B": 1, "C": 1}),
    # weights A:B = 4:1, B over-declared; sticky: A the first gateway, B the second
    "four-to-one": (lambda tokens, clients: four_to_one_orgs(tokens=tokens, clients=clients), {"A": 0, "B": 1}),
}


def _label(c: tuple[int, str, str]) -> str:
    return f"{c[0]}-{c[1] if c[0] > 1 else 'one'}-{c[2]}"


def run(configs: list[tuple[int, str, str]], *, rounds: int, warmup: float, seconds: float, tokens: int,
        clients: int, speeds: tuple[float, ...], latency_requests: int, workload: str = "issue27",
        window: float = 2.0) -> dict[str, Any]:
    make, sticky = WORKLOADS[workload]
    if any(c[2] == "redis" for c in configs) and REDIS is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
    redis = RedisServer().start() if REDIS is not None else None
    runs: dict[str, list[dict[str, Any]]] = {_label(c): [] for c in configs}
    try:
        for r in range(rounds):
            for c in configs:
                gateways, routing, state = c
                fault: dict[str, Any] = {}
                if state == "redis-lost":
                    fault = {"redis_outage": (warmup + seconds / 3, seconds / 3)}
                elif state == "gateway-killed":
                    fault = {"gateway_kill": (1, warmup + seconds / 3, 3.0), "lease": 2.0}
                sc = Scenario(_label(c), make(tokens, clients), gateways=gateways,
                              routing=routing if gateways > 1 else ALTERNATING, redis=state != "memory",
                              sticky=sticky, speeds=speeds, warmup=warmup, seconds=seconds, window=window, **fault)
                # (Redis killed: a Redis of the run's own)
                rep = run_scenario(sc, redis=None if state == "redis-lost" else redis,
                                   latency_requests=0 if fault else latency_requests)
                d = rep.as_dict()
                d["round"] = r
                runs[sc.name].append(d)
                extra = (f"; added p50 {statistics.median(d['added_latency']) * 1000:.2f} ms"
                         if d.get("added_latency") else
                         f"; engines held at most {max(rep.engines_peak)} of {rep.slots}; killed gateway held "
                         f"{rep.killed_in_hands}")
                print(f"  round {r + 1}/{rounds} {rep.summary()}{extra}", flush=True)
                for org, errs in rep.errors.items():  # (what failed: the first few of each org)
                    for e in errs[:3]:
                        print(f"    error {org}: {e[:300]}", flush=True)
    finally:
        if redis is not None:
            redis.stop()
    rows = []
    for c in configs:
        rs = runs[_label(c)]
        orgs = list(rs[0]["shares"])
        ttft = [x["ttft"]["I"]["p99"] for x in rs if x["ttft"].get("I", {}).get("n")]
        added = [v for x in rs for v in x.get("added_latency", [])]
        rows.append({
            "config": _label(c), "gateways": c[0], "routing": c[1], "state": c[2],
            "shares": {k: round(statistics.fmean(x["shares"][k] for x in rs), 4) for k in orgs},
            "expected": rs[0]["expected"],
            "max_deviation_pts": max(x["deviation"] for x in rs),
            "max_window_deviation_pts": max(x["window_deviation"] for x in rs),
            "jain": min(x["jain"] for x in rs),
            "ttft_p99_s": round(statistics.median(ttft), 4) if ttft else None,
            "added_p50_ms": round(statistics.median(added) * 1000, 3) if added else None,
            "round_trips_per_request": (round(statistics.median(x["round_trips_per_request"] for x in rs), 3)
                                        if all(x.get("round_trips_per_request") is not None for x in rs) else None),
            "idle_round_trips_per_request": (
                round(statistics.median(x["idle_round_trips_per_request"] for x in rs), 3)
                if all(x.get("idle_round_trips_per_request") is not None for x in rs) else None),
            "completed": {k: sum(x["completed"][k] for x in rs) for k in rs[0]["completed"]},
            "errors": sum(len(v) for x in rs for v in x["errors"].values()),
            "engines_peak": max(max(x["engines_peak"]) for x in rs), "slots": rs[0]["slots"],
            "killed_in_hands": max(x["killed_in_hands"] for x in rs),
            "outcome_problems": [p for x in rs for p in x["problems"]],
        })
    return {"rows": rows, "runs": runs}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| gateways | routing | state | shares (fair: " + " / ".join(
                 f"{v:.0%}" for v in rows[0]["expected"].values()) + ") | max dev (pts) | worst window (pts) "
             "| Jain | I TTFT p99 (ms) | added p50 (ms) | Redis trips / req (flood; idle) | completed | errors "
             "| most held / slots |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        sh = " / ".join(f"{v:.1%}" for v in r["shares"].values())
        tt = f"{r['ttft_p99_s'] * 1000:.0f}" if r["ttft_p99_s"] is not None else ""
        ad = f"{r['added_p50_ms']:.2f}" if r["added_p50_ms"] is not None else ""
        rt = f"{r['round_trips_per_request']:.2f}" if r.get("round_trips_per_request") is not None else ""
        if r.get("idle_round_trips_per_request") is not None:
            rt += f"; {r['idle_round_trips_per_request']:.2f}"
        errs = r["errors"] + len(r["outcome_problems"])
        lines.append(f"| {r['gateways']} | {r['routing']} | {r['state']} | {sh} | {r['max_deviation_pts']:.1f} | "
                     f"{r['max_window_deviation_pts']:.1f} | {r['jain']:.4f} | {tt} | {ad} | {rt} | "
                     f"{sum(r['completed'].values())} | {errs} | {r['engines_peak']} / {r['slots']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the configurations interleaved in each (2)")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run, after the warm-up (10)")
    ap.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per run (3)")
    ap.add_argument("--tokens", type=int, default=400, help="output tokens per backlogged request (400)")
    ap.add_argument("--clients", type=int, default=6, help="closed-loop clients per backlogged org (6)")
    ap.add_argument("--speeds", default="2,1", help="the engines' speeds (2,1: two engines, one twice as fast)")
    ap.add_argument("--latency-requests", type=int, default=100, help="request pairs for the added latency (100)")
    ap.add_argument("--gateways", default="1,2,4", help="gateway counts to run (1,2,4; 8 too: 1,2,4,8)")
    ap.add_argument("--faults", action="store_true",
                    help="also the fault rows: three gateways, Redis killed, then a gateway killed")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round, short (not for quoting)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="issue27",
                    help="issue27 (default): four equal orgs, honest; over: A declares 10x; weighted: 2:1:1")
    ap.add_argument("--window", type=float, default=2.0, help="seconds per window of the worst-window figure (2)")
    ap.add_argument("--json", default=None, help="results/fleet.json (fleet-WORKLOAD.json for another workload)")
    a = ap.parse_args(argv)
    wanted = {int(x) for x in a.gateways.split(",") if x}
    configs = [c for c in CONFIGS if c[0] in wanted] + (FAULTS if a.faults else [])
    if a.quick:
        a.rounds, a.seconds, a.warmup, a.latency_requests = 1, 2.0, 1.0, 10
    speeds = tuple(float(x) for x in a.speeds.split(","))
    load_before = os.getloadavg()
    t0 = time.monotonic()
    res = run(configs, rounds=a.rounds, warmup=a.warmup, seconds=a.seconds, tokens=a.tokens, clients=a.clients,
              speeds=speeds, latency_requests=a.latency_requests, workload=a.workload, window=a.window)
    if a.json is None:
        a.json = str(HERE / "results" / ("fleet.json" if a.workload == "issue27" else f"fleet-{a.workload}.json"))
    import sfq

    doc = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "core": sfq.CORE, "python": platform.python_version(),
           "machine": platform.machine(), "cpus": os.cpu_count(), "loadavg_before": load_before,
           "loadavg_after": os.getloadavg(), "wall_s": round(time.monotonic() - t0, 1), "quick": a.quick,
           "workload": a.workload, "window": a.window, "command": " ".join(sys.argv),
           "rounds": a.rounds, "warmup": a.warmup, "seconds": a.seconds, "tokens": a.tokens, "clients": a.clients,
           "engines": {"speeds": speeds, "slots": 4}, **res}
    if not a.quick:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nload average before {load_before[0]:.2f}, after {doc['loadavg_after'][0]:.2f}; "
          f"{a.rounds} round(s) of {a.warmup:g} + {a.seconds:g} s; engines {a.speeds}; wall {doc['wall_s']} s\n")
    print(table(res["rows"]))
    return 0


def test_bench_fleet_smoke() -> None:
    """A tiny version once (CI's benchmark smoke run): it runs and every request has one
    outcome; nothing is timed, no share asserted."""
    import pytest

    pytest.importorskip("openai")
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    pytest.importorskip("redis")
    res = run([(1, "-", "memory"), (2, ALTERNATING, "redis")], rounds=1, warmup=0.5, seconds=1.0, tokens=50,
              clients=2, speeds=(1.0,), latency_requests=3)
    assert [r["config"] for r in res["rows"]] == ["1-one-memory", "2-alternating-redis"]
    assert all(sum(r["completed"].values()) > 0 and not r["outcome_problems"] for r in res["rows"])


if __name__ == "__main__":
    sys.exit(main())
