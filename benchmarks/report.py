"""Run the sfq benchmark suite and rewrite the benchmark section of benchmarks/README.md and
its plot from it.

    python benchmarks/report.py                    # run everything (~6 min on 2 quiet cores), then report
    python benchmarks/report.py --from-json FILE   # only regenerate the section and plot

Steps: (1) ``pytest benchmarks --benchmark-json=FILE`` (the suite in ``bench_core.py``), (2) the
memory measurement of ``memory.py`` (merged into FILE under ``"sfq_memory"``), (3) the section
of ``benchmarks/README.md`` between ``<!-- bench:start -->`` and ``<!-- bench:end -->``
(nothing else in the file is touched) and ``docs/bench.png``, both computed from FILE alone, so
``--from-json`` reproduces them. The section says which machine produced the numbers (from FILE, not from this machine).

All times are medians over rounds, divided by the pairs a round performs: **ns per pair**.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_JSON = HERE / "results" / "bench.json"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"

IMPL_ORDER = ("compiled", "twin", "heapq", "minimal", "floor")
DEFAULT_IMPLS = ",".join(IMPL_ORDER)
SCHEDULERS = ("compiled", "twin", "heapq")  # implementations of the whole contract (every group)
GROUPS = {  # group -> (title, what one pair is, the heapq group to compare with)
    "steady": ("steady state", "`dispatch()` + `enqueue(d.flow, cost, d.item)`", "steady"),
    "batch": ("steady state, batch API", "`dispatch_many(n)` + `enqueue_many(...)`, per request", "steady"),
    "burst": ("burst", "enqueue 4T requests, then drain; per request", "burst"),
    "burst-batch": ("burst, batch API", "`enqueue_many` of 4T, `dispatch_many(4T)`; per request", "burst"),
    "churn": ("churn", "fresh-key flows come and go among the T backlogged; per request", "churn"),
    "cancel": ("cancel-heavy", "half the requests cancelled while waiting; per request", "cancel"),
}
TARGETS = {  # the project's performance targets, at T = 10k, medians of one run
    "minimal_over_compiled": 5.0,    # per-call pair: at least this many times faster than the minimal heapq
    "compiled_over_floor": 3.0,      # per-call pair: within this factor of the C floor
    "batch_over_floor": 2.0,         # batch pair: within this factor of the C floor
    "growth_100k_over_1k": 3.0,      # per-call pair, T = 100k over T = 1k
    "queued_request_bytes": 32.0,
    "idle_flow_bytes": 128.0,
}


# --------------------------------------------------------------------------- running
def _pythonpath_env() -> dict[str, str]:
    env = dict(os.environ)
    probe = subprocess.run([sys.executable, "-c", "import sfq"], capture_output=True, env=env, cwd=ROOT)
    if probe.returncode != 0:  # not installed: run from the checkout
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    return env


def run_suite(json_path: Path, pytest_args: list[str]) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pytest", str(HERE / "bench_core.py"),
        "-p", "no:cacheprovider",
        f"--benchmark-json={json_path}",
        "--benchmark-group-by=group",
        "--benchmark-sort=name",
        "--benchmark-columns=median,iqr,rounds",
        "-q", "-W", "ignore::RuntimeWarning",
        *pytest_args,
    ]
    print("+", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT, env=_pythonpath_env()).returncode
    if rc != 0:
        sys.exit(f"report.py: the benchmark suite failed (pytest exit status {rc}); README left unchanged")


def run_memory(json_path: Path, impls: str) -> None:
    cmd = [sys.executable, str(HERE / "memory.py"), "--json", "--impls", impls]
    print("+", " ".join(cmd), flush=True)
    res = subprocess.run(cmd, cwd=ROOT, env=_pythonpath_env(), capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stderr)
        sys.exit(f"report.py: memory.py failed (exit status {res.returncode}); README left unchanged")
    data = json.loads(json_path.read_text())
    data["sfq_memory"] = json.loads(res.stdout)
    json_path.write_text(json.dumps(data, indent=1) + "\n")


# --------------------------------------------------------------------------- reading
NS = dict[tuple[str, int, str], float]  # (group, T, implementation) -> ns per pair


def load(json_path: Path) -> tuple[dict[str, Any], NS]:
    """(the JSON, {(group, T, impl): ns per pair (median)})"""
    data = json.loads(json_path.read_text())
    ns: NS = {}
    for b in data["benchmarks"]:
        x = b.get("extra_info", {})
        if not {"group", "impl", "T", "pairs"} <= x.keys():
            continue
        ns[(x["group"], int(x["T"]), x["impl"])] = b["stats"]["median"] / x["pairs"] * 1e9
    if not ns:
        sys.exit(f"report.py: {json_path} holds no sfq benchmark results")
    return data, ns


def rounds_note(data: dict[str, Any]) -> str:
    per: dict[str, set[int]] = defaultdict(set)
    for b in data["benchmarks"]:
        x = b.get("extra_info", {})
        if "impl" in x:
            per[x["impl"]].add(b["stats"]["rounds"])
    parts = []
    for impl in IMPL_ORDER:
        if per.get(impl):
            r = sorted(per[impl])
            parts.append(f"{impl} {r[0]}" if len(r) == 1 else f"{impl} {r[0]}-{r[-1]}")
    return ", ".join(parts)


# --------------------------------------------------------------------------- formatting
def fmt_ns(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def fmt_ratio(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.1f}x" if x >= 1 else f"{x:.2f}x"


def ok(flag: bool | None) -> str:
    return "–" if flag is None else ("yes" if flag else "**no**")


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x and y else None


def targets(ns: NS, mem: dict[str, Any] | None) -> list[tuple[str, str, str, bool | None]]:
    """(target, limit, measured, met?) rows for the performance targets."""
    rows = []
    T = 10_000
    c = ns.get(("steady", T, "compiled"))
    r = _ratio(ns.get(("steady", T, "minimal")), c)
    rows.append(("per-call pair, minimal heapq ÷ compiled, T=10k", f">= {TARGETS['minimal_over_compiled']:.0f}x",
                 fmt_ratio(r), None if r is None else r >= TARGETS["minimal_over_compiled"]))
    fl = ns.get(("steady", T, "floor"))
    r = _ratio(c, fl)
    rows.append(("per-call pair, compiled ÷ C floor, T=10k", f"<= {TARGETS['compiled_over_floor']:.0f}x",
                 fmt_ratio(r), None if r is None else r <= TARGETS["compiled_over_floor"]))
    r = _ratio(ns.get(("batch", T, "compiled")), fl)
    rows.append(("batch pair, compiled batch ÷ C floor, T=10k", f"<= {TARGETS['batch_over_floor']:.0f}x",
                 fmt_ratio(r), None if r is None else r <= TARGETS["batch_over_floor"]))
    r = _ratio(ns.get(("steady", 100_000, "compiled")), ns.get(("steady", 1_000, "compiled")))
    rows.append(("per-call pair, compiled, T=100k ÷ T=1k", f"<= {TARGETS['growth_100k_over_1k']:.0f}x",
                 fmt_ratio(r), None if r is None else r <= TARGETS["growth_100k_over_1k"]))
    m = (mem or {}).get("results", {}).get("compiled")
    for key, what, tkey in (("queued_request", "core memory per queued request", "queued_request_bytes"),
                            ("idle_flow", "core memory per idle known flow", "idle_flow_bytes")):
        if m and m.get(key):
            n = max(m[key], key=int)
            v = m[key][n]
            rows.append((f"{what} (n={int(n):,})", f"<= {TARGETS[tkey]:.0f} B", f"{v:.0f} B", v <= TARGETS[tkey]))
        else:
            rows.append((what, f"<= {TARGETS[tkey]:.0f} B", "not measured", None))
    return rows


def markdown(data: dict[str, Any], ns: NS, plot_rel: str | None) -> str:
    info = data.get("sfq", {})
    mem = data.get("sfq_memory")
    sizes = sorted({t for (_, t, _) in ns})
    L: list[str] = []
    L.append("## The latest run")
    L.append("")
    machine = (f"{info.get('cpu_model', '?')}, {info.get('cores', '?')} cores, "
               f"{info.get('python_implementation', 'Python')} {info.get('python', '?')}, numpy {info.get('numpy', '?')}")
    load = info.get("loadavg_before"), info.get("loadavg_after")
    when = data.get("datetime", "?")[:16].replace("T", " ")
    L.append(f"Produced by `python benchmarks/report.py` on {when} UTC, on {machine}; "
             f"load average {load[0][0] if load[0] else '?'} before and {load[1][0] if load[1] else '?'} after "
             f"the {info.get('wall_s', '?')} s run (a shared, noisy machine: compare medians and ratios "
             f"within this table, not across machines).")
    if info.get("sfq_core") != "compiled":
        L.append("")
        L.append(f"**Warning: `sfq.Scheduler` was the `{info.get('sfq_core')}` core in this run, "
                 "not the compiled one; the `compiled` column is not the compiled core.**")
    if info.get("options", {}).get("quick"):
        L.append("")
        L.append("**Warning: a `--sfq-quick` smoke run; these numbers are not for quoting.**")
    L.append("")
    L.append("Median **ns per pair** (one request's enqueue plus its dispatch) in the steady state: T flows, "
             "each backlogged with 4 requests, costs uniform in [1, 1000], weights in {1, 2, 4, 8}. "
             "`compiled` is `sfq.Scheduler` per call (`d = s.dispatch(); s.enqueue(d.flow, cost, d.item)`, "
             "a payload object per request), `batch` the same core through `dispatch_many(n)` + "
             "`enqueue_many(...)` (n = min(1024, T/4)), `twin` the pure-Python `sfq.ReferenceScheduler`, "
             "`heapq` a full-contract heapq SFQ (tickets, cancel, any hashable flow id, result objects; "
             "`benchmarks/heapq_sfq.py`), `minimal` the minimal heapq SFQ a user would write (int flow ids, "
             "a heap of (S, head ticket, id), a deque per flow, no payloads, no cancel; "
             "`benchmarks/minimal_heapq.py`), `C floor` the same pairs on the same data as a C loop over a "
             "packed 4-ary heap, no Python per pair (`benchmarks/cfloor.pyx`). The minimal heapq and the "
             "C floor make the compiled core's decisions (checked pair for pair by the suite).")
    L.append("")
    L.append("| T | compiled | batch | twin | heapq | minimal | C floor | minimal ÷ compiled "
             "| heapq ÷ compiled | compiled ÷ C floor | batch ÷ C floor |")
    L.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    cols = [("steady", "compiled"), ("batch", "compiled"), ("steady", "twin"), ("steady", "heapq"),
            ("steady", "minimal"), ("steady", "floor")]
    for T in sizes:
        v = [ns.get((g, T, i)) for g, i in cols]
        if not any(x is not None for x in v):
            continue
        c, bt, _, hq, mn, fl = v
        L.append(f"| {T:,} | " + " | ".join(fmt_ns(x) for x in v) + " | "
                 + " | ".join(fmt_ratio(r) for r in (_ratio(mn, c), _ratio(hq, c), _ratio(c, fl), _ratio(bt, fl)))
                 + " |")
    if 1_000 in sizes and 100_000 in sizes:
        growth = [_ratio(ns.get((gg, 100_000, i)), ns.get((gg, 1_000, i))) for gg, i in cols]
        L.append("| T=100k ÷ T=1k | " + " | ".join(fmt_ratio(x) for x in growth) + " | | | | |")
    L.append("")
    others = [g for g in GROUPS if g not in ("steady", "batch")]
    if any(k[0] in others for k in ns):
        impls = [i for i in SCHEDULERS if any(k[2] == i for k in ns)]
        L.append("The other workloads, on the implementations of the whole contract (ns per pair; "
                 "speed-up = full-contract heapq ÷ implementation, the batch rows against heapq's per-call row):")
        L.append("")
        L.append("| group | T | " + " | ".join(impls) + " | "
                 + " | ".join(f"heapq ÷ {i}" for i in impls if i != "heapq") + " |")
        L.append("|" + "---|" * (2 + len(impls) + len([i for i in impls if i != "heapq"])))
        for g in others:
            title, _, base = GROUPS[g]
            for T in sizes:
                row = {i: ns.get((g, T, i)) for i in impls}
                if not any(x is not None for x in row.values()):
                    continue
                h = ns.get((base, T, "heapq"))
                cells = [fmt_ns(row[i]) if (i != "heapq" or g == base) else "–" for i in impls]
                ratios = [fmt_ratio(_ratio(h, row[i])) for i in impls if i != "heapq"]
                L.append(f"| {title} | {T:,} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
        L.append("")
        L.append("Groups: " + "; ".join(f"**{GROUPS[g][0]}**: {GROUPS[g][1]}" for g in others) + ".")
        L.append("")
    L.append(f"Rounds per benchmark: {rounds_note(data)} (fewer for the slow pure-Python columns, to keep "
             "the run within minutes). What each column and group measures, and where the core's time goes: "
             "the sections below.")
    L.append("")
    L.append("Targets (T = 10k unless said), this run:")
    L.append("")
    L.append("| target | limit | measured | met |")
    L.append("|---|---|---|---|")
    for what, limit, got, met in targets(ns, mem):
        L.append(f"| {what} | {limit} | {got} | {ok(met)} |")
    L.append("")
    if mem:
        L.append(f"Memory (tracemalloc; the core's C arrays are `PyMem_*` allocations, so they are traced; "
                 f"flow ids, payloads and cost objects are the caller's and not counted), bytes per:")
        L.append("")
        L.append("| implementation | n | idle known flow | dormant flow (weight only) | queued request |")
        L.append("|---|---|---|---|---|")
        for impl in IMPL_ORDER:
            r = mem.get("results", {}).get(impl)
            if not r:
                continue
            for n in sorted(r["idle_flow"], key=int):
                L.append(f"| {impl} | {int(n):,} | {r['idle_flow'][n]:.0f} | {r['dormant_flow'][n]:.0f} "
                         f"| {r['queued_request'][n]:.0f} |")
        L.append("")
    else:
        L.append("Memory: not measured in this run.")
        L.append("")
    if plot_rel:
        L.append(f"![ns per pair vs number of flows]({plot_rel})")
        L.append("")
    return "\n".join(L)


def rewrite_readme(readme: Path, section: str) -> None:
    text = readme.read_text()
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        sys.exit(f"report.py: {readme} must hold exactly one {START} ... {END} pair; left unchanged")
    a = text.index(START) + len(START)
    b = text.index(END)
    new = text[:a] + "\n" + section.rstrip("\n") + "\n" + text[b:]
    if new != text:
        readme.write_text(new)


def plot(ns: NS, data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("steady", "batch", "steady state"), ("burst", "burst-batch", "burst"),
              ("churn", None, "churn"), ("cancel", None, "cancel-heavy")]
    styles = {"compiled": ("C0", "o"), "twin": ("C1", "s"), "heapq": ("C2", "^"), "minimal": ("C3", "v"),
              "floor": ("k", "x")}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5), sharex=True, sharey=True)
    for ax, (g, gb, title) in zip(axes.flat, panels):
        for impl in IMPL_ORDER:
            color, marker = styles[impl]
            for grp, ls, suffix in ((g, "-", ""), (gb, "--", " (batch)")):
                if grp is None:
                    continue
                pts = sorted((T, v) for (gg, T, i), v in ns.items() if gg == grp and i == impl)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=color, marker=marker,
                            label=impl + suffix)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("flows T (each backlogged, depth 4)")
    for ax in axes[:, 0]:
        ax.set_ylabel("ns per pair (median)")
    info = data.get("sfq", {})
    fig.suptitle(f"sfq core: ns per enqueue+dispatch pair vs flows — {info.get('cpu_model', '?')}, "
                 f"{info.get('cores', '?')} cores, Python {info.get('python', '?')}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the sfq benchmarks; rewrite benchmarks/README.md's table and plot.",
                                 epilog="Arguments after -- go to pytest (e.g. -- -k steady).")
    ap.add_argument("--from-json", type=Path, nargs="?", const=DEFAULT_JSON, default=None, metavar="FILE",
                    help=f"regenerate from an existing pytest-benchmark JSON (default {DEFAULT_JSON.relative_to(ROOT)}); runs nothing")
    ap.add_argument("--json", type=Path, default=None,
                    help=f"where the run saves its JSON (default {DEFAULT_JSON.relative_to(ROOT)}; "
                         "a partial, quick or no-readme run defaults to a scratch file beside it, "
                         "so the JSON behind the table is only replaced by a full run)")
    ap.add_argument("--readme", type=Path, default=HERE / "README.md",
                    help="the Markdown file whose bench markers are rewritten (benchmarks/README.md)")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "bench.png")
    ap.add_argument("--no-readme", action="store_true", help="print the section, do not touch the Markdown file or the plot")
    ap.add_argument("--sizes", help="comma-separated T values (default: 100,1000,10000,100000)")
    ap.add_argument("--impls", default=DEFAULT_IMPLS, help=f"comma-separated implementations (default {DEFAULT_IMPLS})")
    ap.add_argument("--quick", action="store_true", help="smoke run (fewer pairs/rounds; marked as such)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    a = ap.parse_args(argv)

    if a.json is None:
        partial = a.quick or a.no_readme or a.sizes or extra or a.impls != DEFAULT_IMPLS
        a.json = DEFAULT_JSON.with_name("bench-scratch.json") if partial else DEFAULT_JSON
    json_path = a.from_json if a.from_json is not None else a.json
    if a.from_json is None:
        pytest_args = [f"--sfq-impls={a.impls}"]
        if a.sizes:
            pytest_args.append(f"--sfq-sizes={a.sizes}")
        if a.quick:
            pytest_args.append("--sfq-quick")
        run_suite(json_path, pytest_args + extra)
        if not a.no_memory:
            mem_impls = ",".join(i for i in a.impls.split(",") if i in SCHEDULERS)
            if mem_impls:
                run_memory(json_path, mem_impls)
    data, ns = load(json_path)
    plot_rel = None
    if not a.no_readme:
        plot(ns, data, a.plot)
        try:
            plot_rel = os.path.relpath(a.plot, a.readme.resolve().parent)
        except ValueError:
            plot_rel = str(a.plot)
    section = markdown(data, ns, plot_rel)
    print(section)
    if not a.no_readme:
        rewrite_readme(a.readme, section)
        print(f"report.py: rewrote {a.readme} between the bench markers and {a.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
