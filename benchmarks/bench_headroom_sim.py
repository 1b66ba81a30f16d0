"""What the pool's ``limits.headroom`` buys and costs in ``sfq simulate deadlines`` (issue 42,
part 5), on pools of one or more engines of 32 slots (``--servers``; the flood grows with the
pool, twice its capacity, the interactive tenant does not): the interactive class's objective
attainment and the batch class's service against FIFO's, over seeds, for ``sfq-edf`` and
``sfq-edf-headroom-K`` (the engine's own headroom, K slots of the pool kept); per fleet size the
smallest K that brings the attainment to 99 %, the largest that keeps the batch class at 90 %
of FIFO's, and the K meeting both. Then why no K meets both on one engine: the same with the
bursts of 8 made 4 or none, and with an objective of 2 s instead of 1 (on the first fleet size
only). Last, the model of docs/policy.md ("Deadlines and service levels") against the runs:
the misses of bursts against the slots that free within the objective, and the share of the
quiet tenant's arrivals that find none of the K slots free against (arrival rate / slot
turnover)^K, with the flood as two tenants (the scenario) and as one. Seeded simulation,
deterministic, no I/O::

    python benchmarks/bench_headroom_sim.py             # seeds 0-9, 1, 2 and 4 engines, K = 1..8
    python benchmarks/bench_headroom_sim.py --servers 1 --seeds 3 --headroom 3,5 --no-study --no-check

Figures: medians over the seeds, with the worst seed's (lowest attainment, lowest batch
service, highest p99), and the interactive requests that missed the objective over all the
seeds, those of a burst apart; results in ``benchmarks/results/headroom-sim.json`` (not with
``--no-save``) and as markdown on stdout. docs/policy.md ("Deadlines and service levels") and
docs/simulator.md quote them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
try:
    import sfq  # noqa: F401
except ImportError:  # a checkout without an install
    sys.path.insert(0, str(HERE.parent / "python"))

from sfq.sim.adapter import STEPS_PER_SECOND  # noqa: E402
from sfq.sim.deadlines import APP_RATE, BATCH_SIZES, ENGINE_SLOTS, run_deadlines  # noqa: E402
from sfq.sim.scenarios import Options  # noqa: E402

#: (label, objective s, burst size) of the study: what makes the goals reachable
STUDY = (("bursts of 8, objective 1 s (the scenario)", 1.0, 8), ("bursts of 4, objective 1 s", 1.0, 4),
         ("no bursts, objective 1 s", 1.0, 0), ("bursts of 8, objective 2 s", 2.0, 8))


def _misses(res: Any, objective: float) -> tuple[int, int]:
    """The interactive requests that missed the objective: (of a burst, the others). A burst's
    requests share their arrival step (two single arrivals in one step count as a burst too)."""
    import numpy as np

    from sfq.sim.adapter import STEPS_PER_SECOND

    idx = np.flatnonzero((res.flow == 0) & (res.arrival < res.end))
    arr = res.arrival[idx]
    steps, counts = np.unique(arr, return_counts=True)
    burst = np.isin(arr, steps[counts >= 2])
    started = res.admit[idx] >= 0
    miss = ~started | ((res.admit[idx] - arr + 1) / STEPS_PER_SECOND > objective + 1e-9)
    return int((miss & burst).sum()), int((miss & ~burst).sum())


def _arrivals(res: Any, burst: int) -> tuple[int, int, int]:
    """The interactive tenant's arrivals: (bursts: steps with ``burst`` arrivals or more, single
    arrivals, single arrivals that found no slot they could take: started a step or more after
    they came, or never)."""
    import numpy as np

    idx = np.flatnonzero((res.flow == 0) & (res.arrival < res.end))
    arr = res.arrival[idx]
    steps, counts = np.unique(arr, return_counts=True)
    single = ~np.isin(arr, steps[counts >= 2])
    adm = res.admit[idx][single]
    bursts = int((counts >= burst).sum()) if burst >= 2 else 0
    return bursts, int(single.sum()), int(((adm < 0) | (adm > arr[single])).sum())


def sweep(seeds: int, headroom: tuple[int, ...], objective: float = 1.0, burst: int = 8,
          steps: int | None = None, servers: int = 1, flood_tenants: int = 2) -> list[dict[str, Any]]:
    """One row per policy (sfq-edf, then each K) on ``servers`` engines: medians and worst over
    seeds 0..seeds-1, the misses of the objective over all the seeds, of bursts and of the other
    requests, and the single arrivals (not of a burst) that found no slot they could take."""
    per: dict[str, list[dict[str, Any]]] = {}
    missed: dict[str, list[int]] = {}
    arrived: dict[str, list[int]] = {}
    for seed in range(seeds):
        res = run_deadlines(Options(seed=seed, steps=steps, servers=servers, headroom=headroom), ["sfq-edf"],
                            objective=objective, burst=burst, flood_tenants=flood_tenants)
        for r, (name, run) in zip(res.results, res.runs):
            if r["policy"] == "sfq-edf" or r["headroom"]:
                per.setdefault(r["policy"], []).append(r)
                m = missed.setdefault(name, [0, 0])
                for i, x in enumerate(_misses(run, objective)):
                    m[i] += x
                a = arrived.setdefault(name, [0, 0, 0])
                for i, x in enumerate(_arrivals(run, burst)):
                    a[i] += x
    rows = []
    for policy, rs in per.items():
        inter = [r["classes"]["interactive"] for r in rs]
        att = [c["attainment"] for c in inter]
        it = [c["in_time"] for c in inter]
        p99 = [c["ttft_p99"] for c in inter]
        batch = [r["batch_vs_fifo"] for r in rs]
        rows.append({"policy": policy, "headroom": rs[0]["headroom"], "seeds": len(rs),
                     "attainment": {"median": statistics.median(att), "worst": min(att)},
                     "in_time": {"median": statistics.median(it), "worst": min(it)},
                     "ttft_p99": {"median": statistics.median(p99), "worst": max(p99)},
                     "batch_vs_fifo": {"median": statistics.median(batch), "worst": min(batch)},
                     "missed": {"of_bursts": missed[policy][0], "others": missed[policy][1]},
                     "bursts": arrived[policy][0], "single_arrivals": arrived[policy][1],
                     "found_none_free": arrived[policy][2]})
    return rows


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per statistic (the median over the seeds, the worst seed): the smallest K (0: sfq-edf)
    whose interactive attainment is 99 % or more, the largest K whose batch service is 90 % of
    FIFO's or more, and the K meeting both (``[]``: none)."""
    out: dict[str, Any] = {}
    for stat in ("median", "worst"):
        att = [r["headroom"] for r in rows if r["attainment"][stat] >= 0.99]
        bat = [r["headroom"] for r in rows if r["batch_vs_fifo"][stat] >= 0.90]
        out[stat] = {"attainment_99": min(att) if att else None, "batch_90": max(bat) if bat else None,
                     "both": sorted(set(att) & set(bat))}
    return out


def _poisson_shortfall(need: int, mu: float) -> float:
    """``E[(need - C)^+]`` for ``C`` Poisson with mean ``mu``."""
    p, total = math.exp(-mu), 0.0
    for j in range(max(need, 0)):
        total += (need - j) * p
        p *= mu / (j + 1)
    return total


def model(servers: int, k: int, objective: float = 1.0, burst: int = 8, slots: int = ENGINE_SLOTS) -> dict[str, float]:
    """docs/policy.md's model of one fleet size and K. ``freed``: the slots the flood frees within
    the objective (the window a request may wait, ``objective`` less the step of its first token,
    times the flood's slots ``cap - K`` over its mean answer); ``burst_misses``: a burst's
    expected misses when its first K start at once and the others take the slots freed, those
    Poisson with mean ``freed`` (``E[(burst - K - C)^+]``); ``single_miss``: a lone arrival's
    chance to miss when it must wait for the next slot freed (``exp(-freed)``); ``none_free``:
    the chance that a Poisson arrival (the interactive tenant's, ``lambda`` a step) finds none of
    the K kept free, when only its own requests take them and any end gives one back (rate ``nu``
    = ``cap`` / mean answer): an M/M/1/K queue's full state, ``(1 - rho) rho^K / (1 - rho^(K+1))``
    with ``rho = lambda / nu``, about ``rho^K``."""
    cap = servers * slots
    service = (BATCH_SIZES.output[0] + BATCH_SIZES.output[1]) / 2  # steps: one token a step
    window = math.floor(objective * STEPS_PER_SECOND - 1 + 1e-9)
    freed = window * (cap - k) / service
    rho = APP_RATE / (cap / service)
    return {"freed": freed, "burst_misses": _poisson_shortfall(burst - k, freed), "single_miss": math.exp(-freed),
            "none_free": (1 - rho) * rho ** k / (1 - rho ** (k + 1))}


def table(rows: list[dict[str, Any]]) -> str:
    def pct(s: dict[str, float]) -> str:
        return f"{100 * s['median']:.1f} % ({100 * s['worst']:.1f} %)"

    out = ["| policy | interactive attainment | in time | TTFT p99 (s) | batch service vs FIFO | missed: of bursts "
           "/ others (all seeds) | both goals |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ok = r["attainment"]["median"] >= 0.99 and r["batch_vs_fifo"]["median"] >= 0.90
        out.append(f"| {r['policy']} | {pct(r['attainment'])} | {pct(r['in_time'])} | "
                   f"{r['ttft_p99']['median']:.2f} ({r['ttft_p99']['worst']:.2f}) | {pct(r['batch_vs_fifo'])} | "
                   f"{r['missed']['of_bursts']} / {r['missed']['others']} | {'yes' if ok else 'no'} |")
    return "\n".join(out)


def goals_table(fleets: list[dict[str, Any]]) -> str:
    def k(x: int | None) -> str:
        return "none" if x is None else str(x)

    def ks(xs: list[int]) -> str:
        return ", ".join(map(str, xs)) if xs else "none"

    out = ["| engines (slots) | smallest K for 99 % within the objective | largest K for batch >= 90 % of FIFO "
           "| K meeting both |", "|---|---:|---:|---|"]
    for f in fleets:
        g = f["goals"]
        out.append(f"| {f['servers']} ({f['slots']}) | {k(g['median']['attainment_99'])} "
                   f"(worst seed: {k(g['worst']['attainment_99'])}) | {k(g['median']['batch_90'])} "
                   f"(worst seed: {k(g['worst']['batch_90'])}) | {ks(g['median']['both'])} "
                   f"(worst seed: {ks(g['worst']['both'])}) |")
    return "\n".join(out)


def model_rows(rows: list[dict[str, Any]], servers: int, objective: float = 1.0,
               burst: int = 8) -> list[dict[str, Any]]:
    """The model beside the runs, per K: the batch class's service against FIFO's (``1 - K /
    cap`` against the median), misses of bursts (over all the seeds: the model's per burst times
    the bursts), lone arrivals that missed, and lone arrivals that found none of the K slots
    free (their share)."""
    out = []
    for r in rows:
        m = model(servers, r["headroom"], objective, burst)
        out.append({"headroom": r["headroom"], "freed_within_objective": m["freed"],
                    "batch_vs_fifo": {"model": 1 - r["headroom"] / (servers * ENGINE_SLOTS),
                                      "measured": r["batch_vs_fifo"]["median"]},
                    "burst_misses": {"model": m["burst_misses"] * r["bursts"], "measured": r["missed"]["of_bursts"]},
                    "single_misses": {"model": m["single_miss"] * r["found_none_free"],
                                      "measured": r["missed"]["others"]},
                    "found_none_free": {"model": m["none_free"],
                                        "measured": r["found_none_free"] / r["single_arrivals"]
                                        if r["single_arrivals"] else None}})
    return out


def model_table(fleets: list[dict[str, Any]]) -> str:
    out = ["| engines | K | batch vs FIFO: 1 - K / slots / measured | slots freed within 1 s | burst misses: model / "
           "measured | lone arrivals' misses: model / measured | lone arrivals finding none free (measured) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for f in fleets:
        for m in f["model"]:
            b = m["batch_vs_fifo"]
            out.append(f"| {f['servers']} | {m['headroom']} | {100 * b['model']:.1f} % / {100 * b['measured']:.1f} % | "
                       f"{m['freed_within_objective']:.1f} | "
                       f"{m['burst_misses']['model']:.1f} / {m['burst_misses']['measured']} | "
                       f"{m['single_misses']['model']:.1f} / {m['single_misses']['measured']} | "
                       f"{100 * m['found_none_free']['measured']:.2f} % |")
    return "\n".join(out)


def check(seeds: int, servers: tuple[int, ...], headroom: tuple[int, ...], steps: int | None = None) -> list[dict[str, Any]]:
    """Lone arrivals (no bursts) that found none of the K slots free, per fleet size and K, with
    the flood as two tenants (the scenario) and as one (the same requests in one flow), beside
    the model's (arrival rate / slot turnover)^K."""
    out = []
    for n in servers:
        for tenants in (2, 1):
            for r in sweep(seeds, headroom, burst=0, steps=steps, servers=n, flood_tenants=tenants):
                if not r["headroom"]:
                    continue
                out.append({"servers": n, "flood_tenants": tenants, "headroom": r["headroom"],
                            "single_arrivals": r["single_arrivals"], "found_none_free": r["found_none_free"],
                            "measured": r["found_none_free"] / r["single_arrivals"],
                            "model": model(n, r["headroom"])["none_free"],
                            "batch_vs_fifo": r["batch_vs_fifo"]["median"]})
    return out


def check_table(rows: list[dict[str, Any]]) -> str:
    out = ["| engines | K | model: (1 - rho) rho^K / (1 - rho^(K+1)) | measured, the flood as two tenants | "
           "measured, as one | batch vs FIFO (median), two / one |", "|---|---:|---:|---:|---:|---:|"]
    by = {(r["servers"], r["headroom"], r["flood_tenants"]): r for r in rows}
    for (n, k, t), r in by.items():
        if t != 2:
            continue
        one = by.get((n, k, 1))
        o = f"{100 * one['measured']:.2f} % ({one['found_none_free']} of {one['single_arrivals']})" if one else "-"
        ob = f"{100 * one['batch_vs_fifo']:.1f} %" if one else "-"
        out.append(f"| {n} | {k} | {100 * r['model']:.3f} % | {100 * r['measured']:.2f} % ({r['found_none_free']} of "
                   f"{r['single_arrivals']}) | {o} | {100 * r['batch_vs_fifo']:.1f} % / {ob} |")
    return "\n".join(out)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (default 10)")
    ap.add_argument("--servers", default="1,2,4", help="fleet sizes: engines of 32 slots (default 1,2,4)")
    ap.add_argument("--headroom", default="1,2,3,4,5,6,7,8", help="the K of the rows (default 1..8)")
    ap.add_argument("--steps", type=int, default=None, help="run length (default the scenario's, 12,000)")
    ap.add_argument("--no-study", action="store_true", help="only the scenario as it is")
    ap.add_argument("--no-check", action="store_true", help="not the model's check without bursts")
    ap.add_argument("--check-headroom", default="1,2,3,4", help="the K of the check (default 1..4)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--json", default=str(HERE / "results" / "headroom-sim.json"))
    a = ap.parse_args(argv)
    ks, servers = _ints(a.headroom), _ints(a.servers)
    t0 = time.monotonic()
    doc: dict[str, Any] = {"benchmark": "bench_headroom_sim", "seeds": a.seeds, "headroom": list(ks),
                           "steps": a.steps or 12_000, "servers": list(servers), "slots_per_engine": ENGINE_SLOTS,
                           "variants": [], "fleets": []}
    for i, n in enumerate(servers):
        t1 = time.monotonic()
        study = STUDY[:1] if a.no_study or i else STUDY  # the study: on the first fleet size only
        for label, objective, burst in study:
            rows = sweep(a.seeds, ks, objective, burst, a.steps, n)
            doc["variants"].append({"label": label, "servers": n, "objective_s": objective, "burst": burst,
                                    "rows": rows})
            if (objective, burst) == STUDY[0][1:]:
                doc["fleets"].append({"servers": n, "slots": n * ENGINE_SLOTS, "goals": goals(rows),
                                      "model": model_rows(rows, n, objective, burst)})
            print(f"\n**{label}, {n} engine{'s' if n > 1 else ''} of {ENGINE_SLOTS} slots**: medians over seeds "
                  f"0-{a.seeds - 1} (worst seed)\n")
            print(table(rows), flush=True)
        doc["fleets"][-1]["wall_s"] = round(time.monotonic() - t1, 1)
    print("\n**The goals per fleet size** (99 % of the interactive class within 1 s; the batch class at 90 % of "
          "FIFO's service; K = 0 is sfq-edf)\n")
    print(goals_table(doc["fleets"]))
    print("\n**The model against the runs** (bursts of 8, objective 1 s; over all the seeds)\n")
    print(model_table(doc["fleets"]), flush=True)
    if not a.no_check:
        t1 = time.monotonic()
        doc["check"] = check(a.seeds, servers, _ints(a.check_headroom), a.steps)
        doc["check_wall_s"] = round(time.monotonic() - t1, 1)
        print("\n**A lone arrival finding none of the K slots free** (no bursts; over all the seeds)\n")
        print(check_table(doc["check"]), flush=True)
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    print(f"\nwall {doc['wall_s']} s")
    if not a.no_save:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def test_bench_headroom_sim_smoke() -> None:
    """A tiny version (CI's benchmark smoke run): every row, nothing asserted on the figures
    but their range."""
    rows = sweep(2, (2,), steps=800)
    assert [r["policy"] for r in rows] == ["sfq-edf", "sfq-edf-headroom-2"]
    for r in rows:
        assert 0.0 <= r["attainment"]["worst"] <= r["attainment"]["median"] <= 1.0
        assert r["batch_vs_fifo"]["median"] > 0
        assert 0 <= r["found_none_free"] <= r["single_arrivals"]
    assert table(rows).count("\n") == 3
    two = sweep(1, (2,), steps=800, servers=2)
    fleets = [{"servers": n, "slots": 32 * n, "goals": goals(rs), "model": model_rows(rs, n)}
              for n, rs in ((1, rows), (2, two))]
    assert goals_table(fleets).count("\n") == 3 and model_table(fleets).count("\n") == 5
    c = check(1, (1,), (2,), steps=800)
    assert [(r["flood_tenants"], r["headroom"]) for r in c] == [(2, 2), (1, 2)]
    assert check_table(c).count("\n") == 2
    m1, m2 = model(1, 0), model(2, 0)
    assert m2["freed"] == 2 * m1["freed"] and m2["burst_misses"] < m1["burst_misses"] and model(1, 2)["none_free"] < 0.01


if __name__ == "__main__":
    sys.exit(main())
