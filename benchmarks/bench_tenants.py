"""``sfq serve`` with many orgs: 10, 1,000 and 10,000 orgs in the policy file (one key each),
a load generator rotating over every org's key.

For each size, ``--runs`` times, a fresh ``sfq serve`` (``python -m sfq serve``, the access log
to a file) in front of the fast loopback upstream (``serve_upstream.py``):

* **start-up**: seconds from starting the process to its "listening" line (interpreter and
  imports included: a 10-org file gives the floor);
* **RSS at rest**: the gateway's resident memory once it listens (``/proc/PID/status``);
* **CPU per request**: a warm-up pass, then a closed-loop run (``wrk``, one thread, 32
  connections, a Lua script that gives each request the next org's key; without ``wrk``, an aiohttp client doing
  the same, which the table says): the gateway process's user + system CPU time
  (``/proc/PID/stat``) over the run, divided by the requests it answered. Every reply must be
  a 200;
* **RSS after traffic**: once every org has sent requests (the warm-up visits every key);
* **/metrics bytes**: the size of one ``GET /metrics`` once it listens (every org configured, none
  active) and after the traffic;
* **reload**: seconds from SIGHUP to the gateway's "reloaded" line (the same file, re-read and
  put in force), and the RSS after it.

The per-org figures are differences against the smallest size, divided by the difference in
orgs, so that the interpreter and the libraries cancel out. Medians over the runs. On a shared
machine compare the ratios (10,000 orgs / 10 orgs), which other load moves much less.

Usage: ``python benchmarks/bench_tenants.py [--sizes 10,1000,10000] [--runs 3] [--seconds 8]
[--quick]``; writes ``benchmarks/results/tenants.json`` (``--out``) and prints a markdown table.
Under pytest (CI's benchmark smoke run) ``test_bench_tenants_smoke`` runs the quick version at
10 orgs and at ``--sfq-sizes``'s largest size (nothing is timed; it checks that every request
was answered 200, that the reload took and that every org got its request through).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serve import Proc, upstream, uptime  # noqa: E402

BODY = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4})
CONNS = 32


def key(i: int) -> str:
    return f"sk-tenant-{i:05d}"


def policy_text(backend: str, n: int) -> str:
    """``n`` orgs, one key each, two classes each (the first, interactive, is what the load uses)."""
    head = f"""pools:
  main:
    models: [m]
    backends: [{{url: "{backend}", max_in_flight: 64}}]
classes:
  interactive: {{weight: 4}}
  batch: {{weight: 1}}
orgs:
"""
    return head + "".join(f"  org-{i:05d}: {{keys: [{key(i)}], classes: [interactive, batch]}}\n" for i in range(n))


LUA = """-- each request carries the next org's key (one wrk thread: the first n requests visit every key)
local n = {n}
local i = 0
local body = '{body}'
function request()
  local k = string.format("sk-tenant-%05d", i % n)
  i = i + 1
  return wrk.format("POST", "/v1/completions",
    {{["Content-Type"] = "application/json", ["Authorization"] = "Bearer " .. k}}, body)
end
"""


def wrk_run(url: str, n: int, seconds: float, tmp: Path) -> dict[str, Any]:
    script = tmp / f"rotate-{n}.lua"
    script.write_text(LUA.format(n=n, body=BODY))
    out = subprocess.run(["wrk", "-t1", f"-c{CONNS}", f"-d{max(1, round(seconds))}s", "-s", str(script),
                          url + "/v1/completions"], capture_output=True, text=True, timeout=seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed: {out.stderr[-2000:]}")
    text = out.stdout
    m = re.search(r"(\d+) requests in", text)
    if m is None:
        raise RuntimeError(f"wrk: no request count in its output:\n{text}")
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    errs = re.search(r"Socket errors:.*", text)
    return {"requests": int(m.group(1)), "non_200": int(bad.group(1)) if bad else 0,
            "socket_errors": errs.group(0) if errs else ""}


async def _client_run(url: str, n: int, seconds: float, first: int) -> dict[str, Any]:
    import aiohttp

    done = bad = 0
    nxt = first
    end = time.monotonic() + seconds

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal done, bad, nxt
        while time.monotonic() < end:
            k = key(nxt % n)
            nxt += 1
            async with s.post(url + "/v1/completions", data=BODY, headers={
                    "Authorization": f"Bearer {k}", "Content-Type": "application/json"}) as r:
                await r.read()
                done += 1
                bad += r.status != 200

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONNS)) as s:
        await asyncio.gather(*(worker(s) for _ in range(CONNS)))
    return {"requests": done, "non_200": bad, "socket_errors": ""}


def load(url: str, n: int, seconds: float, tmp: Path, tool: str) -> dict[str, Any]:
    if tool == "wrk":
        return wrk_run(url, n, seconds, tmp)
    return asyncio.run(_client_run(url, n, seconds, 0))


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return bytes(r.read())


def one_run(n: int, up: str, seconds: float, warm: float, tmp: Path, tool: str) -> dict[str, Any]:
    cfg = tmp / f"policy-{n}.yaml"
    cfg.write_text(policy_text(up, n))
    t0 = time.perf_counter()
    gw = Proc([sys.executable, "-m", "sfq", "serve", "--config", str(cfg), "--port", "0", "--grace", "1",
               "--access-log", str(tmp / "access.log")])
    try:
        url = gw.wait_for(r"listening on (http://\S+)", limit=120).group(1)
        startup = time.perf_counter() - t0
        time.sleep(0.5)  # (the collector's freeze runs once it listens)
        rest = gw.rss_kib()
        idle_metrics = _get(url + "/metrics")  # every org configured, none has sent anything yet
        # the warm-up visits every key at least once (wrk and the client both rotate)
        w: dict[str, Any] = {"requests": 0, "non_200": 0, "socket_errors": ""}
        while w["requests"] < n:
            x = load(url, n, warm, tmp, tool)
            w = {k: w[k] + x[k] for k in w}
        c0 = gw.cpu_seconds()
        r = load(url, n, seconds, tmp, tool)
        cpu = gw.cpu_seconds() - c0
        after = gw.rss_kib()
        metrics = _get(url + "/metrics")
        served = _counted(metrics)
        before = len(gw.lines)
        t1 = time.perf_counter()
        gw.proc.send_signal(signal.SIGHUP)
        gw.wait_for(r"reloaded .*: \d+ pools, \d+ classes, (\d+) orgs", limit=120)
        reload_s = time.perf_counter() - t1
        line = next(x for x in gw.lines[before:] if "reloaded" in x)
        reloaded_orgs = int(re.search(r"(\d+) orgs", line).group(1))  # type: ignore[union-attr]
        time.sleep(0.2)
        after_reload = gw.rss_kib()
    finally:
        gw.stop()
    return {"orgs": n, "startup_s": startup, "rss_rest_kib": rest, "rss_traffic_kib": after,
            "rss_reload_kib": after_reload, "requests": r["requests"], "warmup_requests": w["requests"],
            "non_200": r["non_200"] + w["non_200"], "socket_errors": r["socket_errors"] or w["socket_errors"],
            "cpu_us_per_request": 1e6 * cpu / max(r["requests"], 1), "metrics_bytes": len(metrics),
            "metrics_idle_bytes": len(idle_metrics),
            "orgs_counted": served, "reload_s": reload_s, "reloaded_orgs": reloaded_orgs}


def _counted(metrics: bytes) -> int:
    """The orgs with a completed request in ``sfq_requests_total`` (their own series)."""
    orgs = set()
    for line in metrics.decode().splitlines():
        if line.startswith("sfq_requests_total{") and 'outcome="completed"' in line:
            m = re.search(r'org="([^"]*)"', line)
            if m and float(line.rsplit(" ", 1)[1]) > 0:
                orgs.add(m.group(1))
    return len(orgs)


def _med(runs: list[dict[str, Any]], k: str) -> float:
    return float(statistics.median(r[k] for r in runs))


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    rows = {}
    for n, runs in res["runs"].items():
        rows[n] = {k: _med(runs, k) for k in ("startup_s", "rss_rest_kib", "rss_traffic_kib", "rss_reload_kib",
                                               "cpu_us_per_request", "metrics_bytes", "metrics_idle_bytes", "reload_s",
                                               "requests")}
    sizes = sorted(rows, key=int)
    lo = sizes[0]
    for n in sizes[1:]:
        d = int(n) - int(lo)
        r = rows[n]
        r["rest_bytes_per_org"] = 1024 * (r["rss_rest_kib"] - rows[lo]["rss_rest_kib"]) / d
        r["traffic_bytes_per_org"] = 1024 * (r["rss_traffic_kib"] - rows[lo]["rss_traffic_kib"]) / d
        r["cpu_ratio"] = r["cpu_us_per_request"] / rows[lo]["cpu_us_per_request"]
        r["startup_ratio"] = r["startup_s"] / rows[lo]["startup_s"]
    return rows


def table(res: dict[str, Any]) -> str:
    rows = res["summary"]
    sizes = sorted(rows, key=int)
    out = [f"| orgs | start-up | RSS at rest | RSS after traffic | CPU per request ({res['tool']}) | "
           f"/metrics, none active | /metrics, all active | SIGHUP reload | RSS after reload |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sizes:
        r = rows[n]
        cpu = f"{r['cpu_us_per_request']:.0f} µs"
        st = f"{r['startup_s']:.2f} s"
        rest = f"{r['rss_rest_kib'] / 1024:.1f} MB"
        tr = f"{r['rss_traffic_kib'] / 1024:.1f} MB"
        if "cpu_ratio" in r:
            cpu += f" ({r['cpu_ratio']:.2f}x)"
            st += f" ({r['startup_ratio']:.2f}x)"
            rest += f" (+{r['rest_bytes_per_org'] / 1024:.2f} KB/org)"
            tr += f" (+{r['traffic_bytes_per_org'] / 1024:.2f} KB/org)"
        out.append(f"| {int(n):,} | {st} | {rest} | {tr} | {cpu} | {r['metrics_idle_bytes'] / 1024:,.1f} KB | "
                   f"{r['metrics_bytes'] / 1024:,.0f} KB | "
                   f"{r['reload_s']:.2f} s | {r['rss_reload_kib'] / 1024:.1f} MB |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,1000,10000")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0, help="the measured run, per gateway")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 run, 1 s of load (not for quoting)")
    ap.add_argument("--client", choices=("auto", "wrk", "aiohttp"), default="auto")
    ap.add_argument("--out", default=str(HERE / "results" / "tenants.json"))
    a = ap.parse_args(argv)
    sizes = [int(x.replace("_", "")) for x in a.sizes.split(",") if x]
    if len(sizes) < 2:
        ap.error("--sizes: give at least two sizes (the per-org figures are differences)")
    tool = a.client if a.client != "auto" else ("wrk" if shutil.which("wrk") else "aiohttp")
    if tool == "wrk" and shutil.which("wrk") is None:
        ap.error("--client wrk: wrk is not installed (apt-get install wrk)")
    runs, seconds, warm = (1, 1.0, 1.0) if a.quick else (a.runs, a.seconds, 3.0)
    res: dict[str, Any] = {"tool": tool, "conns": CONNS, "seconds": seconds, "quick": a.quick, "cores": os.cpu_count(),
                           "uptime_before": uptime(), "runs": {str(n): [] for n in sizes}}
    with tempfile.TemporaryDirectory() as d, upstream(None) as up:
        tmp = Path(d)
        for _ in range(runs):  # sizes interleaved, so that a change in the machine's load hits all of them
            for n in sizes:
                r = one_run(n, up, seconds, warm, tmp, tool)
                print(f"{n} orgs: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})}",
                      file=sys.stderr)
                res["runs"][str(n)].append(r)
    res["uptime_after"] = uptime()
    res["summary"] = summarise(res)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"load before: {res['uptime_before']}; after: {res['uptime_after']}")
    print(table(res))
    return res


def test_bench_tenants_smoke(tmp_path: Path, request: Any) -> None:
    """CI's smoke run: the quick version at 10 orgs and at the largest ``--sfq-sizes``; every
    request answered 200, every org served, the reload in force (nothing timed)."""
    big = max(int(x) for x in str(request.config.getoption("--sfq-sizes")).split(",") if x.strip())
    res = main(["--quick", "--sizes", f"10,{max(big, 20)}", "--out", str(tmp_path / "tenants.json")])
    for n, runs in res["runs"].items():
        for r in runs:
            assert r["non_200"] == 0 and not r["socket_errors"], r
            assert r["requests"] > 0 and r["orgs_counted"] == int(n), r
            assert r["reloaded_orgs"] == int(n), r


if __name__ == "__main__":
    main()
