"""Issue 12's goals, measured: ``python -m sfq.sim.goals [--seeds 0-4] [--markdown]``.

Runs the scenarios of ``sfq simulate`` for each seed (drift, return, shallow, keep-one,
many) with ``sfq`` in each charge mode, ``sfq-seed`` and VTC, and reports the medians
over the seeds. Deterministic: the same seeds give the same table (the wall time of the
``many`` run is measured separately, by the caller, and is not part of it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Sequence

from .policies import CHARGE_MODES
from .scenarios import Options, run_scenario

__all__ = ["measure", "markdown"]

#: (scenario, metric key, goal text, test on the sfq value given VTC's)
GOALS = (
    ("drift", "max_drift", "delivered drift at most 2x VTC's"),
    ("return", "returning_share", "returning client >= 47% of the service after its return"),
    ("shallow", "max_drift", "two clients keeping one request waiting: drift <= 20k at 40k steps, not growing"),
    ("keep-one", "keeper_share", "client keeping one request waiting vs a flooder: >= 46% of the service"),
)


def _variants() -> list[tuple[str, str, str | None]]:
    """(label, policy, charge)."""
    out: list[tuple[str, str, str | None]] = [(f"sfq {c}", "sfq", c) for c in CHARGE_MODES]
    return out + [("sfq-seed", "sfq-seed", None), ("vtc", "vtc", None), ("lcf", "lcf", None), ("fifo", "fifo", None)]


def measure(seeds: Sequence[int]) -> dict[str, Any]:
    """Per goal scenario and variant: the metric for each seed and the median; for
    ``shallow`` also the drift at a quarter, half and all of the run."""
    out: dict[str, Any] = {}
    for scenario, key, _ in GOALS:
        per: dict[str, Any] = {}
        for label, pol, charge in _variants():
            vals, at = [], []
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
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sfq.sim.goals", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-4", help="seeds, as LO-HI (default 0-4)")
    ap.add_argument("--markdown", action="store_true", help="print the README table instead of JSON")
    args = ap.parse_args(argv)
    lo, _, hi = args.seeds.partition("-")
    try:
        seeds = list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        ap.error(f"--seeds must be LO-HI, got {args.seeds!r}")
    doc = measure(seeds)
    sys.stdout.write((markdown(doc) if args.markdown else json.dumps(doc, indent=1)) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
