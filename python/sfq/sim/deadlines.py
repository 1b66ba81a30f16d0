"""The ``deadlines`` scenario of ``sfq simulate``: service levels inside fair shares.

One engine of 32 slots by default (KV large enough that the slots bind; ``--servers N`` makes
it N such engines in one pool, ``--slots`` their slots), three tenants for ``steps`` steps
(default 12,000, six simulated minutes at 2,000 steps a minute):

* ``app``: the interactive class, weight 1. Poisson arrivals at 0.01 per step (one every
  3 s) and a burst of ``burst`` requests every 1,500 steps or so (a page that fans out);
  prompts U[50, 300], answers U[10, 60] tokens. The class's time-to-first-token objective
  is ``objective`` seconds (default 1 s); half its requests carry a deadline of their own of
  the objective (a user waiting on a chat), the others the class's ``deadline_seconds``
  (default 3 x the objective: tool calls that can wait a little).
* ``batch-1``, ``batch-2``: the batch class, weight 1 each, flooding (Poisson at 0.15 per
  step each on one engine of 32 slots, about twice its capacity together: 32 slots turn over
  at 32 / 200 = 0.16 requests a step); prompts U[100, 600], answers U[50, 350] tokens;
  objective 60 s, no deadline.

On a larger fleet the flood grows with it and the quiet tenant does not: each batch tenant's
rate is 0.15 x (the fleet's slots / 32) (0.30 a step on two engines of 32, 0.60 on four), so
the batch class still offers about twice the fleet's capacity, while the interactive tenant's
arrivals and bursts stay as on one engine (a quiet tenant stays quiet). On one engine of 32
slots the workload is exactly the one-engine scenario's.

Policies: ``fifo`` (one queue), ``prio`` (strict priority: the interactive class first),
``sfq`` (the engine that ``sfq serve`` runs, under a policy of the three orgs and the two
classes, no deadlines) and ``sfq-edf`` (the same engine and policy with the interactive
class's ``deadline_seconds`` and the requests' own deadlines: earliest deadline first inside
a flow, docs/design.md §5d, after Liu and Layland 1973; SFQ between flows after Goyal, Vin
and Cheng 1996; a request whose deadline passed is dropped, not started), always run, and
``sfq-edf-headroom-K`` for each K of ``headroom`` (default :data:`DEFAULT_HEADROOM`), always
run: ``sfq-edf`` with the pool's ``limits.headroom: K`` and ``max_in_flight`` the fleet's
slots (the engine counts the slots kept against the pool's, the simulated fleet still places):
while no more than K slots are free, only a flow with nothing running or below its part of the
others may take one, so a burst finds K slots at once instead of waiting for slots to free.

Per class: the objective attainment (the share of the class's requests that arrived in the
run whose first token came within the objective; a request dropped or never started counts
as a miss), the share started before their own deadline (``in_time``), TTFT p50/p99 of
those started (seconds), and the batch class's service (weighted tokens) relative to
FIFO's. The first token comes one decode step after a request starts (a step is one token
of every running request; prefill is not modelled).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .adapter import SIM_MODEL, STEPS_PER_SECOND, EngineDiscipline
from .engine import Fleet, RunResult, Simulation
from .estimate import make_estimator
from .model import FlowSpec, Workload
from .workloads import Bursts, FlowLoad, Poisson, Sizes, build_workload

__all__ = ["DEADLINE_POLICIES", "DEFAULT_HEADROOM", "deadlines_workload", "run_deadlines"]

DEADLINE_POLICIES = ("fifo", "prio", "sfq", "sfq-edf")
#: the pool's ``limits.headroom`` of the ``sfq-edf-headroom-K`` rows (always run): 3, the most
#: slots of 32 kept whose cost stays within the batch class's 90 % of FIFO's service (3 / 32 <
#: 10 %), and 5, the fewest that bring the interactive class's attainment to 99 % (median of
#: seeds 0-9; docs/policy.md "Deadlines and service levels")
DEFAULT_HEADROOM = (3, 5)
#: the interactive tenant's Poisson arrivals a step (besides its bursts), whatever the fleet
APP_RATE = 0.01
#: a batch tenant's arrivals a step per 32 slots of the fleet (:data:`ENGINE_SLOTS`)
BATCH_RATE = 0.15
#: the slots of the scenario's engine (the fleet's slots over this scale the flood)
ENGINE_SLOTS = 32
APP_SIZES = Sizes(prompt=(50, 300), output=(10, 60), max_tokens=64)
BATCH_SIZES = Sizes(prompt=(100, 600), output=(50, 350), max_tokens=384)
BATCH_OBJECTIVE = 60.0  # seconds


def deadlines_workload(seed: int, steps: int, burst: int = 8, app_rate: float = APP_RATE,
                       batch_rate: float = BATCH_RATE, flood_tenants: int = 2) -> Workload:
    """The scenario's arrivals: ``app/interactive`` (flow 0), ``batch-1/batch``, ``batch-2/batch``.
    ``flood_tenants=1``: the same arrivals, both batch tenants' requests in ``batch-1``'s flow."""
    if flood_tenants not in (1, 2):
        raise ValueError(f"flood_tenants must be 1 or 2, got {flood_tenants!r}")
    app = [FlowLoad(FlowSpec("app/interactive", 1.0, "interactive", 0), Poisson(app_rate, 0, steps), APP_SIZES)]
    if burst > 0:
        app.append(FlowLoad(FlowSpec("app/burst", 1.0, "interactive", 0),
                            Bursts(burst, 1500, 500, steps, jitter=500), APP_SIZES))
    loads = [*app, *(FlowLoad(FlowSpec(f"batch-{k}/batch", 1.0, "batch", 1), Poisson(batch_rate, 0, steps),
                              BATCH_SIZES) for k in (1, 2))]
    wl = build_workload(seed, loads)
    if burst > 0:  # the burst's requests are the app's own: one flow
        wl = _merge_flows(wl, {1: 0, 2: 1, 3: 2})
    if flood_tenants == 1:
        wl = _merge_flows(wl, {2: 1})
    return wl


def _merge_flows(wl: Workload, to: dict[int, int]) -> Workload:
    """``wl`` with load ``k``'s requests in flow ``to[k]`` (the loads of one tenant as one flow)."""
    flows: list[FlowSpec] = []
    for k, spec in enumerate(wl.flows):
        if to.get(k, k) == len(flows):
            flows.append(spec)
    mapped = np.array([to.get(int(f), int(f)) for f in wl.flow], dtype=np.int64)
    return Workload.from_arrays(flows, wl.arrival, mapped, wl.prompt, wl.output, wl.max_tokens, meta=wl.meta)


def _policy(objective: float, deadline: float | None, headroom: int = 0, slots: int | None = None) -> Any:
    from ..policy.config import policy_from_mapping
    from .adapter import _POOL

    pool: dict[str, Any] = {"models": [SIM_MODEL], "backends": [{"url": "http://simulated.invalid"}]}
    if headroom:  # the engine counts the fleet's slots through the pool's max_in_flight
        pool["limits"] = {"max_in_flight": slots, "headroom": headroom}
    interactive: dict[str, Any] = {"small_cost": None, "ttft_objective_seconds": objective}
    if deadline is not None:
        interactive["deadline_seconds"] = deadline
    return policy_from_mapping({
        "pools": {_POOL: pool},
        "classes": {"interactive": interactive,
                    "batch": {"small_cost": None, "ttft_objective_seconds": BATCH_OBJECTIVE}},
        "orgs": {"app": {"classes": ["interactive"]}, "batch-1": {"classes": ["batch"]},
                 "batch-2": {"classes": ["batch"]}},
        "cost": {"input_weight": 1.0, "output_weight": 2.0, "prior_ratio": 0.5, "charge": "served"},
    }, source="<deadlines scenario>")


def _discipline(wl: Workload, name: str, objective: float, own: dict[int, float], core: Any,
                headroom: int = 0, slots: int | None = None) -> Any:
    from ..policy.classify import Flow
    from .adapter import _POOL
    from .policies import make_policy

    if name in ("fifo", "prio"):
        return make_policy(name)
    edf = name in ("sfq-edf", "sfq-edf-headroom")
    policy = _policy(objective, 3.0 * objective if edf else None,
                     headroom if name == "sfq-edf-headroom" else 0, slots)
    flows = [Flow(f.name.split("/")[0], f.klass, _POOL) for f in wl.flows]
    return EngineDiscipline(policy, flows, scheduler=core, label=name, run_estimator=True,
                            deadlines=own if edf else None)


def _own_deadlines(wl: Workload, seed: int, objective: float) -> dict[int, float]:
    """Half the app's requests (seeded) carry a deadline of their own: the objective."""
    rng = np.random.default_rng([int(seed), 4242])
    app = np.flatnonzero(wl.flow == 0)
    pick = app[rng.random(app.size) < 0.5]
    return {int(r): objective for r in pick}


def _class_row(res: RunResult, flows: Sequence[int], objective: float, own: dict[int, float] | None,
               default_deadline: float | None) -> dict[str, Any]:
    m = np.isin(res.flow, flows) & (res.arrival < res.end)
    idx = np.flatnonzero(m)
    started = res.admit[idx] >= 0
    ttft = (res.admit[idx] - res.arrival[idx] + 1) / STEPS_PER_SECOND
    within = started & (ttft <= objective + 1e-9)
    if own is not None:
        dl = np.array([own.get(int(r), default_deadline if default_deadline is not None else np.inf) for r in idx])
        in_time = started & (ttft - 1 / STEPS_PER_SECOND < dl)
    else:
        in_time = started
    done = ttft[started]
    return {
        "requests": int(idx.size),
        "started": int(started.sum()),
        "objective": objective,
        "attainment": float(within.mean()) if idx.size else None,
        "in_time": float(in_time.mean()) if idx.size else None,
        "ttft_p50": float(np.percentile(done, 50)) if done.size else None,
        "ttft_p99": float(np.percentile(done, 99)) if done.size else None,
    }


def run_deadlines(opts: Any, policies: Sequence[str] | None = None, progress: Any = None,
                  objective: float = 1.0, burst: int = 8, flood_tenants: int = 2) -> Any:
    """The scenario under ``opts`` (``seed``, ``steps``, ``servers``, ``slots``, ``headroom``);
    ``objective`` (s) and ``burst`` as in the module docstring; ``flood_tenants=1`` puts both
    batch tenants' requests in one flow (the same arrivals: ``benchmarks/bench_headroom_sim.py``
    checks what the flood's split does to the slots kept)."""
    from .scenarios import Progress, ScenarioResult, _common_params, _fleet, _fleet_params, _row

    progress = progress or Progress()
    steps = opts.steps or 12_000
    fleet = _fleet(opts, 1, 1 << 22, ENGINE_SLOTS)
    slots = fleet.servers * fleet.max_batch if fleet.max_batch is not None else None
    headroom = tuple(getattr(opts, "headroom", None) or DEFAULT_HEADROOM)
    if slots is None or any(k >= slots for k in headroom):
        raise ValueError(f"deadlines: headroom {headroom} must be below the fleet's slots ({slots})")
    # the flood grows with the fleet (twice its capacity), the interactive tenant does not
    batch_rate = BATCH_RATE * (slots / ENGINE_SLOTS)
    wl = deadlines_workload(opts.seed, steps, burst=burst, batch_rate=batch_rate, flood_tenants=flood_tenants)
    wanted = [n for n in (policies or DEADLINE_POLICIES) if n in DEADLINE_POLICIES]
    names = [n for n in DEADLINE_POLICIES if n in wanted or n in ("fifo", "sfq-edf")]  # fifo: the baseline
    runs_of = [(n, 0) for n in names] + [(f"sfq-edf-headroom-{k}", k) for k in headroom]  # (always)
    own = _own_deadlines(wl, opts.seed, objective)
    default_deadline = 3.0 * objective
    params = {**_common_params(opts), "steps": steps, **_fleet_params(fleet), "requests": len(wl),
              "objective_s": {"interactive": objective, "batch": BATCH_OBJECTIVE},
              "deadline_seconds": default_deadline, "own_deadlines": len(own), "burst": burst,
              "batch_rate": batch_rate, "flood_tenants": flood_tenants,
              "headroom": list(headroom), "steps_per_second": STEPS_PER_SECOND,
              "policies": [n for n, _ in runs_of]}
    runs, rows = [], []
    batch_service: dict[str, float] = {}
    for n, k in runs_of:
        disc = _discipline(wl, "sfq-edf-headroom" if k else n, objective, own, opts.core, k, slots)
        cb = progress.begin(n, steps)
        try:
            res = Simulation(wl, disc, fleet, w_p=opts.w_p, w_q=opts.w_q, horizon=steps,
                             estimator=make_estimator(opts.w_p, opts.w_q, opts.prior), progress=cb).run()
        finally:
            progress.end()
        res.policy = n
        runs.append((n, res))
        final = res.final_service()
        batch_service[n] = float(final[1:].sum())
        classes = {
            "interactive": _class_row(res, [0], objective, own, default_deadline),
            "batch": _class_row(res, [1, 2], BATCH_OBJECTIVE, None, None),
        }
        rows.append(_row("deadlines", res, classes=classes, headroom=k,
                         dropped=sum(getattr(disc, "dropped", {}).values())))
    for r in rows:
        base = batch_service.get("fifo")
        r["batch_vs_fifo"] = batch_service[r["policy"]] / base if base else None
    return ScenarioResult("deadlines", params, rows, runs)
