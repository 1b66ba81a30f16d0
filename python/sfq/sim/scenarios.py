"""The scenarios of ``sfq simulate`` (docs/simulator.md §5).

Each scenario builds its workload once from the seed, runs every chosen policy on it and
returns a :class:`ScenarioResult`: ``params`` (everything that determines the run),
``results`` (one row of metrics per run, the JSON document's rows) and the runs
themselves for the plots. Units: steps, tokens, weighted tokens (``w_p``, ``w_q``).

``drift``      two clients, both over their fair share from step 0 (Poisson at 0.9 and 0.6
               of the engine's capacity), M = 8192: max drift, throughput, Jain.
``return``     client 0 under its share (0.3 C) for 3000 steps, silent for 2000, back
               overloaded (1.2 C); client 1 at 1.2 C throughout; the 600 steps after the
               return: the returning client's share of the service delivered and of the
               estimated cost started, and the steady client's service.
               (C: the engine's capacity in requests per step, see ``workloads.capacity``.)
``kv-sweep``   ``drift`` for M = 2048 ... 32768 against the bound 2 max(w_p L_input, w_q M).
``rpm-sweep``  ``drift`` under FIFO with per-client limits of 5, 20, 40, 80 requests per
               "minute" (2000 steps) and none, beside the fair policies without limits.
``teams``      multi-team overload: team A drops 400 long batch jobs at step 0, team B sends short
               interactive requests (Poisson, 1 per 20 steps) from step 300, team C sends a
               burst of 24 every 2500 steps or so from step 1000; 8 slots (8 servers x 1);
               weights interactive 6, batch 1; strict priority ranks interactive first.
``shallow``    two clients that each keep one request waiting at the balancer (closed
               loop, the default sizes), M = 8192, 40,000 steps: the drift at 1/4, 1/2
               and all of the run (bounded, or growing with the run like FIFO's).
``keep-one``   client 0 keeps one request waiting, client 1 floods (Poisson at 1.2 C),
               20,000 steps: client 0's share of the service.
``many``       1,000 clients sending 5 requests each at uniform times in the first 5,000
               steps, 8 servers, run to completion: the cost of many flows.
``trace``      a JSONL trace (see :mod:`sfq.sim.model`) on the fleet given by the options.
``nested``     one org's two teams: t1 of ten users, t2 of one, every user a closed-loop
               client keeping two requests waiting, 20,000 steps: each team's and user's
               share under flat per-user SFQ (t1 gets 10/11) and under nested shares
               (``teams`` + ``users: equal``: each team 1/2, each t1 user 1/20).
``deadlines``  an interactive class with a TTFT objective and deadlines beside a batch flood on
               one 32-slot engine (``--servers N``: N of them, the flood N times as large, the
               interactive class as it is): per class the objective attainment, and the batch
               service against FIFO's, for fifo, prio, sfq, sfq-edf and sfq-edf with the pool's
               ``limits.headroom`` (:mod:`sfq.sim.deadlines`).

Every row's ``max_drift`` is the largest gap ``|W_f(a,b)/w_f - W_g(a,b)/w_g|`` between two
flows over an interval in which both have a request waiting at the balancer in every step
(see :mod:`sfq.sim.metrics`; ``None`` above 64 flows); ``max_drift_est`` the same on the
estimated cost charged (the bound of docs/design.md §3.2). For comparison only:
``max_drift_from_start``, the gap from the start over the flows busy (work waiting or
running) for the whole run (``drift_flows`` says how many), and ``max_interval_drift``, the
interval form restarting whenever a flow has nothing waiting or running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .engine import Fleet, RunResult, Simulation
from .estimate import make_estimator
from .metrics import (drift_set, flow_summary, jain_index, max_drift, max_drift_from_start, max_interval_drift,
                      service_at, throughput, wait_quantiles)
from .model import ClosedLoop, FlowSpec, Workload, load_trace
from .policies import CHARGE_MODES, POLICIES, make_policy
from .workloads import Batch, Bursts, FlowLoad, Phases, Poisson, Sizes, Uniform, build_workload, capacity

__all__ = [
    "Options",
    "Progress",
    "ScenarioResult",
    "SCENARIOS",
    "DEFAULT_POLICIES",
    "run_scenario",
    "run_headline",
    "workload_for",
]

#: the default request sizes (docs/simulator.md §5): prompts U[64, 512], outputs U[32, 384], max_tokens 384
DEFAULT_SIZES = Sizes(prompt=(64, 512), output=(32, 384), max_tokens=384)

ALL_FAIR = ("fifo", "rr", "drr", "wfq", "sfq", "sfq-seed", "lcf", "vtc")
DEFAULT_POLICIES: dict[str, tuple[str, ...]] = {
    "drift": ALL_FAIR,
    "return": ALL_FAIR,
    "kv-sweep": ALL_FAIR,
    "rpm-sweep": ("fifo", "vtc", "sfq"),
    "teams": ("fifo", "prio", "rr", "drr", "wfq", "sfq", "sfq-seed", "lcf", "vtc"),
    "shallow": ("fifo", "sfq", "sfq-seed", "lcf", "vtc"),
    "keep-one": ("fifo", "sfq", "sfq-seed", "lcf", "vtc"),
    "many": ALL_FAIR,
    "trace": ALL_FAIR,
    "nested": ("fifo", "sfq"),  # (and sfq-nested, always)
    "deadlines": ("fifo", "prio", "sfq"),  # (and sfq-edf and sfq-edf-headroom-K, always)
}
KV_SWEEP = (2048, 4096, 8192, 16384, 32768)
RPM_SWEEP = (5, 20, 40, 80, None)


@dataclass
class Options:
    """Knobs shared by the scenarios; ``None`` means the scenario's own default.

    ``steps``: run length (drift, kv-sweep, rpm-sweep, teams; for ``return`` the length
    of the first phase; for ``trace`` a horizon). ``kv_budget`` (tokens per server),
    ``servers``, ``slots`` (max running requests per server), ``quantum`` (DRR, weighted
    tokens), ``beta`` (vtc-h), ``w_p``/``w_q`` (service weights of prompt/output
    tokens), ``prior`` (the estimator's output/max_tokens ratio before any completion),
    ``rpm_window`` (steps per "minute"), ``trace``/``weights`` (trace replay), ``core``
    (the scheduler class behind ``sfq``; default ``sfq.Scheduler``), ``charge`` (the
    ``sfq`` policy's charge mode, ``seed``/``settle``/``served``; default the library's),
    ``headroom`` (deadlines: the pool's ``limits.headroom`` of each ``sfq-edf-headroom-K``
    row; default :data:`sfq.sim.deadlines.DEFAULT_HEADROOM`).
    """

    seed: int = 0
    steps: int | None = None
    kv_budget: int | None = None
    servers: int | None = None
    slots: int | None = None
    quantum: float = 1024.0
    beta: float = 0.01
    w_p: float = 1.0
    w_q: float = 2.0
    prior: float = 0.5
    rpm_window: int = 2000
    trace: str | None = None
    weights: dict[str, float] = field(default_factory=dict)
    core: Any = None
    charge: str | None = None
    headroom: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.charge is not None and self.charge not in CHARGE_MODES:
            raise ValueError(f"unknown charge mode {self.charge!r}; choose from {', '.join(CHARGE_MODES)}")
        if self.headroom is not None:
            if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in self.headroom):
                raise ValueError(f"headroom must be ints >= 1 (slots), got {self.headroom!r}")
            self.headroom = tuple(self.headroom)


class Progress:
    """Told about each run; the CLI draws a progress bar from it. No-op here."""

    def begin(self, label: str, horizon: int | None) -> Callable[[int], None] | None:
        return None

    def end(self) -> None:
        pass


@dataclass
class ScenarioResult:
    scenario: str
    params: dict[str, Any]
    results: list[dict[str, Any]]
    runs: list[tuple[str, RunResult]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def document(self) -> dict[str, Any]:
        """``{"scenario", "params", "results"}`` with floats rounded (the JSON output)."""
        return {"scenario": self.scenario, "params": clean(self.params), "results": clean(self.results)}


def clean(x: Any) -> Any:
    """Plain JSON values: floats rounded to 4 decimals (NaN/inf -> None), tuples -> lists."""
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return int(x)
    try:
        f = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(f) or math.isinf(f):
        return None
    if f.is_integer() and abs(f) < 2**53 and not isinstance(x, float):
        return int(f)
    r = round(f, 4)
    return 0.0 if r == 0 else r


# ---------------------------------------------------------------------- helpers
def _policies(names: Sequence[str] | None, scenario: str) -> list[str]:
    names = list(names) if names else list(DEFAULT_POLICIES[scenario])
    for n in names:
        if n not in POLICIES:
            raise ValueError(f"unknown policy {n!r}; choose from {', '.join(POLICIES)}")
    seen: list[str] = []
    for n in names:
        if n not in seen:
            seen.append(n)
    return seen


def _run(
    workload: Workload,
    name: str,
    fleet: Fleet,
    opts: Options,
    progress: Progress,
    horizon: int | None,
    marks: Sequence[int] = (),
    label: str | None = None,
    **popts: Any,
) -> RunResult:
    policy = make_policy(name, quantum=opts.quantum, beta=opts.beta, core=opts.core, window=opts.rpm_window,
                         charge=opts.charge, **popts)
    cb = progress.begin(label or policy.label, horizon)
    try:
        sim = Simulation(
            workload,
            policy,
            fleet,
            w_p=opts.w_p,
            w_q=opts.w_q,
            horizon=horizon,
            marks=marks,
            estimator=make_estimator(opts.w_p, opts.w_q, opts.prior),
            progress=cb,
        )
        return sim.run()
    finally:
        progress.end()


def bound_of(res: RunResult) -> float:
    """VTC's drift bound ``2 max(w_p L_input, w_q M)``: ``L_input`` the largest
    prompt that ran, ``M`` the fleet's total KV budget (tokens)."""
    started = res.admit >= 0
    l_in = int(res.prompt[started].max()) if started.any() else 0
    m = res.fleet.kv_budget * res.fleet.servers
    return 2.0 * max(res.w_p * l_in, res.w_q * m)


def _row(scenario: str, res: RunResult, rpm: int | None = None, **extra: Any) -> dict[str, Any]:
    drift = max_drift(res)
    bound = bound_of(res)
    label = res.policy.split(" ")
    charge = next((x.split("=", 1)[1] for x in label[1:] if x.startswith("charge=")), None)
    row: dict[str, Any] = {
        "scenario": scenario,
        "policy": label[0],
        "charge": charge,
        "kv_budget": res.fleet.kv_budget,
        "rpm": rpm,
        "max_drift": drift,
        "bound": bound,
        "drift_ratio": drift / bound if bound and drift is not None else None,
        "max_drift_est": max_drift(res, charged=True),
        "max_drift_from_start": max_drift_from_start(res),
        "drift_flows": len(drift_set(res)[0]),
        "max_interval_drift": max_interval_drift(res),
        "throughput": throughput(res),
        "tokens_per_step": throughput(res, raw=True),
        "jain": jain_index(res),
        "returning_share": None,
        "returning_dispatch_share": None,
        "steady_service": None,
    }
    row.update(extra)
    row["flows"] = flow_summary(res)
    row.setdefault("teams", None)
    return row


def _fleet(opts: Options, servers: int, kv: int, slots: int | None) -> Fleet:
    return Fleet(
        servers=opts.servers if opts.servers is not None else servers,
        kv_budget=opts.kv_budget if opts.kv_budget is not None else kv,
        max_batch=opts.slots if opts.slots is not None else slots,
    )


def _fleet_params(fleet: Fleet) -> dict[str, Any]:
    return {"servers": fleet.servers, "kv_budget": fleet.kv_budget, "slots": fleet.max_batch}


def _common_params(opts: Options) -> dict[str, Any]:
    return {"seed": opts.seed, "w_p": opts.w_p, "w_q": opts.w_q, "estimator_prior": opts.prior}


# ---------------------------------------------------------------------- workloads
def drift_workload(seed: int, kv_budget: int, steps: int, servers: int = 1) -> Workload:
    """Two clients over their share from step 0: Poisson at 0.9 C and 0.6 C."""
    c = capacity(kv_budget, DEFAULT_SIZES) * servers
    return build_workload(
        seed,
        [
            FlowLoad(FlowSpec("client-0"), Poisson(0.9 * c, 0, steps), DEFAULT_SIZES),
            FlowLoad(FlowSpec("client-1"), Poisson(0.6 * c, 0, steps), DEFAULT_SIZES),
        ],
        meta={"rates_per_step": [0.9 * c, 0.6 * c]},
    )


def return_workload(seed: int, kv_budget: int, phase1: int, silence: int, window: int, servers: int = 1) -> Workload:
    """Client 0: 0.3 C for ``phase1`` steps, silent ``silence`` steps, then 1.2 C; client 1:
    1.2 C throughout; ends ``window`` steps after the return."""
    c = capacity(kv_budget, DEFAULT_SIZES) * servers
    back = phase1 + silence
    end = back + window
    return build_workload(
        seed,
        [
            FlowLoad(FlowSpec("client-0"), Phases(((0, phase1, 0.3 * c), (back, end, 1.2 * c))), DEFAULT_SIZES),
            FlowLoad(FlowSpec("client-1"), Poisson(1.2 * c, 0, end), DEFAULT_SIZES),
        ],
    )


TEAM_SIZES = {
    "team-a": Sizes(prompt=(500, 1500), output=(400, 1200), max_tokens=1536),
    "team-b": Sizes(prompt=(50, 300), output=(10, 100), max_tokens=128),
    "team-c": Sizes(prompt=(200, 800), output=(100, 400), max_tokens=512),
}


def teams_workload(
    seed: int,
    steps: int,
    jobs: int = 400,
    b_start: int = 300,
    b_rate: float = 0.05,
    c_burst: int = 24,
    c_gap: int = 2500,
    weights: tuple[float, float] = (6.0, 1.0),
) -> Workload:
    """The multi-team overload test (flows are team + workload class; docs/simulator.md §5)."""
    w_int, w_batch = weights
    return build_workload(
        seed,
        [
            FlowLoad(FlowSpec("team-a/batch", w_batch, "batch", 1), Batch(jobs, 0), TEAM_SIZES["team-a"]),
            FlowLoad(
                FlowSpec("team-b/interactive", w_int, "interactive", 0),
                Poisson(b_rate, b_start, steps),
                TEAM_SIZES["team-b"],
            ),
            FlowLoad(
                FlowSpec("team-c/batch", w_batch, "batch", 1),
                Bursts(c_burst, c_gap, min(1000, steps), steps, jitter=c_gap // 2),
                TEAM_SIZES["team-c"],
            ),
        ],
    )


def shallow_workload(seed: int, steps: int, keep: int = 1) -> Workload:
    """Two closed-loop clients, each keeping ``keep`` requests waiting (the default sizes)."""
    flows = [FlowSpec("client-0"), FlowSpec("client-1")]
    closed = [ClosedLoop(f, keep, DEFAULT_SIZES.prompt, DEFAULT_SIZES.output, DEFAULT_SIZES.max_tokens, 0, steps, seed)
              for f in range(2)]
    return build_workload(seed, [FlowLoad(s, Batch(0), DEFAULT_SIZES) for s in flows], closed=closed)


def keep_one_workload(seed: int, kv_budget: int, steps: int, servers: int = 1) -> Workload:
    """Client 0 keeps one request waiting; client 1 floods at 1.2 C (Poisson)."""
    c = capacity(kv_budget, DEFAULT_SIZES) * servers
    closed = [ClosedLoop(0, 1, DEFAULT_SIZES.prompt, DEFAULT_SIZES.output, DEFAULT_SIZES.max_tokens, 0, steps, seed)]
    return build_workload(
        seed,
        [
            FlowLoad(FlowSpec("keeper"), Batch(0), DEFAULT_SIZES),
            FlowLoad(FlowSpec("flooder"), Poisson(1.2 * c, 0, steps), DEFAULT_SIZES),
        ],
        meta={"flooder_rate_per_step": 1.2 * c},
        closed=closed,
    )


def many_workload(seed: int, steps: int, clients: int = 1000, each: int = 5) -> Workload:
    """``clients`` clients sending ``each`` requests at uniform times in ``[0, steps)``."""
    return build_workload(seed, [FlowLoad(FlowSpec(f"client-{k}"), Uniform(each, 0, steps), DEFAULT_SIZES)
                                 for k in range(clients)])


# ---------------------------------------------------------------------- scenarios
def _two_overloaded_clients(opts: Options, policies: Sequence[str] | None, scenario: str) -> tuple[int, Any, Any, list[str]]:
    """The setting shared by drift and rpm-sweep: one server, M = 8192 by default,
    two clients always over their share."""
    steps = opts.steps or 20_000
    fleet = _fleet(opts, 1, 8192, None)
    wl = drift_workload(opts.seed, fleet.kv_budget, steps, fleet.servers)
    return steps, fleet, wl, _policies(policies, scenario)


def run_drift(opts: Options, policies: Sequence[str] | None = None, progress: Progress | None = None) -> ScenarioResult:
    progress = progress or Progress()
    steps, fleet, wl, names = _two_overloaded_clients(opts, policies, "drift")
    params = {
        **_common_params(opts),
        "steps": steps,
        **_fleet_params(fleet),
        "prompt_tokens": list(DEFAULT_SIZES.prompt),
        "output_tokens": list(DEFAULT_SIZES.output),
        "max_tokens": DEFAULT_SIZES.max_tokens,
        "rates_per_step": wl.meta["rates_per_step"],
        "requests": len(wl),
        "policies": names,
        "quantum": opts.quantum,
    }
    runs, rows = [], []
    for n in names:
        res = _run(wl, n, fleet, opts, progress, steps)
        runs.append((res.policy, res))
        rows.append(_row("drift", res))
    return ScenarioResult("drift", params, rows, runs)


def run_return(opts: Options, policies: Sequence[str] | None = None, progress: Progress | None = None,
               silence: int = 2000, window: int = 600) -> ScenarioResult:
    progress = progress or Progress()
    phase1 = opts.steps or 3000
    fleet = _fleet(opts, 1, 8192, None)
    back = phase1 + silence
    end = back + window
    wl = return_workload(opts.seed, fleet.kv_budget, phase1, silence, window, fleet.servers)
    names = _policies(policies, "return")
    params = {
        **_common_params(opts),
        **_fleet_params(fleet),
        "phase1_steps": phase1,
        "silence_steps": silence,
        "return_step": back,
        "window_steps": window,
        "requests": len(wl),
        "policies": names,
        "quantum": opts.quantum,
    }
    runs, rows = [], []
    for n in names:
        res = _run(wl, n, fleet, opts, progress, end, marks=(back,))
        d = service_at(res, end) - service_at(res, back)
        in_win = (res.admit >= back) & (res.admit < end)
        est0 = float(res.est[in_win & (res.flow == 0)].sum())
        est_all = float(res.est[in_win].sum())
        runs.append((res.policy, res))
        rows.append(
            _row(
                "return",
                res,
                returning_share=float(d[0] / d.sum()) if d.sum() > 0 else None,
                returning_dispatch_share=est0 / est_all if est_all > 0 else None,
                steady_service=float(d[1]),
            )
        )
    return ScenarioResult("return", params, rows, runs, extra={"return_step": back, "window_end": end})


def run_kv_sweep(opts: Options, policies: Sequence[str] | None = None, progress: Progress | None = None,
                 budgets: Sequence[int] = KV_SWEEP) -> ScenarioResult:
    progress = progress or Progress()
    steps = opts.steps or 20_000
    names = _policies(policies, "kv-sweep")
    servers = opts.servers or 1
    params = {
        **_common_params(opts),
        "steps": steps,
        "servers": servers,
        "kv_budgets": list(budgets),
        "policies": names,
        "quantum": opts.quantum,
    }
    runs, rows = [], []
    for m in budgets:
        fleet = Fleet(servers, int(m), opts.slots)
        wl = drift_workload(opts.seed, int(m), steps, servers)
        for n in names:
            res = _run(wl, n, fleet, opts, progress, steps, label=f"{n} M={m}")
            runs.append((f"{res.policy} M={m}", res))
            rows.append(_row("kv-sweep", res))
    return ScenarioResult("kv-sweep", params, rows, runs)


def run_rpm_sweep(opts: Options, policies: Sequence[str] | None = None, progress: Progress | None = None,
                  limits: Sequence[int | None] = RPM_SWEEP) -> ScenarioResult:
    progress = progress or Progress()
    steps, fleet, wl, names = _two_overloaded_clients(opts, policies, "rpm-sweep")
    params = {
        **_common_params(opts),
        "steps": steps,
        **_fleet_params(fleet),
        "minute_steps": opts.rpm_window,
        "rpm_limits": list(limits),
        "policies": names,
        "requests": len(wl),
    }
    runs, rows = [], []
    for n in names:
        for rpm in limits if n == "fifo" else (None,):
            res = _run(wl, n, fleet, opts, progress, steps, rpm=rpm)
            runs.append((res.policy, res))
            rows.append(_row("rpm-sweep", res, rpm=rpm))
    return ScenarioResult("rpm-sweep", params, rows, runs)


def run_teams(opts: Options, policies: Sequence[str] | None = None, progress: Progress | None = None,
              **workload_kw: Any) -> ScenarioResult:
    progress = progress or Progress()
    steps = opts.steps or 12_000
    fleet = _fleet(opts, 8, 8192, 1)
    wl = teams_workload(opts.seed, steps, **workload_kw)
    names = _policies(policies, "teams")
    params = {
        **_common_params(opts),
        "steps": steps,
        **_fleet_params(fleet),
        "flows": {f.name: {"weight": f.weight, "class": f.klass, "priority": f.priority} for f in wl.flows},
        "team_a_jobs": int((wl.flow == 0).sum()),
        "requests": len(wl),
        "policies": names,
        "quantum": opts.quantum,
    }
    runs, rows = [], []
    for n in names:
        res = _run(wl, n, fleet, opts, progress, steps)
        final = res.final_service()
        total = float(final.sum())
        teams = {}
        for f, spec in enumerate(wl.flows):
            p50, p95, p99 = wait_quantiles(res, f)
            m = (res.flow == f) & (res.arrival < res.end)
            teams[spec.name.split("/")[0]] = {
                "class": spec.klass,
                "weight": spec.weight,
                "wait_p50": p50,
                "wait_p95": p95,
                "wait_p99": p99,
                "cost_share": float(final[f] / total) if total > 0 else None,
                "submitted": int(m.sum()),
                "completed": int((m & (res.finish >= 0)).sum()),
            }
        runs.append((res.policy, res))
        rows.append(_row("teams", res, teams=teams))
    return ScenarioResult("teams", params, rows, runs)


def run_trace(opts: Options, policies: Sequence[str] | None = None, progress: Progress | None = None) -> ScenarioResult:
    if not opts.trace:
        raise ValueError("the trace scenario needs a trace file (--trace FILE.jsonl)")
    progress = progress or Progress()
    wl = load_trace(opts.trace, opts.weights, seed=opts.seed)
    fleet = _fleet(opts, 1, 8192, None)
    names = _policies(policies, "trace")
    if opts.steps is None and any(c.end is None for c in wl.closed):
        raise ValueError("the trace has closed-loop clients without an end: give a horizon (--steps N)")
    params = {
        **_common_params(opts),
        "trace": str(opts.trace),
        "steps": opts.steps,
        **_fleet_params(fleet),
        "flows": {f.name: {"weight": f.weight} for f in wl.flows},
        "requests": len(wl),
        "closed_loop": {wl.flows[c.flow].name: c.keep for c in wl.closed},
        "policies": names,
        "quantum": opts.quantum,
    }
    runs, rows = [], []
    for n in names:
        res = _run(wl, n, fleet, opts, progress, opts.steps)
        runs.append((res.policy, res))
        rows.append(_row("trace", res))
    return ScenarioResult("trace", params, rows, runs)


SHALLOW_MARKS = (0.25, 0.5, 1.0)


def run_shallow(opts: Options, policies: Sequence[str] | None = None,
                progress: Progress | None = None) -> ScenarioResult:
    progress = progress or Progress()
    steps = opts.steps or 40_000
    fleet = _fleet(opts, 1, 8192, None)
    wl = shallow_workload(opts.seed, steps)
    names = _policies(policies, "shallow")
    marks = [int(steps * q) for q in SHALLOW_MARKS]
    params = {**_common_params(opts), "steps": steps, **_fleet_params(fleet), "keep_waiting": 1,
              "drift_at_steps": marks, "policies": names}
    runs, rows = [], []
    for n in names:
        res = _run(wl, n, fleet, opts, progress, steps, marks=marks)
        runs.append((res.policy, res))
        # how often the balancer's queue emptied while the engines still had work
        wait = np.zeros(res.times.size, dtype=np.int64)
        run_ = np.zeros(res.times.size, dtype=np.int64)
        for f in range(len(res.flows)):
            wait += res.series(f, "waiting")
            run_ += res.series(f, "running")
        drained = (wait == 0) & (run_ > 0)
        empties = int((drained[1:] & ~drained[:-1]).sum() + drained[0])
        rows.append(_row("shallow", res, drift_at={str(m): max_drift(res, None, m) for m in marks},
                         queue_empties=empties))
    return ScenarioResult("shallow", params, rows, runs)


def run_keep_one(opts: Options, policies: Sequence[str] | None = None,
                 progress: Progress | None = None) -> ScenarioResult:
    progress = progress or Progress()
    steps = opts.steps or 20_000
    fleet = _fleet(opts, 1, 8192, None)
    wl = keep_one_workload(opts.seed, fleet.kv_budget, steps, fleet.servers)
    names = _policies(policies, "keep-one")
    params = {**_common_params(opts), "steps": steps, **_fleet_params(fleet),
              "flooder_rate_per_step": wl.meta["flooder_rate_per_step"], "policies": names}
    runs, rows = [], []
    for n in names:
        res = _run(wl, n, fleet, opts, progress, steps)
        runs.append((res.policy, res))
        final = res.final_service()
        rows.append(_row("keep-one", res, keeper_share=float(final[0] / final.sum()) if final.sum() > 0 else None))
    return ScenarioResult("keep-one", params, rows, runs)


def run_many(opts: Options, policies: Sequence[str] | None = None, progress: Progress | None = None) -> ScenarioResult:
    progress = progress or Progress()
    steps = opts.steps or 5000
    fleet = _fleet(opts, 8, 8192, None)
    wl = many_workload(opts.seed, steps)
    names = _policies(policies, "many")
    params = {**_common_params(opts), "steps": steps, **_fleet_params(fleet), "clients": len(wl.flows),
              "requests": len(wl), "policies": names}
    runs, rows = [], []
    for n in names:
        res = _run(wl, n, fleet, opts, progress, None)
        runs.append((res.policy, res))
        row = _row("many", res, events=res.events, end_step=res.end)
        row["flows"] = None  # 1,000 per-flow summaries: left out of the document
        rows.append(row)
    return ScenarioResult("many", params, rows, runs)


NESTED_USERS = (10, 1)  # users of t1 and t2


def nested_workload(seed: int, steps: int, users: tuple[int, ...] = NESTED_USERS, keep: int = 2) -> Workload:
    """Closed-loop users (each keeping ``keep`` requests waiting, the default sizes), flows
    ``t{team}/u{user}``."""
    specs = [FlowSpec(f"t{t + 1}/u{u}") for t, n in enumerate(users) for u in range(n)]
    closed = [ClosedLoop(f, keep, DEFAULT_SIZES.prompt, DEFAULT_SIZES.output, DEFAULT_SIZES.max_tokens, 0, steps, seed)
              for f in range(len(specs))]
    return build_workload(seed, [FlowLoad(x, Batch(0), DEFAULT_SIZES) for x in specs], closed=closed)


def nested_discipline(wl: Workload, opts: Options) -> Any:
    """The engine under a policy with one org whose teams are the workload's teams and whose
    users share equally (``sfq-nested``), in the run's charge mode and estimator."""
    from ..policy.classify import Flow
    from ..policy.config import policy_from_mapping
    from .adapter import _CLASS, _POOL, SIM_MODEL, EngineDiscipline

    teams = sorted({f.name.split("/")[0] for f in wl.flows})
    policy = policy_from_mapping({
        "pools": {_POOL: {"models": [SIM_MODEL], "backends": [{"url": "http://simulated.invalid"}]}},
        "classes": {_CLASS: {"small_cost": None}},
        "orgs": {"org": {"classes": [_CLASS], "users": "equal", "teams": {t: {"weight": 1} for t in teams}}},
        "cost": {"input_weight": opts.w_p, "output_weight": opts.w_q, "prior_ratio": opts.prior,
                 "charge": opts.charge or "served"},
    }, source="<nested scenario>")
    flows = [Flow("org", _CLASS, _POOL, *f.name.split("/")) for f in wl.flows]
    return EngineDiscipline(policy, flows, scheduler=opts.core, label="sfq-nested", run_estimator=True)


def run_nested(opts: Options, policies: Sequence[str] | None = None,
               progress: Progress | None = None) -> ScenarioResult:
    progress = progress or Progress()
    steps = opts.steps or 20_000
    fleet = _fleet(opts, 1, 8192, None)
    wl = nested_workload(opts.seed, steps)
    names = _policies(policies, "nested")
    params = {**_common_params(opts), "steps": steps, **_fleet_params(fleet), "users": list(NESTED_USERS),
              "keep_waiting": 2, "policies": [*names, "sfq-nested"]}
    runs, rows = [], []
    for n in [*names, "sfq-nested"]:
        if n == "sfq-nested":
            disc = nested_discipline(wl, opts)
            cb = progress.begin(disc.label, steps)
            try:
                res = Simulation(wl, disc, fleet, w_p=opts.w_p, w_q=opts.w_q, horizon=steps,
                                 estimator=make_estimator(opts.w_p, opts.w_q, opts.prior), progress=cb).run()
            finally:
                progress.end()
        else:
            res = _run(wl, n, fleet, opts, progress, steps)
        runs.append((res.policy, res))
        final = res.final_service()
        total = float(final.sum())
        share = {spec.name: float(final[f] / total) if total > 0 else 0.0 for f, spec in enumerate(wl.flows)}
        t1 = [v for k, v in share.items() if k.startswith("t1/")]
        rows.append(_row("nested", res, team_share={t: sum(v for k, v in share.items() if k.startswith(t + "/"))
                                                    for t in ("t1", "t2")},
                         t1_user_share=(min(t1), max(t1)), user_share=share))
    return ScenarioResult("nested", params, rows, runs)


SCENARIOS: dict[str, Callable[..., ScenarioResult]] = {
    "drift": run_drift,
    "return": run_return,
    "kv-sweep": run_kv_sweep,
    "rpm-sweep": run_rpm_sweep,
    "teams": run_teams,
    "shallow": run_shallow,
    "keep-one": run_keep_one,
    "many": run_many,
    "trace": run_trace,
    "nested": run_nested,
    "deadlines": lambda opts, policies=None, progress=None: _run_deadlines(opts, policies, progress),
}


def _run_deadlines(opts: Options, policies: Sequence[str] | None, progress: Progress | None) -> ScenarioResult:
    from .deadlines import run_deadlines

    res: ScenarioResult = run_deadlines(opts, policies, progress)
    return res


def run_scenario(name: str, opts: Options | None = None, policies: Sequence[str] | None = None,
                 progress: Progress | None = None) -> ScenarioResult:
    """Run one scenario by name; ``ValueError`` names an unknown scenario or policy."""
    try:
        fn = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}") from None
    return fn(opts or Options(), policies, progress)


HEADLINE = ("teams", "return")


def run_headline(opts: Options | None = None, policies: Sequence[str] | None = None,
                 progress: Progress | None = None) -> list[ScenarioResult]:
    """The default run of ``sfq simulate``: ``teams`` and ``return``."""
    return [run_scenario(n, opts, policies, progress) for n in HEADLINE]


def workload_for(name: str, opts: Options | None = None) -> Workload:
    """The workload a scenario runs (for ``--write-trace``); kv-sweep gives M = kv_budget."""
    opts = opts or Options()
    kv = opts.kv_budget or 8192
    servers = opts.servers or (8 if name == "teams" else 1)
    if name in ("drift", "kv-sweep", "rpm-sweep"):
        return drift_workload(opts.seed, kv, opts.steps or 20_000, servers)
    if name == "return":
        return return_workload(opts.seed, kv, opts.steps or 3000, 2000, 600, servers)
    if name == "teams":
        return teams_workload(opts.seed, opts.steps or 12_000)
    if name == "trace":
        if not opts.trace:
            raise ValueError("the trace scenario needs a trace file (--trace FILE.jsonl)")
        return load_trace(opts.trace, opts.weights, seed=opts.seed)
    if name == "shallow":
        return shallow_workload(opts.seed, opts.steps or 40_000)
    if name == "keep-one":
        return keep_one_workload(opts.seed, kv, opts.steps or 20_000, servers)
    if name == "many":
        return many_workload(opts.seed, opts.steps or 5000)
    if name == "nested":
        return nested_workload(opts.seed, opts.steps or 20_000)
    if name == "deadlines":
        from .deadlines import deadlines_workload

        return deadlines_workload(opts.seed, opts.steps or 12_000)
    raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
