"""The simulator's fairness goals, measured (docs/simulator.md §7): ``python -m sfq.sim.goals [--seeds 0-4] [--markdown]``.

Runs the scenarios of ``sfq simulate`` for each seed (drift, return, shallow, keep-one)
with ``sfq`` in each charge mode, ``sfq-seed``, VTC, lcf and FIFO, and reports the medians
over the seeds; with ``--long`` also ``shallow`` run to 160,000 steps (the drift up to
10,000, 40,000 and 160,000 steps: does it stay bounded?). Deterministic: the same seeds give the same table (the wall time of the
``many`` run is measured separately, by the caller, and is not part of it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Sequence

from .metrics import max_drift
from .policies import CHARGE_MODES
from .scenarios import Options, run_scenario

#: the long shallow run: its length and the steps the drift is measured to
LONG_STEPS = 160_000
LONG_MARKS = (10_000, 40_000, 160_000)

__all__ = ["measure", "markdown"]

#: (scenario, metric key, goal text, test on the sfq value given VTC's)
GOALS = (
    ("drift", "max_drift", "delivered drift at most 2x VTC's"),
    ("return", "returning_share", "returning client >= 47% of the service after its return"),
    ("shallow", "max_drift", "two clients keeping one request waiting: drift <= 20k at 40k steps, not growing"),
    ("keep-one", "keeper_share", "client keeping one request waiting vs a flooder: >= 46% of the service"),
)


def _two_flow_drift(res: Any, t1: int) -> float:
    d = max_drift(res, None, t1)
    assert d is not None  # two flows: always computed
    return d


def _variants() -> list[tuple[str, str, str | None]]:
    """(label, policy, charge)."""
    out: list[tuple[str, str, str | None]] = [(f"sfq {c}", "sfq", c) for c in CHARGE_MODES]
    return out + [("sfq-seed", "sfq-seed", None), ("vtc", "vtc", None), ("lcf", "lcf", None), ("fifo", "fifo", None)]


def measure(seeds: Sequence[int], long: bool = False) -> dict[str, Any]:
    """Per goal scenario and variant: the metric for each seed and the median; for
    ``shallow`` also the drift at a quarter, half and all of the run; ``long``: also
    ``shallow-long``, the drift up to each of ``LONG_MARKS`` in one run of ``LONG_STEPS``."""
    out: dict[str, Any] = {}
    if long:
        per_long: dict[str, Any] = {}
        for label, pol, charge in _variants():
            if pol == "fifo" or pol == "sfq-seed":
                continue  # they grow linearly: the 40,000-step run shows it
            at_long: list[dict[str, float]] = []
            for seed in seeds:
                res = run_scenario("shallow", Options(seed=seed, steps=LONG_STEPS, charge=charge), [pol]).runs[0][1]
                at_long.append({str(m): _two_flow_drift(res, m) for m in LONG_MARKS})
            per_long[label] = {"values": at_long,
                               "median": {m: statistics.median(a[m] for a in at_long) for m in at_long[0]}}
        out["shallow-long"] = per_long
    for scenario, key, _ in GOALS:
        per: dict[str, Any] = {}
        for label, pol, charge in _variants():
            vals: list[float] = []
            at: list[dict[str, float]] = []
            for seed in seeds:
                row = run_scenario(scenario, Options(seed=seed, charge=charge), [pol]).results[0]
                vals.append(row[key])
                if scenario == "shallow":
                    at.append(row["drift_at"])
            entry: dict[str, Any] = {"values": vals, "median": statistics.median(vals)}
            if at:
                entry["drift_at_median"] = {m: statistics.median(a[m] for a in at) for m in at[0]}
            per[label] = entry
        out[scenario] = per
    return out


def markdown(doc: dict[str, Any]) -> str:
    labels = [v[0] for v in _variants()]
    head = "| scenario (metric) | " + " | ".join(labels) + " |"
    lines = [head, "|" + "---|" * (len(labels) + 1)]
    for scenario, key, _ in GOALS:
        per = doc[scenario]
        pct = key.endswith("share")
        cells = [f"{100 * per[x]['median']:.1f}%" if pct else f"{per[x]['median']:,.0f}" for x in labels]
        lines.append(f"| {scenario} ({key}) | " + " | ".join(cells) + " |")
        if scenario == "shallow":
            for m in per[labels[0]]["drift_at_median"]:
                cells = [f"{per[x]['drift_at_median'][m]:,.0f}" for x in labels]
                lines.append(f"| shallow, drift to step {int(m):,} | " + " | ".join(cells) + " |")
    if "shallow-long" in doc:
        per = doc["shallow-long"]
        for m in (str(x) for x in LONG_MARKS):
            cells = [f"{per[x]['median'][m]:,.0f}" if x in per else "-" for x in labels]
            lines.append(f"| shallow ({LONG_STEPS:,} steps), drift to step {int(m):,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sfq.sim.goals", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-4", help="seeds, as LO-HI (default 0-4)")
    ap.add_argument("--markdown", action="store_true", help="print the README table instead of JSON")
    ap.add_argument("--long", action="store_true", help=f"also run shallow to {LONG_STEPS:,} steps (minutes)")
    args = ap.parse_args(argv)
    lo, _, hi = args.seeds.partition("-")
    try:
        seeds = list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        ap.error(f"--seeds must be LO-HI, got {args.seeds!r}")
    doc = measure(seeds, args.long)
    sys.stdout.write((markdown(doc) if args.markdown else json.dumps(doc, indent=1)) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
