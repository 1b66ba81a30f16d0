"""Tables of a :class:`~sfq.sim.scenarios.ScenarioResult`: rich for the terminal,
GitHub markdown for the README. Both come from the same rows of strings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .scenarios import ScenarioResult

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["table_rows", "rich_table", "markdown_table"]


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
        headers = ["policy"] + [f"{sh} wait p50/p95/p99" for sh in short]
        headers += ["cost share " + "/".join(short), "done " + "/".join(short), "W/step"]
        for r in res.results:
            tm = r["teams"]
            rows.append(
                [r["policy"]]
                + [_waits(tm[t]) for t in teams]
                + [" / ".join(_pct(tm[t]["cost_share"]) for t in teams)]
                + [" / ".join(f"{tm[t]['completed']}/{tm[t]['submitted']}" for t in teams)]
                + [_n(r["throughput"], 1)]
            )
        flows = p.get("flows", {})
        weights = ", ".join(f"{k} w={v['weight']:g}" for k, v in flows.items())
        title = f"teams: the multi-team overload test, {p['servers']} servers x {p['slots']} slot, {p['steps']:,} steps"
        caption = f"waits in steps (a request never started counts until the end); {weights}"
    elif s == "return":
        headers = ["policy", "returning share", "share of dispatched cost", "steady client's service",
                   "interval drift", "bound", "W/step"]
        for r in res.results:
            rows.append([r["policy"], _pct(r["returning_share"]), _pct(r["returning_dispatch_share"]),
                         _n(r["steady_service"]), _n(r["max_interval_drift"]), _n(r["bound"]),
                         _n(r["throughput"], 1)])
        title = (f"return: client 0 silent for {p['silence_steps']:,} steps, back at step {p['return_step']:,}; "
                 f"the {p['window_steps']} steps after")
        caption = ("service in weighted tokens (w_p=%g, w_q=%g), M=%s; interval drift: over intervals in which both "
                   "clients have work waiting or running (client 0 goes idle, so the drift from the start does not "
                   "apply)" % (p["w_p"], p["w_q"], f"{p['kv_budget']:,}"))
    elif s == "kv-sweep":
        pols = list(dict.fromkeys(r["policy"] for r in res.results))
        budgets = list(dict.fromkeys(r["kv_budget"] for r in res.results))
        headers = ["KV budget M", "bound 2max(w_p L, w_q M)"] + [f"{x} drift" for x in pols]
        for m in budgets:
            sub = {r["policy"]: r for r in res.results if r["kv_budget"] == m}
            rows.append([_n(m), _n(next(iter(sub.values()))["bound"])] + [_n(sub[x]["max_drift"]) for x in pols])
        title = f"kv-sweep: max drift between two overloaded clients vs the KV budget, {p['steps']:,} steps"
        caption = "drift: max |W_f(0,t) - W_g(0,t)| from the start, weighted tokens"
    elif s == "rpm-sweep":
        headers = ["policy", "RPM limit", "max drift", "throughput W/step", "tokens/step"]
        for r in res.results:
            rows.append([r["policy"], "none" if r["rpm"] is None else str(r["rpm"]), _n(r["max_drift"]),
                         _n(r["throughput"], 1), _n(r["tokens_per_step"], 1)])
        title = f"rpm-sweep: per-client request limits, a minute = {p['minute_steps']:,} steps, {p['steps']:,} steps"
        caption = "drift in weighted tokens; throughput measured"
    elif s == "shallow":
        marks = p["drift_at_steps"]
        headers = ["policy"] + [f"drift to step {m:,}" for m in marks] + ["queue emptied", "W/step"]
        for r in res.results:
            rows.append([_label(r)] + [_n(r["drift_at"][str(m)]) for m in marks]
                        + [_n(r["queue_empties"]), _n(r["throughput"], 1)])
        title = f"shallow: two clients each keeping one request waiting, M={p['kv_budget']:,}, {p['steps']:,} steps"
        caption = ("drift: max |W_f(0,t) - W_g(0,t)| up to the step, weighted tokens; queue emptied: times the "
                   "balancer's queue drained while the engine still had work")
    elif s == "keep-one":
        headers = ["policy", "keeper's share of service", "max drift", "W/step"]
        for r in res.results:
            rows.append([_label(r), _pct(r["keeper_share"]), _n(r["max_drift"]), _n(r["throughput"], 1)])
        title = f"keep-one: a client keeping one request waiting against a flooder, {p['steps']:,} steps"
        caption = "service in weighted tokens (w_p=%g, w_q=%g), M=%s" % (p["w_p"], p["w_q"], f"{p['kv_budget']:,}")
    elif s == "many":
        headers = ["policy", "events", "last step", "W/step", "Jain"]
        for r in res.results:
            rows.append([_label(r), _n(r["events"]), _n(r["end_step"]), _n(r["throughput"], 1), _n(r["jain"], 4)])
        title = (f"many: {p['clients']:,} clients, {p['requests']:,} requests, {p['servers']} servers, "
                 "run to completion")
        caption = "Jain's index among flows backlogged at least 10% of the run"
    else:  # drift, trace
        headers = ["policy", "max drift", "drift / bound", "interval drift", "drift of est. cost", "W/step",
                   "tokens/step", "Jain", "worst p99 wait"]
        for r in res.results:
            worst = max((f["wait_p99"] or 0) for f in r["flows"].values()) if r["flows"] else None
            rows.append([_label(r), _n(r["max_drift"]), _n(r["drift_ratio"], 3), _n(r["max_interval_drift"]),
                         _n(r["max_drift_est"]), _n(r["throughput"], 1), _n(r["tokens_per_step"], 1),
                         _n(r["jain"], 4), _n(worst)])
        if s == "drift":
            title = f"drift: two clients over their share, M={p['kv_budget']:,}, {p['steps']:,} steps"
        else:
            title = f"trace: {p['trace']} ({p['requests']:,} requests), {p['servers']} server(s), M={p['kv_budget']:,}"
        caption = ("max drift: max |W_f(0,t) - W_g(0,t)| over the flows backlogged the whole run; interval drift: "
                   "the same restarted whenever a backlog empties; drift of est. cost: the interval form on the "
                   "estimates charged while both wait at the balancer; weighted tokens (w_p=%g, w_q=%g); "
                   "bound = 2 max(w_p L_input, w_q M)" % (p["w_p"], p["w_q"]))
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
    out = [f"**{title}**", "", "| " + " | ".join(headers) + " |",
           "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    out += ["", f"_{caption}_"]
    return "\n".join(out)
