"""PNG plots of a scenario (matplotlib's Agg canvas; no pyplot, no global backend change).

Files written into ``out_dir``:
``<scenario>-service.png``  cumulative service per flow over time, one panel per policy
                            (``return``: the service since the return, around it); the
                            panels share their axes, so a taller line is more service;
``kv-sweep-drift.png``      max drift vs the KV budget M, with the bound;
``rpm-sweep.png``           throughput vs max drift for each RPM limit and the fair policies;
``teams-waits.png``         wait before start p50/p99 per team and policy (the teams the table
                            shows waits for: not the first, whose batch dump outlasts the run
                            under every policy, FIFO included: its measure is what got done);
                            a hatched bar falls among requests still waiting at the end (a
                            lower bound).
The PNGs carry no timestamp or version metadata, so the same run writes the same bytes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .report import censored_wait_quantiles, runs_by_row
from .scenarios import ScenarioResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["write_plots"]

_META = {"Software": None}
#: flows drawn per panel of a service plot
MAX_LINES = 8


def _figure(w: float, h: float) -> Figure:
    from .._optional import require

    require("matplotlib.figure", "sim", "sfq.sim's plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, format="png", metadata=_META)
    return path


def _service_plot(res: ScenarioResult, path: Path, points: int = 400) -> Path:
    runs = res.runs
    n = len(runs)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig = _figure(3.6 * cols, 2.8 * rows + 0.4)
    fig.suptitle(f"{res.scenario}: cumulative service per flow (weighted tokens)", fontsize=11)
    mark = res.extra.get("return_step")
    if mark is not None:
        fig.suptitle(f"{res.scenario}: service per flow since the return at step {mark:,} (weighted tokens)",
                     fontsize=11)
    grid_axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)
    for k in range(n, rows * cols):  # the empty cells of the last row
        grid_axes[k // cols][k % cols].set_visible(False)
    for k, (label, run) in enumerate(runs):
        ax = grid_axes[k // cols][k % cols]
        lo = 0 if mark is None else max(0, mark - 300)
        grid = np.linspace(lo, run.end, points)
        # at most MAX_LINES flows, those with the most service (one series each, not the
        # dense table of every flow: a run may have thousands)
        final = run.final_service()
        shown = sorted(np.argsort(-final, kind="stable")[:MAX_LINES].tolist())
        for f in shown:
            spec = run.flows[f]
            W = run.series(f)
            y = np.interp(grid, run.times, W)
            if mark is not None:
                y = y - np.interp(mark, run.times, W)
            ax.plot(grid, y, label=spec.name, linewidth=1.3)
        if mark is not None:
            ax.axvline(mark, color="grey", linestyle=":", linewidth=1)
        ax.set_title(label, fontsize=10)
        ax.tick_params(labelsize=7)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        if k % cols == 0:
            ax.set_ylabel("W", fontsize=8)
        if k >= n - cols:
            ax.set_xlabel("step", fontsize=8)
            ax.xaxis.set_tick_params(labelbottom=True)
        if k == 0:
            ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return _save(fig, path)


def _kv_plot(res: ScenarioResult, path: Path) -> Path:
    fig = _figure(6.4, 4.4)
    ax = fig.add_subplot(1, 1, 1)
    pols = list(dict.fromkeys(r["policy"] for r in res.results))
    for p in pols:
        pts = [(r["kv_budget"], r["max_drift"]) for r in res.results if r["policy"] == p]
        ax.plot([x for x, _ in pts], [max(y, 1.0) for _, y in pts], marker="o", label=p, linewidth=1.2)
    bounds = sorted({(r["kv_budget"], r["bound"]) for r in res.results})
    ax.plot([x for x, _ in bounds], [y for _, y in bounds], color="black", linestyle="--",
            label="bound 2max(w_p L, w_q M)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("KV budget M (tokens)")
    ax.set_ylabel("max drift (weighted tokens)")
    ax.set_title("kv-sweep: drift vs M")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _rpm_plot(res: ScenarioResult, path: Path) -> Path:
    fig = _figure(6.4, 4.4)
    ax = fig.add_subplot(1, 1, 1)
    for r in res.results:
        lab = r["policy"] if r["policy"] != "fifo" else ("fifo (no limit)" if r["rpm"] is None else f"rpm {r['rpm']}")
        color = "tab:blue" if r["policy"] == "fifo" else "tab:green"
        ax.scatter([max(r["max_drift"], 1.0)], [r["throughput"]], color=color)
        ax.annotate(lab, (max(r["max_drift"], 1.0), r["throughput"]), fontsize=8, xytext=(4, 4),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("max drift (weighted tokens)")
    ax.set_ylabel("throughput (weighted tokens / step)")
    ax.set_title("rpm-sweep: throughput vs fairness")
    fig.tight_layout()
    return _save(fig, path)


def _waits_plot(res: ScenarioResult, path: Path) -> Path:
    every = list(res.results[0]["teams"]) if res.results else []
    # as the table: not the first team (a batch dump whose jobs mostly never start under any
    # policy, so its waits sit at the run's length everywhere and say nothing about fairness)
    shown = list(range(1, len(every))) if len(every) > 1 else list(range(len(every)))
    teams = [every[k] for k in shown]
    pols = [r["policy"] for r in res.results]
    runs = runs_by_row(res)
    fig = _figure(max(6.4, 1.1 * len(pols) * len(teams) / 2), 4.8)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(teams))
    x = np.arange(len(pols))
    for j, (k, t) in enumerate(zip(shown, teams)):
        cells = [censored_wait_quantiles(run, k, (50, 99)) if run is not None else
                 [(r["teams"][t]["wait_p50"], False), (r["teams"][t]["wait_p99"], False)]
                 for r, run in zip(res.results, runs)]
        p50 = [max(c[0][0] or 0, 0.5) for c in cells]
        p99 = [max(c[1][0] or 0, 0.5) for c in cells]
        bars99 = ax.bar(x + j * width, p99, width, alpha=0.35, color=f"C{k}")
        bars50 = ax.bar(x + j * width, p50, width, color=f"C{k}")
        for bars, q in ((bars50, 0), (bars99, 1)):
            for bar, c in zip(bars, cells):
                if c[q][1]:
                    bar.set_hatch("///")
    from matplotlib.patches import Patch

    handles = [Patch(color=f"C{k}", label=f"{t} (p50 solid, p99 light)") for k, t in zip(shown, teams)]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                         label="hatched: among requests still waiting at the end (at least this)"))
    ax.set_xticks(x + width * (len(teams) - 1) / 2)
    ax.set_xticklabels(pols)
    ax.set_yscale("log")
    ax.set_ylabel("wait before start (steps)")
    title = "teams: waits per team"
    if len(every) > 1:
        title += f" ({every[0]}'s batch dump outlasts the run under every policy: its service and completions are in the table)"
    ax.set_title(title, fontsize=9)
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, frameon=False)
    fig.tight_layout()
    return _save(fig, path)


def write_plots(res: ScenarioResult, out_dir: str | Path) -> list[Path]:
    """Write the scenario's PNGs into ``out_dir`` (created); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    if res.scenario == "kv-sweep":
        paths.append(_kv_plot(res, out / "kv-sweep-drift.png"))
        return paths
    if res.runs:
        paths.append(_service_plot(res, out / f"{res.scenario}-service.png"))
    if res.scenario == "rpm-sweep":
        paths.append(_rpm_plot(res, out / "rpm-sweep.png"))
    if res.scenario == "teams":
        paths.append(_waits_plot(res, out / "teams-waits.png"))
    return paths
