"""The garbage collector's time per request and per streamed chunk in ``sfq serve``.

``sfq serve`` (one org, its defaults: the set-up of ``bench_proxy.py``, pinned the same way)
runs inside a small wrapper that times every collection with ``gc.callbacks``, per
generation; after a warm-up the tallies are zeroed (SIGUSR1), ``wrk`` runs for ``--seconds``,
and at exit the wrapper writes them out. Checkouts (``--sfq NAME=DIR``) run in turn, for
``--rounds`` rounds. The collector's time is wall time inside ``gc_collect_main``, where the
process does nothing else: its CPU time, freeing the garbage it finds included.

Instruction counts (``count_serve.py``) hardly see the collector: it walks the heap, a cache
miss per object, and its cost is in the misses, not the instructions.

Run from the repository root (nginx, its echo module and wrk installed)::

    python benchmarks/gc_serve.py --sfq before=/path/to/old/python --sfq after=python
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_proxy as bp  # noqa: E402

WRAPPER = '''
import gc, os, runpy, signal, sys, time, json
tally = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
t0 = [0.0]
def timed(phase, info):
    if phase == "start":
        t0[0] = time.perf_counter()
    else:
        g = tally[info["generation"]]
        g[0] += 1
        g[1] += time.perf_counter() - t0[0]
def zero(*_):
    for g in tally.values():
        g[0], g[1] = 0, 0.0
def write():
    with open(os.environ["SFQ_GC_TALLY"], "w") as fh:
        json.dump({"tally": tally, "threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}, fh)
gc.callbacks.append(timed)
signal.signal(signal.SIGUSR1, zero)
import atexit
atexit.register(write)
sys.argv = ["sfq"] + sys.argv[1:]
runpy.run_module("sfq", run_name="__main__", alter_sys=True)
'''


def one(name: str, path: str, mode: str, upstream: str, seconds: float, tmp: Path) -> dict[str, Any]:
    proxy_cpu, load_cpu = bp.cpu_plan()
    cfg = tmp / f"{name}-{mode}.yaml"
    cfg.write_text(bp.policy_text(upstream))
    wrapper = tmp / "gc_wrapper.py"
    wrapper.write_text(WRAPPER)
    tally = tmp / f"{name}-{mode}.json"
    p = bp.Proc(name, [sys.executable, str(wrapper), "serve", "--config", str(cfg), "--port", "0",
                       "--access-log", str(tmp / f"{name}.access.log")], cpu=proxy_cpu,
                env={"PYTHONPATH": path, "SFQ_GC_TALLY": str(tally)})
    try:
        url = p.wait_for(r"listening on (http://\S+)").group(1)
        lua = bp.lua_script(tmp, mode, bp.CHAT_BODY if mode == "plain" else bp.STREAM_BODY)
        conns = 64 if mode == "plain" else 16
        bp.wrk(url, lua, conns=conns, seconds=1, cpu=load_cpu)  # warm-up
        p.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
        with bp.measured(p, proxy_cpu) as m:
            w = bp.wrk(url, lua, conns=conns, seconds=seconds, cpu=load_cpu)
    finally:
        p.stop()
    t = json.loads(tally.read_text())
    units = w["requests"] * (1 if mode == "plain" else bp.EVENTS)
    gc_s = sum(v[1] for v in t["tally"].values())
    return {"units": units, "gc_us_per_unit": gc_s / units * 1e6, "cpu_us_per_unit": m["cpu_s"] / units * 1e6,
            "collections": {g: v[0] for g, v in t["tally"].items()}, "threshold": t["threshold"],
            "frozen": t["frozen"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sfq", action="append", type=bp._sfq_spec, metavar="NAME=DIR",
                    help="a checkout (repeatable; default: this one)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the checkouts (2)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of each wrk run (5)")
    ap.add_argument("--modes", default="plain,stream", help="comma-separated: plain, stream")
    ap.add_argument("--out", default=str(HERE / "results" / "gc-serve.json"))
    a = ap.parse_args(argv)
    if bp.missing_tools():
        raise SystemExit(f"gc_serve needs {', '.join(bp.missing_tools())}")
    checkouts = a.sfq or [("this", bp.sfq_pythonpath())]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    res: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "uptime_before": bp.uptime(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="gc-serve-") as d:
        tmp = Path(d)
        up_json, up_sse = bp.free_port(), bp.free_port()
        module = bp.echo_module()
        up = bp._nginx(tmp, "upstream", bp.upstream_http(up_json, up_sse, 1.0, module is not None),
                       [up_json, up_sse], bp.cpu_plan()[1], module)
        try:
            for r in range(a.rounds):
                for mode in modes:
                    for name, path in checkouts:
                        port = up_json if mode == "plain" else up_sse
                        run = one(name, path, mode, f"http://127.0.0.1:{port}", a.seconds, tmp)
                        run.update(name=name, mode=mode, round=r)
                        res["runs"].append(run)
                        print(f"round {r + 1} {mode:6s} {name:10s} GC {run['gc_us_per_unit']:6.2f} us per "
                              f"{'request' if mode == 'plain' else 'chunk'} (CPU {run['cpu_us_per_unit']:.0f} us; "
                              f"collections {run['collections']})", file=sys.stderr, flush=True)
        finally:
            up.stop()
    res["uptime_after"] = bp.uptime()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    rows = ["| checkout | GC per request | GC per streamed chunk | collections (gen 0/1/2) per 1,000 requests |",
            "| --- | ---: | ---: | --- |"]
    for name, _ in checkouts:
        cells = []
        for mode in ("plain", "stream"):
            xs = [x["gc_us_per_unit"] for x in res["runs"] if x["name"] == name and x["mode"] == mode]
            cells.append(f"{statistics.median(xs):.2f} µs ({min(xs):.2f}-{max(xs):.2f})" if xs else "-")
        plain = [x for x in res["runs"] if x["name"] == name and x["mode"] == "plain"]
        per = "/".join(f"{sum(x['collections'][g] for x in plain) / max(1, sum(x['units'] for x in plain)) * 1e3:.1f}"
                       for g in ("0", "1", "2")) if plain else "-"
        rows.append(f"| {name} | {cells[0]} | {cells[1]} | {per} |")
    print("\n".join(rows))
    return res


if __name__ == "__main__":
    main()
