"""A deterministic discrete-event simulator of an LLM-serving fleet.

The fleet is a set of continuous-batching engines with a KV budget each (``engine``);
scheduling disciplines decide whose request starts next (``policies``: fifo, prio, rr, drr,
wfq, sfq, sfq-seed, lcf, vtc, vtc-h; ``sfq`` is the project's request engine, the one
``sfq serve`` runs, in one of its three charge modes (``adapter``), ``sfq-seed`` the bare
core under the plain rule of docs/design.md); workloads are
seeded generators or JSONL traces, with closed-loop clients (``workloads``, ``model``);
``metrics`` measures service, drift (over the intervals in which two flows both wait at the
balancer, the gap Sheng et al., OSDI 2024, bound), Jain's index,
waits and throughput; ``scenarios`` holds the experiments of ``sfq simulate``; ``goals``
measures the fairness goals of docs/simulator.md §7 over several seeds.

Quick use::

    from sfq.sim import Fleet, Options, run_scenario, simulate
    res = run_scenario("return", Options(seed=1))
    for row in res.results:
        print(row["policy"], row["returning_share"])

Times are decode steps, sizes tokens, service weighted tokens ``w_p*prompt + w_q*output``.
Everything is deterministic from the seed: no wall clock, no unordered iteration.
"""

from __future__ import annotations

from .engine import Fleet, RunResult, Simulation, simulate
from .estimate import RatioEstimator, make_estimator
from .metrics import (drift_curve, drift_set, flow_summary, jain_index, max_drift, max_drift_from_start,
                      max_interval_drift, service_at, throughput, wait_quantiles, waits)
from .model import ClosedLoop, FlowSpec, Request, Workload, load_trace, read_trace_lines, save_trace
from .adapter import EngineDiscipline
from .policies import (CHARGE_MODES, DEFAULT_CHARGE, DRR, FIFO, POLICIES, VTC, WFQ, Discipline, RoundRobin,
                       RPMLimitedFIFO, SeedSFQ, StrictPriority, make_policy)
from .scenarios import SCENARIOS, Options, ScenarioResult, run_headline, run_scenario
from .workloads import (Batch, Bursts, FlowLoad, Mix, OnOff, Periodic, Phases, Poisson, Sizes, Uniform, build_workload,
                        capacity)

__all__ = [
    "CHARGE_MODES", "ClosedLoop", "DEFAULT_CHARGE", "SeedSFQ", "Uniform", "drift_curve", "drift_set",
    "max_drift_from_start", "max_interval_drift",
    "Batch", "Bursts", "DRR", "Discipline", "EngineDiscipline", "FIFO", "Fleet", "FlowLoad", "FlowSpec", "Mix", "OnOff", "Options", "POLICIES",
    "Periodic", "Phases", "Poisson", "RPMLimitedFIFO", "RatioEstimator", "Request", "RoundRobin",
    "RunResult", "SCENARIOS", "ScenarioResult", "Simulation", "Sizes", "StrictPriority", "VTC", "WFQ",
    "Workload", "build_workload", "capacity", "flow_summary", "jain_index", "load_trace", "make_estimator",
    "make_policy", "max_drift", "read_trace_lines", "run_headline", "run_scenario", "save_trace", "service_at",
    "simulate", "throughput", "wait_quantiles", "waits",
]
