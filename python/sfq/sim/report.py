"""Tables of a :class:`~sfq.sim.scenarios.ScenarioResult`: rich for the terminal,
GitHub markdown for the docs. Both come from the same rows of strings.

The headline tables (``teams``, ``return``) fit in 100 columns, and their headers say what
the numbers are: a header may have two lines (``"\n"``; markdown joins them with a space).
A wait percentile that falls among requests still waiting when the run ended (so the real
wait is longer, by an unknown amount) reads ``≥ 5,741``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .scenarios import ScenarioResult

if TYPE_CHECKING:
    from rich.table import Table

    from .engine import RunResult

__all__ = ["table_rows", "rich_table", "markdown_table", "censored_wait_quantiles", "runs_by_row", "DRIFT"]

#: what every table's "max drift" is (``sfq.sim.metrics.max_drift``; docs/simulator.md §4 in
#: the same words): the one definition the captions give
DRIFT = ("max drift: the largest |W_f(t1,t2)/w_f - W_g(t1,t2)/w_g| over every pair of flows and every "
         "run of steps in each of which both had a request waiting at the balancer (docs/simulator.md §4)")


def censored_wait_quantiles(run: RunResult, flow: int, qs: tuple[float, ...] = (50, 95, 99)
                            ) -> list[tuple[float | None, bool]]:
    """``(wait, open)`` per quantile of ``flow``'s waits before start (steps), over the
    requests that arrived before the end; a request never started counts with its wait so
    far (as :func:`sfq.sim.metrics.wait_quantiles`, same values). ``open`` is true when the
    quantile falls among requests still waiting at the end (had they waited for ever, it
    would be infinite): the real wait there is at least the value, and unknown."""
    m = (run.arrival < run.end) & ~run.rejected & (run.flow == flow)
    started = run.admit[m] >= 0
    w = np.where(started, run.admit[m], run.end) - run.arrival[m]
    if w.size == 0:
        return [(None, False) for _ in qs]
    finished = int(started.sum())
    out: list[tuple[float | None, bool]] = []
    for q in qs:
        hi = math.ceil(q / 100 * (w.size - 1))  # np.percentile interpolates up to this rank
        out.append((float(np.percentile(w, q)), hi >= finished))
    return out


def runs_by_row(res: ScenarioResult) -> list[RunResult | None]:
    """The run behind each row of ``res.results`` (``None`` where the result holds no runs)."""
    if len(res.runs) == len(res.results):
        return [run for _, run in res.runs]
    return [None] * len(res.results)


def _n(x: Any, digits: int = 0) -> str:
    if x is None:
        return "-"
    if digits == 0:
        return f"{x:,.0f}"
    return f"{x:,.{digits}f}"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _waits(d: dict[str, Any], keys: tuple[str, ...] = ("wait_p50", "wait_p95", "wait_p99")) -> str:
    return " / ".join(_n(d[k]) for k in keys)


def _bounded(cells: list[tuple[float | None, bool]]) -> str:
    return " / ".join(("≥ " if lb else "") + _n(v) for v, lb in cells)


def _label(r: dict[str, Any]) -> str:
    return r["policy"] if not r.get("charge") else f"{r['policy']} ({r['charge']})"


def table_rows(res: ScenarioResult) -> tuple[str, list[str], list[list[str]], str]:
    """``(title, headers, rows, caption)`` for a scenario's table."""
    s = res.scenario
    rows: list[list[str]] = []
    p = res.params
    if s == "teams":
        teams = list(res.results[0]["teams"]) if res.results else []
        short = [t.replace("team-", "").upper() for t in teams]
        first = res.results[0]["teams"] if res.results else {}
        # every team but the first (the batch dump, whose jobs mostly never start: its
        # measure is what got done) by its waits; then shares and completions of all
        waited = list(range(1, len(teams))) if len(teams) > 1 else list(range(len(teams)))
        headers = ["policy"] + [f"{short[k]} {first[teams[k]]['class']} wait\np50 / p99, steps" for k in waited]
        headers += ["% of service\n" + " / ".join(short),
                    "done of " + "/".join(str(first[t]["submitted"]) for t in teams) + "\n" + " / ".join(short)]
        for r, run in zip(res.results, runs_by_row(res)):
            tm = r["teams"]
            row = [r["policy"]]
            for k in waited:
                if run is not None:
                    row.append(_bounded(censored_wait_quantiles(run, k, (50, 99))))
                else:
                    row.append(_waits(tm[teams[k]], ("wait_p50", "wait_p99")))
            row.append(" / ".join("-" if tm[t]["cost_share"] is None else f"{100 * tm[t]['cost_share']:.1f}"
                                  for t in teams))
            row.append(" / ".join(str(tm[t]["completed"]) for t in teams))
            rows.append(row)
        flows = p.get("flows", {})
        weights = ", ".join(f"{k} {v['weight']:g}" for k, v in flows.items())
        title = (f"teams: {p.get('team_a_jobs', '?')} batch jobs from A at step 0, interactive B, bursts from C; "
                 f"{p['servers'] * p['slots']} slots, {p['steps']:,} steps")
        caption = (f"weights {weights}; ≥ X: the percentile falls among requests still waiting at the end "
                   "(X steps so far); service in weighted tokens")
    elif s == "return":
        bound = res.results[0]["bound"] if res.results else None
        headers = ["policy", "returning\nclient's share\nof service", "its share of\ndispatched\ncost",
                   "steady client's\nservice (W)", f"max drift (W)\n(bound {_n(bound)})", "weighted\ntokens/step"]
        for r in res.results:
            rows.append([r["policy"], _pct(r["returning_share"]), _pct(r["returning_dispatch_share"]),
                         _n(r["steady_service"]), _n(r["max_drift"]), _n(r["throughput"], 1)])
        title = (f"return: client 0 silent for {p['silence_steps']:,} steps, back at step {p['return_step']:,}; "
                 f"the {p['window_steps']} steps after")
        caption = (f"W: weighted tokens (w_p={p['w_p']:g}, w_q={p['w_q']:g}); M={p['kv_budget']:,}; {DRIFT}; "
                   "bound: 2 max(w_p L_input, w_q M), the VTC paper's bound on that gap")
    elif s == "kv-sweep":
        pols = list(dict.fromkeys(r["policy"] for r in res.results))
        budgets = list(dict.fromkeys(r["kv_budget"] for r in res.results))
        headers = ["KV budget M", "bound\n2max(w_p L, w_q M)"] + [f"{x}\ndrift" for x in pols]
        for m in budgets:
            sub = {r["policy"]: r for r in res.results if r["kv_budget"] == m}
            rows.append([_n(m), _n(next(iter(sub.values()))["bound"])] + [_n(sub[x]["max_drift"]) for x in pols])
        title = f"kv-sweep: max drift between two overloaded clients vs the KV budget, {p['steps']:,} steps"
        caption = f"{DRIFT}, weighted tokens"
    elif s == "rpm-sweep":
        headers = ["policy", "RPM limit", "max drift\n(W)", "weighted\ntokens/step", "tokens\n/step"]
        for r in res.results:
            rows.append([r["policy"], "none" if r["rpm"] is None else str(r["rpm"]), _n(r["max_drift"]),
                         _n(r["throughput"], 1), _n(r["tokens_per_step"], 1)])
        title = f"rpm-sweep: per-client request limits, a minute = {p['minute_steps']:,} steps, {p['steps']:,} steps"
        caption = f"{DRIFT}, weighted tokens; throughput measured"
    elif s == "shallow":
        marks = p["drift_at_steps"]
        headers = ["policy"] + [f"drift to\nstep {m:,}" for m in marks] + ["queue\nemptied", "weighted\ntokens/step"]
        for r in res.results:
            rows.append([_label(r)] + [_n(r["drift_at"][str(m)]) for m in marks]
                        + [_n(r["queue_empties"]), _n(r["throughput"], 1)])
        title = f"shallow: two clients each keeping one request waiting, M={p['kv_budget']:,}, {p['steps']:,} steps"
        caption = (f"{DRIFT}, up to the step, weighted tokens; queue emptied: times the balancer's queue "
                   "drained while the engine still had work")
    elif s == "keep-one":
        headers = ["policy", "keeper's share\nof service", "max drift\n(W)", "weighted\ntokens/step"]
        for r in res.results:
            rows.append([_label(r), _pct(r["keeper_share"]), _n(r["max_drift"]), _n(r["throughput"], 1)])
        title = f"keep-one: a client keeping one request waiting against a flooder, {p['steps']:,} steps"
        caption = "service in weighted tokens (w_p=%g, w_q=%g), M=%s" % (p["w_p"], p["w_q"], f"{p['kv_budget']:,}")
    elif s == "nested":
        headers = ["policy", "team t1 (10 users)\nshare", "team t2 (1 user)\nshare", "each t1 user\nmin .. max",
                   "weighted\ntokens/step"]
        for r in res.results:
            lo, hi = r["t1_user_share"]
            rows.append([_label(r), _pct(r["team_share"]["t1"]), _pct(r["team_share"]["t2"]),
                         f"{_pct(lo)} .. {_pct(hi)}", _n(r["throughput"], 1)])
        title = (f"nested: one org, team t1 of {p['users'][0]} users against team t2 of {p['users'][1]}, each user "
                 f"keeping {p['keep_waiting']} requests waiting, {p['steps']:,} steps")
        caption = ("shares of the service (weighted tokens); sfq: one flow per user (flat); sfq-nested: teams of "
                   "weight 1 with users: equal (the engine's tree of schedulers)")
    elif s == "deadlines":
        headers = ["policy", "interactive\nattainment", "interactive\nin time", "interactive TTFT\np50 / p99, s",
                   "batch\nattainment", "batch service\nvs FIFO"]
        for r in res.results:
            i, b = r["classes"]["interactive"], r["classes"]["batch"]
            rows.append([_label(r), _pct(i["attainment"]), _pct(i["in_time"]),
                         f"{_n(i['ttft_p50'], 2)} / {_n(i['ttft_p99'], 2)}", _pct(b["attainment"]),
                         _pct(r["batch_vs_fifo"])])
        obj = p["objective_s"]
        title = (f"deadlines: an interactive class (TTFT objective {obj['interactive']:g} s) beside a batch flood, "
                 + (f"one engine of {p['slots']} slots" if p["servers"] == 1 else
                    f"{p['servers']} engines of {p['slots']} slots")
                 + f", {p['steps']:,} steps")
        caption = ("attainment: requests whose first token came within the class's objective (dropped or never "
                   "started: missed); in time: started before their own deadline; sfq-edf: the engine with "
                   f"deadlines (half the interactive requests {obj['interactive']:g} s, the rest the class's "
                   f"{p['deadline_seconds']:g} s), EDF inside the flow; sfq-edf-headroom-K: sfq-edf with the "
                   "pool's limits.headroom: K (the last K free slots kept for flows below their part)")
    elif s == "many":
        headers = ["policy", "events", "last step", "weighted\ntokens/step", "Jain\nindex"]
        for r in res.results:
            rows.append([_label(r), _n(r["events"]), _n(r["end_step"]), _n(r["throughput"], 1), _n(r["jain"], 4)])
        title = (f"many: {p['clients']:,} clients, {p['requests']:,} requests, {p['servers']} servers, "
                 "run to completion")
        caption = "Jain's index among flows backlogged at least 10% of the run"
    else:  # drift, trace
        headers = ["policy", "max drift\n(W)", "drift /\nbound", "interval\ndrift (W)", "drift of\nest. cost",
                   "weighted\ntokens/step", "Jain\nindex", "worst p99\nwait, steps"]
        for r in res.results:
            worst = max((f["wait_p99"] or 0) for f in r["flows"].values()) if r["flows"] else None
            rows.append([_label(r), _n(r["max_drift"]), _n(r["drift_ratio"], 3), _n(r["max_interval_drift"]),
                         _n(r["max_drift_est"]), _n(r["throughput"], 1), _n(r["jain"], 4), _n(worst)])
        if s == "drift":
            title = f"drift: two clients over their share, M={p['kv_budget']:,}, {p['steps']:,} steps"
        else:
            title = f"trace: {p['trace']} ({p['requests']:,} requests), {p['servers']} server(s), M={p['kv_budget']:,}"
        caption = (f"{DRIFT}; interval drift: the same with a flow counted while it has work waiting or "
                   "running; drift of est. cost: max drift on the estimates charged; weighted tokens "
                   f"(w_p={p['w_p']:g}, w_q={p['w_q']:g}); bound = 2 max(w_p L_input, w_q M)")
    return title, headers, rows, caption


def rich_table(res: ScenarioResult) -> Table:
    """A ``rich.table.Table`` of the scenario."""
    from .._optional import require

    require("rich.table", "sim", "sfq.sim's terminal tables")
    from rich.table import Table

    title, headers, rows, caption = table_rows(res)
    t = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in rows:
        t.add_row(*r)
    return t


def markdown_table(res: ScenarioResult) -> str:
    """The scenario's table as GitHub markdown (title as a bold line, caption below)."""
    title, headers, rows, caption = table_rows(res)
    out = [f"**{title}**", "", "| " + " | ".join(h.replace("\n", " ") for h in headers) + " |",
           "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    out += ["", f"_{caption}_"]
    return "\n".join(out)
