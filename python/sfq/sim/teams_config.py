"""A policy file in the simulator: ``sfq simulate teams --config FILE``.

The file runs on :class:`~sfq.sim.adapter.EngineDiscipline`, the same
:class:`~sfq.engine.PolicyEngine` as ``sfq serve``: classification is the simulator's flow
names (``org/class``); ordering, the charge mode (``cost.charge``), the estimator (the
file's ``cost`` section), limits, queue ages and size buckets are the policy's. The
simulated fleet places the requests (its servers, KV budgets and batch slots stand for the
pool's backends), so the pool's backend list is replaced by one virtual backend without a
slot limit; the pool's own ``limits``, every org and class limit, and the rate buckets
apply as written. Time: the simulator's minute is 2,000 decode steps, so one second is
2000/60 steps (queue ages, deadlines and per-minute rates are converted with it).

The teams scenario's flows are ``team-a/batch`` (a dump of long batch jobs at step 0),
``team-b/interactive`` (short requests at a steady rate) and ``team-c/batch`` (bursts); the
file must give those orgs those classes (``docs/policy-teams.yaml`` does). Requests go to the
file's first pool. Refused and dropped requests never start in the simulation and are
counted per team.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..policy.classify import Flow
from ..policy.config import Policy
from .adapter import STEPS_PER_SECOND, EngineDiscipline

__all__ = ["STEPS_PER_SECOND", "run_teams_config", "teams_flows"]


def teams_flows(policy: Policy, names: Sequence[str]) -> list[Flow]:
    """Map the simulator's ``org/class`` flow names to the policy's flows (its first pool)."""
    pool = next(iter(policy.pools))
    out = []
    for name in names:
        org, _, cls = name.partition("/")
        o = policy.org(org)
        if o is None or cls not in o.classes:
            raise ValueError(f"the teams scenario's flow {name!r} needs org {org!r} with class {cls!r} in the policy "
                             f"file (orgs: {', '.join(policy.orgs)}); see docs/policy-teams.yaml")
        out.append(Flow(org, cls, pool))
    return out


def run_teams_config(policy: Policy, *, seed: int = 0, steps: int | None = None, servers: int | None = None,
                     kv_budget: int | None = None, slots: int | None = None, w_p: float = 1.0, w_q: float = 2.0,
                     prior: float = 0.5, compare: Sequence[str] = ("fifo", "prio", "sfq")) -> dict[str, Any]:
    """Run the teams workload under the policy file and, for comparison, the simulator's
    ``compare`` policies, on the same fleet; one JSON-able document."""
    from . import Fleet, Simulation, make_estimator, make_policy, wait_quantiles
    from .scenarios import teams_workload

    steps = steps or 12_000
    fleet = Fleet(servers=servers or 8, kv_budget=kv_budget or 8192, max_batch=slots or 1)
    wl = teams_workload(seed, steps)
    flows = teams_flows(policy, [f.name for f in wl.flows])
    rows = []
    for label in ("policy-file", *compare):
        pol: Any = EngineDiscipline(policy, flows) if label == "policy-file" else make_policy(label)
        res = Simulation(wl, pol, fleet, w_p=w_p, w_q=w_q, horizon=steps,
                         estimator=make_estimator(w_p, w_q, prior)).run()
        final = res.final_service()
        total = float(final.sum())
        teams = {}
        for f, spec in enumerate(wl.flows):
            p50, p95, p99 = wait_quantiles(res, f)
            m = (res.flow == f) & (res.arrival < res.end)
            team = spec.name.split("/")[0]
            teams[team] = {
                "flow": spec.name, "wait_p50": p50, "wait_p95": p95, "wait_p99": p99,
                "cost_share": float(final[f] / total) if total > 0 else None,
                "submitted": int(m.sum()), "completed": int((m & (res.finish >= 0)).sum()),
                "refused": pol.refused.get(team, 0) if label == "policy-file" else 0,
                "dropped": pol.dropped.get(team, 0) if label == "policy-file" else 0,
            }
        rows.append({"policy": label, "teams": teams})
    return {"scenario": "teams", "config": policy.source, "seed": seed, "steps": steps,
            "fleet": {"servers": fleet.servers, "kv_budget": fleet.kv_budget, "slots": fleet.max_batch},
            "steps_per_second": STEPS_PER_SECOND, "results": rows}


def render(doc: dict[str, Any]) -> str:
    """The document as a plain table: per policy and team, waits (steps), share, completions."""
    head = ["policy", "team", "wait p50", "p95", "p99", "cost share", "completed/submitted", "refused", "dropped"]
    lines = []
    for row in doc["results"]:
        for team, t in row["teams"].items():
            def f(x: float | None) -> str:
                return "-" if x is None else f"{x:.0f}"
            share = "-" if t["cost_share"] is None else f"{t['cost_share']:.1%}"
            lines.append([row["policy"], team, f(t["wait_p50"]), f(t["wait_p95"]), f(t["wait_p99"]), share,
                          f"{t['completed']}/{t['submitted']}", str(t["refused"]), str(t["dropped"])])
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    out = [f"teams under {doc['config']} (seed {doc['seed']}, {doc['steps']} steps, {doc['fleet']['servers']} servers; "
           "waits in decode steps)", "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in lines]
    return "\n".join(out) + "\n"


def main_teams_config(args: Any, parser: Any) -> int:
    """``sfq simulate teams --config FILE`` (called by ``sfq.cli``): prints a table, or one JSON
    document with ``--json``. Exit status 1 for an invalid file, 2 when it cannot be read."""
    import json
    import sys

    from ..errors import PolicyError
    from ..policy.config import load_policy

    if args.scenario != "teams":
        parser.error("--config runs a policy file in the teams scenario: sfq simulate teams --config FILE")
    try:
        policy = load_policy(args.config)
    except PolicyError as exc:
        sys.stderr.write(f"sfq simulate: {args.config}: {exc}\n")
        return 1
    except (OSError, UnicodeDecodeError) as exc:
        sys.stderr.write(f"sfq simulate: cannot read {args.config}: {exc}\n")
        return 2
    compare: list[str] = []
    for v in args.policy or ["fifo,prio,sfq"]:
        compare += [n.strip() for n in v.split(",") if n.strip()]
    try:
        doc = run_teams_config(policy, seed=args.seed, steps=args.steps, servers=args.servers,
                               kv_budget=args.kv_budget, slots=args.slots, w_p=args.w_p, w_q=args.w_q,
                               prior=args.prior, compare=compare)
    except ValueError as exc:
        sys.stderr.write(f"sfq simulate: error: {exc}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    else:
        sys.stdout.write(render(doc))
    return 0
