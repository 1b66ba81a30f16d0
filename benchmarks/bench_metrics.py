"""The size and cost of ``/metrics`` and ``/stats`` with many orgs (issue 31), not a timed test.

``sfq serve`` with a policy of ``--orgs`` orgs (default 10,000; ``--classes`` classes each,
default one; one pool, over the fast loopback upstream ``serve_upstream.py``), measured twice:

1. **configured, none active**: right after the start;
2. **all active**: after every org sent ``--requests`` requests in each of its classes (aiohttp,
   64 at a time).

Each time: the bytes and lines of one ``/metrics`` scrape and of one ``/stats``, the wall time
of a scrape (median of ``--scrapes``; the client is in this process, the gateway alone on its
core), the number of distinct ``org`` labels, and the gateway's RSS. ``--sfq NAME=DIR``
(repeatable) measures ``sfq serve`` from the checkout ``DIR`` (``PYTHONPATH``), e.g. the tree
before the bounded series, side by side. A checkout without ``/stats`` shows ``-``.

Run from the repository root::

    python benchmarks/bench_metrics.py                       # this checkout, 10,000 orgs
    python benchmarks/bench_metrics.py --sfq before=../wt-base/python --sfq after=python

Results go to ``benchmarks/results/metrics.json`` and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BODY = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4}).encode()


def class_names(n: int) -> list[str]:
    """``batch``, then ``class1``, ``class2``, ... (``--classes``)."""
    return ["batch"] + [f"class{j}" for j in range(1, n)]


def policy(upstream: str, orgs: int, classes: int = 1) -> str:
    names = class_names(classes)
    lines = "\n".join(f'  org{i}: {{keys: ["sk-{i}"], classes: [{", ".join(names)}]}}' for i in range(orgs))
    defs = "\n".join(f"  {c}: {{weight: 1}}" for c in names)
    return f"""pools:
  main:
    models: [m]
    backends: [{{url: "{upstream}", max_in_flight: 256}}]
classes:
{defs}
orgs:
{lines}
"""


class Proc:
    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=None if env is None else {**os.environ, **env})
        self.lines: list[str] = []

    def wait_for(self, pattern: str, limit: float = 120.0) -> re.Match[str]:
        deadline = time.monotonic() + limit
        assert self.p.stdout is not None
        while time.monotonic() < deadline:
            line = self.p.stdout.readline().decode("utf-8", "replace")
            if not line:
                break
            self.lines.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise RuntimeError(f"no {pattern!r} in the output:\n{''.join(self.lines[-30:])}")

    def rss(self) -> int:
        with open(f"/proc/{self.p.pid}/status") as fh:
            return next(int(x.split()[1]) << 10 for x in fh if x.startswith("VmRSS:"))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(30)


def get(url: str) -> tuple[int, bytes, float]:
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            body = r.read()
            return r.status, body, time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read(), time.perf_counter() - t0


def reading(url: str, proc: Proc, scrapes: int) -> dict[str, Any]:
    times = []
    body = b""
    for _ in range(scrapes):
        status, body, t = get(url + "/metrics")
        assert status == 200
        times.append(t)
    text = body.decode()
    orgs = set(re.findall(r'org="([^"]*)"', text))
    st, sbody, stime = get(url + "/stats")
    return {"metrics_bytes": len(body), "metrics_lines": text.count("\n"), "scrape_ms": statistics.median(times) * 1e3,
            "org_labels": len(orgs), "other": "_other" in orgs,
            "stats_bytes": len(sbody) if st == 200 else None, "stats_ms": stime * 1e3 if st == 200 else None,
            "rss_mb": proc.rss() / 2**20}


async def drive(url: str, orgs: int, per_org: int, classes: int = 1) -> dict[str, int]:
    import aiohttp

    sem = asyncio.Semaphore(64)
    codes: dict[str, int] = {}

    async def one(s: aiohttp.ClientSession, i: int, cls: str) -> None:
        async with sem:
            async with s.post(url + "/v1/completions", data=BODY, headers={
                    "Authorization": f"Bearer sk-{i}", "X-SFQ-Class": cls, "Content-Type": "application/json"}) as r:
                await r.read()
                codes[str(r.status)] = codes.get(str(r.status), 0) + 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as s:
        await asyncio.gather(*(one(s, i, c) for i in range(orgs) for c in class_names(classes)
                               for _ in range(per_org)))
    return codes


def measure(name: str, path: str, a: argparse.Namespace, tmp: Path, upstream: str) -> dict[str, Any]:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(policy(upstream, a.orgs, a.classes))
    gw = Proc([sys.executable, "-m", "sfq", "serve", "--config", str(cfg), "--port", "0", "--access-log", "off"],
              env={"PYTHONPATH": path})
    try:
        url = gw.wait_for(r"listening on (http://\S+)").group(1)
        out: dict[str, Any] = {"checkout": path, "idle": reading(url, gw, a.scrapes)}
        t0 = time.monotonic()
        out["codes"] = asyncio.run(drive(url, a.orgs, a.requests, a.classes))
        out["drive_s"] = time.monotonic() - t0
        out["active"] = reading(url, gw, a.scrapes)
        return out
    finally:
        gw.stop()


def table(res: dict[str, Any]) -> str:
    rows = ["| checkout | orgs | `/metrics` (lines) | scrape | org labels | `/stats` | RSS |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in res["runs"].items():
        for when in ("idle", "active"):
            x = r[when]
            stats = "-" if x["stats_bytes"] is None else f"{x['stats_bytes'] / 1e6:.3f} MB ({x['stats_ms']:.0f} ms)"
            rows.append(f"| {name} | {res['orgs']:,} {'configured, none active' if when == 'idle' else 'active'} | "
                        f"{x['metrics_bytes'] / 1e6:.3f} MB ({x['metrics_lines']:,}) | {x['scrape_ms']:.0f} ms | "
                        f"{x['org_labels'] - x['other']:,}{' + _other' if x['other'] else ''} | {stats} | "
                        f"{x['rss_mb']:.0f} MB |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--orgs", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=1, help="requests per org and class (1)")
    ap.add_argument("--classes", type=int, default=1, help="classes per org, each sent --requests (1)")
    ap.add_argument("--scrapes", type=int, default=5, help="scrapes per reading; the median time is kept (5)")
    ap.add_argument("--sfq", action="append", metavar="NAME=DIR", help="a checkout's python/ (repeatable)")
    ap.add_argument("--out", default=str(HERE / "results" / "metrics.json"))
    a = ap.parse_args(argv)
    if a.orgs < 1 or a.requests < 1 or a.scrapes < 1 or a.classes < 1:
        ap.error("--orgs, --requests, --classes and --scrapes must be >= 1")
    checkouts = [tuple(x.split("=", 1)) for x in a.sfq] if a.sfq else [("this", str(ROOT / "python"))]
    res: dict[str, Any] = {"orgs": a.orgs, "requests_per_org": a.requests, "classes": a.classes,
                           "python": sys.version.split()[0],
                           "load_before": os.getloadavg(), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as d:
        tmp = Path(d)
        port_proc = Proc([sys.executable, str(HERE / "serve_upstream.py"), "0"])
        try:
            port = port_proc.wait_for(r"ready (\d+)").group(1)
            for name, path in checkouts:
                res["runs"][name] = measure(name, str(Path(path).resolve()), a, tmp, f"http://127.0.0.1:{port}")
                print(f"{name}: {res['runs'][name]}", file=sys.stderr, flush=True)
        finally:
            port_proc.stop()
    res["load_after"] = os.getloadavg()
    text = table(res)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(text)
    return res


if __name__ == "__main__":
    main()
