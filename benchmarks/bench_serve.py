"""Benchmarks of ``sfq serve`` (not timed tests; numbers come from real load generators).

1. **Added latency**: p50/p99 of ``hey`` at a fixed rate (200 and 1,000 requests/s) against
   the fast loopback upstream (``serve_upstream.py``) directly, then through ``sfq serve``;
   the difference is what the gateway adds.
2. **Highest sustained rate on one core**: ``wrk`` (closed loop, a Lua script for the POST
   body) against the gateway pinned to one CPU (the upstream and ``wrk`` on the other).
3. **Memory per queued request**: the gateway's RSS before and after N requests wait in its
   queue (the backend holds one request; the rest wait), connection included.
4. **Overload** against the real ``llama-server`` (the tiny model of the integration tests):
   one org floods (``hey``, closed loop, batch), another sends steady interactive traffic
   (``hey`` at a fixed rate); the interactive latency through ``sfq serve`` next to the same
   run through a plain FIFO proxy (``fifo_proxy.py``) with the same concurrency upstream.

Run from the repository root (``wrk`` and ``hey`` installed: ``apt-get install wrk hey``)::

    python benchmarks/bench_serve.py                  # everything, ~4 minutes
    python benchmarks/bench_serve.py --quick          # a smoke run (numbers not for quoting)
    python benchmarks/bench_serve.py --sections latency,max

Results go to ``benchmarks/results/serve.json`` (with ``uptime`` before and after each
section: the machine's load is part of the result) and a markdown table on stdout.
Under pytest (CI's benchmark smoke run) ``test_bench_serve_smoke`` runs the quick version of
sections 1-3 once and skips when ``wrk`` or ``hey`` is missing; nothing is timed.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEY = "sk-bench"
BODY = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4})
SECTIONS = ("latency", "max", "memory", "overload")


# ------------------------------------------------------------------ processes
def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return []


def _pin(cpu: int | None) -> Any:
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


class Proc:
    """A child process whose output lines are collected by reader threads."""

    def __init__(self, cmd: list[str], *, cpu: int | None = None, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_pin(cpu),
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        for pipe in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: Any) -> None:
        for raw in iter(pipe.readline, b""):
            self.lines.append(raw.decode("utf-8", "replace"))

    def wait_for(self, pattern: str, limit: float = 30.0) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = rx.search(line)
                if m:
                    return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"{self.cmd[:4]}: no line matching {pattern!r}:\n{''.join(self.lines[-20:])}")

    def cpu_seconds(self) -> float:
        """User + system CPU time the process has used so far."""
        with open(f"/proc/{self.proc.pid}/stat") as fh:
            f = fh.read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    def rss_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextmanager
def upstream(cpu: int | None) -> Iterator[str]:
    p = Proc([sys.executable, str(HERE / "serve_upstream.py"), "0"], cpu=cpu)
    try:
        port = p.wait_for(r"ready (\d+)").group(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        p.stop()


def policy_text(backend: str, max_in_flight: int, model: str = "m", flood: bool = False) -> str:
    orgs = f"""  bench: {{keys: ["{KEY}"], classes: [interactive]}}\n"""
    if flood:
        orgs = """  product: {keys: ["sk-product"], classes: [interactive]}
  flood: {keys: ["sk-flood"], classes: [batch]}
"""
    return f"""pools:
  main:
    models: [{model}]
    backends: [{{url: "{backend}", max_in_flight: {max_in_flight}}}]
classes:
  interactive: {{weight: 6}}
  batch: {{weight: 1}}
orgs:
{orgs}"""


@contextmanager
def gateway(policy: str, cpu: int | None, tmp: Path) -> Iterator[tuple[str, Proc]]:
    cfg = tmp / f"policy-{time.monotonic_ns()}.yaml"
    cfg.write_text(policy)
    p = Proc([sys.executable, "-m", "sfq", "serve", "--config", str(cfg), "--port", "0", "--grace", "1",
              "--access-log", str(tmp / "access.log")], cpu=cpu)
    try:
        url = p.wait_for(r"listening on (http://\S+)").group(1)
        yield url, p
    finally:
        p.stop()


# ------------------------------------------------------------------ load generators
def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def hey(url: str, *, rate: float | None, seconds: float, conc: int, body: str = BODY, key: str = KEY,
        cpu: int | None = None) -> dict[str, Any]:
    """``hey`` for ``seconds``: ``conc`` workers, ``rate`` requests/s in all (``None``: as fast
    as they go). Latencies from its per-request CSV."""
    cmd = ["hey", "-z", f"{seconds}s", "-c", str(conc), "-m", "POST", "-T", "application/json",
           "-H", f"Authorization: Bearer {key}", "-d", body, "-o", "csv"]
    if rate is not None:
        cmd[1:1] = ["-q", f"{rate / conc:g}"]
    out = subprocess.run(cmd + [url], capture_output=True, text=True, preexec_fn=_pin(cpu), timeout=seconds + 120)
    if out.returncode != 0:
        raise RuntimeError(f"hey failed: {out.stderr[-2000:]}")
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    lat = sorted(float(r["response-time"]) for r in rows)
    ok = sum(1 for r in rows if r["status-code"] == "200")
    return {"requests": len(rows), "ok": ok, "rate": len(rows) / seconds, "p50_ms": _pct(lat, 50) * 1e3,
            "p99_ms": _pct(lat, 99) * 1e3, "max_ms": (lat[-1] if lat else float("nan")) * 1e3}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def wrk(url: str, *, seconds: float, conns: int, tmp: Path, cpu: int | None = None) -> dict[str, Any]:
    """``wrk`` closed loop with a Lua script for the POST; requests/s and its latency percentiles."""
    script = tmp / "post.lua"
    script.write_text(f"""wrk.method = "POST"
wrk.body = {json.dumps(BODY)}
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {KEY}"
""")
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(script),
                          url + "/v1/completions"], capture_output=True, text=True, preexec_fn=_pin(cpu),
                         timeout=seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed: {out.stderr[-2000:]}")
    text = out.stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    errs = re.search(r"Socket errors:.*", text)

    def pct(p: str) -> float:
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        if not m:
            return float("nan")
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    return {"rps": rps, "non_2xx": int(bad.group(1)) if bad else 0, "socket_errors": errs.group(0) if errs else "",
            "p50_ms": pct("50"), "p99_ms": pct("99")}


# ------------------------------------------------------------------ sections
def cpu_plan() -> tuple[int | None, int | None]:
    """(the gateway's CPU, everyone else's): the gateway alone on one core when there are two."""
    cpus = _cpus()
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)


def section_latency(tmp: Path, quick: bool) -> dict[str, Any]:
    # not pinned: on a shared machine a pinned gateway waits for its one core at every wake-up
    gw_cpu, other = None, None
    secs = 2 if quick else 15
    out: dict[str, Any] = {"uptime_before": uptime(), "seconds": secs, "rates": {}}
    with upstream(other) as up:
        # for scale: what a bare aiohttp proxy (no policy, no log) adds under the same conditions
        fifo = Proc([sys.executable, str(HERE / "fifo_proxy.py"), "--upstream", up, "--max-in-flight", "512"])
        try:
            bare_url = f"http://127.0.0.1:{fifo.wait_for(r'ready ([0-9]+)').group(1)}"
            hey(bare_url + "/v1/completions", rate=200, seconds=1, conc=10, cpu=other)  # warm-up
            bare = {rate: hey(bare_url + "/v1/completions", rate=rate, seconds=secs, conc=max(10, rate // 20),
                              cpu=other) for rate in (200, 1000)}
        finally:
            fifo.stop()
        with gateway(policy_text(up, 512), gw_cpu, tmp) as (gw, _):
            hey(gw + "/v1/completions", rate=200, seconds=1 if quick else 3, conc=10, cpu=other)  # warm-up
            for rate in (200, 1000):
                conc = max(10, rate // 20)
                direct = hey(up + "/v1/completions", rate=rate, seconds=secs, conc=conc, cpu=other)
                through = hey(gw + "/v1/completions", rate=rate, seconds=secs, conc=conc, cpu=other)
                out["rates"][str(rate)] = {"direct": direct, "gateway": through, "bare_proxy": bare[rate],
                                           "added_p50_ms": through["p50_ms"] - direct["p50_ms"],
                                           "added_p99_ms": through["p99_ms"] - direct["p99_ms"],
                                           "bare_added_p50_ms": bare[rate]["p50_ms"] - direct["p50_ms"],
                                           "bare_added_p99_ms": bare[rate]["p99_ms"] - direct["p99_ms"]}
    out["uptime_after"] = uptime()
    return out


def section_max(tmp: Path, quick: bool) -> dict[str, Any]:
    gw_cpu, other = cpu_plan()
    secs = 2 if quick else 15
    out: dict[str, Any] = {"uptime_before": uptime(), "seconds": secs, "gateway_cpu": gw_cpu}
    with upstream(other) as up:
        out["direct"] = wrk(up, seconds=secs, conns=64, tmp=tmp, cpu=other)
        with gateway(policy_text(up, 512), gw_cpu, tmp) as (gw, proc):
            out["gateway"] = _cpu_run(gw, proc, secs, quick, tmp, other)
        # the floor: a bare aiohttp proxy (no policy, no log), on the same core
        fifo = Proc([sys.executable, str(HERE / "fifo_proxy.py"), "--upstream", up, "--max-in-flight", "512"],
                    cpu=gw_cpu)
        try:
            port = fifo.wait_for(r"ready (\d+)").group(1)
            out["bare_proxy"] = _cpu_run(f"http://127.0.0.1:{port}", fifo, secs, quick, tmp, other)
        finally:
            fifo.stop()
    out["uptime_after"] = uptime()
    return out


def _cpu_run(url: str, proc: Proc, secs: float, quick: bool, tmp: Path, cpu: int | None) -> dict[str, Any]:
    """wrk against ``url``, with the CPU time the serving process spent per request."""
    wrk(url, seconds=1 if quick else 3, conns=64, tmp=tmp, cpu=cpu)  # warm-up
    c0 = proc.cpu_seconds()
    r = wrk(url, seconds=secs, conns=64, tmp=tmp, cpu=cpu)
    used = proc.cpu_seconds() - c0
    r["cpu_ms_per_request"] = used / max(1.0, r["rps"] * secs) * 1e3
    r["cpu_share"] = used / secs  # of one core
    return r


async def _queue_many(url: str, n: int, proc: Proc) -> dict[str, Any]:
    import aiohttp

    hold = json.dumps({"model": "m", "prompt": "hold", "max_tokens": 4})
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for _ in range(200):  # warm the gateway up (allocator, caches, code paths)
            async with s.post(url + "/v1/completions", data=BODY, headers=headers) as r:
                await r.read()
        first = asyncio.ensure_future(s.post(url + "/v1/completions", data=hold, headers=headers))
        await _until(lambda: _metric(url, "sfq_in_flight") >= 1)
        await asyncio.sleep(0.5)
        before = proc.rss_kib()
        tasks = [asyncio.ensure_future(s.post(url + "/v1/completions", data=hold, headers=headers)) for _ in range(n)]
        await _until(lambda: _metric(url, "sfq_queue_length") >= n, limit=120)
        await asyncio.sleep(0.5)
        after = proc.rss_kib()
        for t in (first, *tasks):
            t.cancel()
        await asyncio.gather(first, *tasks, return_exceptions=True)
    return {"queued": n, "rss_before_kib": before, "rss_after_kib": after,
            "per_request_bytes": (after - before) * 1024 / n}


async def _until(cond: Any, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not await asyncio.to_thread(cond):
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        await asyncio.sleep(0.1)


def _metric(url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def section_memory(tmp: Path, quick: bool) -> dict[str, Any]:
    n = 200 if quick else 2000
    out: dict[str, Any] = {"uptime_before": uptime()}
    with upstream(None) as up, gateway(policy_text(up, 1), None, tmp) as (gw, proc):
        out.update(asyncio.run(_queue_many(gw, n, proc)))
    out["uptime_after"] = uptime()
    return out


def _llama() -> Any:
    """The real llama-server of the integration tests (tests/dispatch), started on the tiny model."""
    import importlib.util

    d = ROOT / "tests" / "dispatch"
    mods = {}
    for name, path in (("tinymodel", d / "tinymodel.py"), ("sfq_tests_dispatch_helpers", d / "dispatch_helpers.py")):
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods["tinymodel"], mods["sfq_tests_dispatch_helpers"]


def section_overload(tmp: Path, quick: bool) -> dict[str, Any]:
    tiny, fx = _llama()
    if fx.LLAMA_BINARY is None:
        return {"skipped": "llama-server is not installed"}
    secs = 6 if quick else 40
    model = fx.LLAMA_MODEL_NAME
    slots = fx.LLAMA_SLOTS
    inter = json.dumps({"model": model, "prompt": "hi", "max_tokens": 8})
    flood = json.dumps({"model": model, "prompt": "summarise this for the quarterly report", "max_tokens": 64})
    out: dict[str, Any] = {"uptime_before": uptime(), "seconds": secs, "llama_slots": slots,
                           "flood": "hey -c 16, closed loop, max_tokens 64",
                           "interactive": "hey -c 2 -q 1 (2 req/s), max_tokens 8"}
    server = fx.start_llama(tiny.write_tiny_llama(tmp / "tiny.gguf"), tmp / "llama.log")
    try:
        with gateway(policy_text(server.url, slots, model, flood=True), None, tmp) as (gw, _):
            out["alone"] = hey(gw + "/v1/completions", rate=2, seconds=max(3, secs // 4), conc=2, body=inter,
                               key="sk-product")
            for name, url in (("sfq", gw), ("fifo", None)):
                if url is None:
                    fifo = Proc([sys.executable, str(HERE / "fifo_proxy.py"), "--upstream", server.url,
                                 "--max-in-flight", str(slots)])
                    port = fifo.wait_for(r"ready (\d+)").group(1)
                    url = f"http://127.0.0.1:{port}"
                else:
                    fifo = None
                try:
                    result: dict[str, Any] = {}

                    def run_flood() -> None:
                        result["flood"] = hey(url + "/v1/completions", rate=None, seconds=secs + 2, conc=16,
                                              body=flood, key="sk-flood")

                    t = threading.Thread(target=run_flood)
                    t.start()
                    time.sleep(1.0)
                    result["interactive"] = hey(url + "/v1/completions", rate=2, seconds=secs, conc=2, body=inter,
                                                key="sk-product")
                    t.join()
                    out[name] = result
                finally:
                    if fifo is not None:
                        fifo.stop()
    finally:
        server.stop()
    out["uptime_after"] = uptime()
    return out


# ------------------------------------------------------------------ report
def table(res: dict[str, Any]) -> str:
    rows = ["| measurement | value |", "| --- | --- |"]
    lat = res.get("latency")
    if lat:
        for rate, r in lat["rates"].items():
            rows.append(f"| {rate} req/s: added p50 / p99 | {r['added_p50_ms']:.2f} ms / {r['added_p99_ms']:.2f} ms "
                        f"(direct {r['direct']['p50_ms']:.2f} / {r['direct']['p99_ms']:.2f} ms, through "
                        f"{r['gateway']['p50_ms']:.2f} / {r['gateway']['p99_ms']:.2f} ms; "
                        f"{r['gateway']['rate']:.0f} req/s achieved, {r['gateway']['ok']}/{r['gateway']['requests']}"
                        f" ok; a bare aiohttp proxy adds {r['bare_added_p50_ms']:.2f} / "
                        f"{r['bare_added_p99_ms']:.2f} ms) |")
    mx = res.get("max")
    if mx:
        g, bp = mx["gateway"], mx["bare_proxy"]
        rows.append(f"| highest sustained rate, gateway on one core (wrk -c64) | {g['rps']:.0f} req/s "
                    f"(p50 {g['p50_ms']:.2f} ms, p99 {g['p99_ms']:.2f} ms, {g['non_2xx']} non-2xx; "
                    f"{g['cpu_share']:.0%} of the core; upstream alone {mx['direct']['rps']:.0f} req/s) |")
        rows.append(f"| CPU per request: gateway / bare aiohttp proxy | {g['cpu_ms_per_request']:.3f} ms / "
                    f"{bp['cpu_ms_per_request']:.3f} ms (bare proxy {bp['rps']:.0f} req/s) |")
    mem = res.get("memory")
    if mem:
        rows.append(f"| memory per queued request ({mem['queued']} queued, connection included) | "
                    f"{mem['per_request_bytes'] / 1024:.1f} KiB |")
    ov = res.get("overload")
    if ov and "sfq" in ov:
        for name in ("sfq", "fifo"):
            i, f = ov[name]["interactive"], ov[name]["flood"]
            rows.append(f"| overload, {name}: interactive p50 / p99 | {i['p50_ms']:.0f} ms / {i['p99_ms']:.0f} ms "
                        f"({i['ok']}/{i['requests']} ok; flood {f['rate']:.1f} req/s, {f['ok']}/{f['requests']} ok) |")
        a = ov["alone"]
        rows.append(f"| interactive alone (no flood), through sfq | {a['p50_ms']:.0f} ms / {a['p99_ms']:.0f} ms |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description="Benchmarks of sfq serve (see the module docstring).")
    ap.add_argument("--quick", action="store_true", help="a smoke run: short, numbers not for quoting")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated: {','.join(SECTIONS)}")
    ap.add_argument("--out", default=str(HERE / "results" / "serve.json"), help="where the JSON goes")
    a = ap.parse_args(argv)
    chosen = [s.strip() for s in a.sections.split(",") if s.strip()]
    for s in chosen:
        if s not in SECTIONS:
            ap.error(f"unknown section {s!r}; sections: {', '.join(SECTIONS)}")
    missing = [t for t in ("wrk", "hey") if shutil.which(t) is None]
    if missing:
        ap.error(f"needs {' and '.join(missing)} (apt-get install wrk hey)")
    res: dict[str, Any] = {"quick": a.quick, "cpus": _cpus(), "python": sys.version.split()[0],
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    fns = {"latency": section_latency, "max": section_max, "memory": section_memory, "overload": section_overload}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as d:
        for s in chosen:
            print(f"== {s}", file=sys.stderr, flush=True)
            res[s] = fns[s](Path(d), a.quick)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    return res


def test_bench_serve_smoke(tmp_path: Path) -> None:
    """CI's smoke run: the quick version of the first three sections runs (nothing timed)."""
    import pytest

    if shutil.which("wrk") is None or shutil.which("hey") is None:
        pytest.skip("wrk and hey are not installed (apt-get install wrk hey)")
    res = main(["--quick", "--sections", "latency,max,memory", "--out", str(tmp_path / "serve.json")])
    assert res["latency"]["rates"]["200"]["gateway"]["ok"] > 0
    assert res["max"]["gateway"]["rps"] > 0 and res["memory"]["per_request_bytes"] > 0


if __name__ == "__main__":
    main()
