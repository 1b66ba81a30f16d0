"""Several gateways, one queue: what sharing the state through Redis costs (not a timed test).

N = 1, 2 and 4 ``sfq serve`` processes with ``state: {redis: ...}`` (one real ``redis-server``
on loopback) and, as the reference, one gateway keeping its state in memory, each in front
of the same fast loopback upstream (a fixed service time per request, ``--service-ms``), on
the same traffic:

1. **Added latency**: one client, sequential requests (no queueing), in pairs: one straight
   to the upstream, then one through a gateway; p50/p99 of the differences. The Redis round
   trip on a request's path (the grant of its start; the release runs after the reply) is in
   it; "of which Redis" is the difference from the in-memory gateway's.
2. **Throughput and fairness**: a closed loop of four equal-weight flows (``--clients``
   each) against a pool limited to ``--pool-limit`` requests at once, so that every flow is
   backlogged for the whole run. Flow A's requests all go to gateway 1 and flow B's all to
   gateway 2 (the hard case: their order is decided across gateways); flows C and D are
   spread over every gateway. Throughput is completed requests per second; *drift* is
   ``max_t |served_A(0,t) - served_B(0,t)|`` in requests over the upstream's order of
   service (equal costs, equal weights); Jain's index is over the four flows' counts.

Run from the repository root (``redis-server`` installed: ``apt-get install redis-server``)::

    python benchmarks/bench_gateways.py                 # ~1 minute
    python benchmarks/bench_gateways.py --seconds 2     # shorter
    python benchmarks/bench_gateways.py --quick         # a smoke run (numbers not for quoting)

Results go to ``benchmarks/results/gateways.json`` (with ``uptime`` before and after: the
machine's load is part of the result) and a markdown table on stdout. Under pytest (CI's
benchmark smoke run) ``test_bench_gateways_smoke`` runs the quick version once, skipping when
``redis-server`` is missing; nothing is timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FLOWS = ("a", "b", "c", "d")


# ------------------------------------------------------------------ the upstream (a subprocess)
def upstream_main(port: int, service_ms: float) -> None:
    from aiohttp import web

    order: list[str] = []
    delay = service_ms / 1000.0

    async def complete(request: web.Request) -> web.Response:
        body = await request.json()
        if delay:
            await asyncio.sleep(delay)
        order.append(str(body.get("prompt", "?"))[:1])
        return web.json_response({"id": "b", "object": "text_completion", "created": 0, "model": "m",
                                  "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def get_order(request: web.Request) -> web.Response:
        out = "".join(order)
        if request.query.get("reset"):
            order.clear()
        return web.Response(text=out)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/order", get_order)
    app.router.add_get("/health", health)
    print("ready", flush=True)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=1024)


# ------------------------------------------------------------------ processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listening on port {port} after {limit:g} s")


class Proc:
    def __init__(self, cmd: list[str], *, wait_line: str | None = None, port: int | None = None) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self._found = threading.Event()
        self._wait_line = wait_line
        for pipe in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._read, args=(pipe,), daemon=True).start()
        if wait_line is not None and not self._found.wait(30):
            self.stop()
            raise RuntimeError(f"{cmd[:4]} did not start:\n{''.join(self.lines)}")
        if port is not None:
            _wait_port(port)

    def _read(self, pipe: Any) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.lines.append(line)
            if self._wait_line is not None and self._wait_line in line:
                self._found.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


def _gateway_url(p: Proc) -> str:
    line = next(x for x in p.lines if "listening on http://" in x)
    return line.split("listening on ")[1].split()[0]


def policy_text(upstream: str, redis_url: str | None, pool_limit: int, prefix: str) -> str:
    orgs = "".join(f"  {f}: {{keys: [sk-{f}], classes: [batch]}}\n" for f in FLOWS)
    state = "" if redis_url is None else f'state: {{redis: "{redis_url}", prefix: "{prefix}", lease_seconds: 10}}\n'
    return (f"pools:\n  main:\n    models: [m]\n    backends:\n      - {{url: \"{upstream}\", max_in_flight: 256}}\n"
            f"    limits: {{max_in_flight: {pool_limit}}}\nclasses:\n  batch: {{weight: 1}}\norgs:\n{orgs}{state}")


# ------------------------------------------------------------------ measurements
async def _post(session: Any, url: str, flow: str) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json={"model": "m", "prompt": f"{flow} x", "max_tokens": 1},
                            headers={"Authorization": f"Bearer sk-{flow}"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: status {r.status}")
    return time.perf_counter() - t0


async def latency(direct: str, urls: list[str], n: int) -> list[float]:
    """``n`` pairs of sequential requests (one client): straight to the upstream, then through
    one of ``urls`` (in turn); the difference of each pair, seconds. Pairing cancels the slow
    drifts of a shared machine's load."""
    import aiohttp

    out = []
    async with aiohttp.ClientSession() as s:
        for i in range(min(10, n)):  # warm the connections
            await _post(s, direct, "a")
            await _post(s, urls[i % len(urls)], "a")
        for i in range(n):
            t0 = await _post(s, direct, "a")
            out.append(await _post(s, urls[i % len(urls)], FLOWS[i % 4]) - t0)
    return out


async def closed_loop(urls: list[str], clients: int, seconds: float) -> dict[str, Any]:
    import aiohttp

    n = len(urls)
    done = {f: 0 for f in FLOWS}
    stop_at = time.perf_counter() + seconds

    async def client(flow: str, j: int, s: Any) -> None:
        if flow == "a":
            url = urls[0]
        elif flow == "b":
            url = urls[1 % n]
        else:
            url = urls[j % n]
        while time.perf_counter() < stop_at:
            await _post(s, url, flow)
            done[flow] += 1

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(f, j, s) for f in FLOWS for j in range(clients)))
        wall = time.perf_counter() - t0
    return {"requests": sum(done.values()), "wall": wall, "per_flow": done}


def drift(order: str, x: str = "a", y: str = "b") -> int:
    d = m = 0
    for c in order:
        if c == x:
            d += 1
        elif c == y:
            d -= 1
        m = max(m, abs(d))
    return m


def jain(xs: list[int]) -> float:
    s = sum(xs)
    q = sum(x * x for x in xs)
    return 1.0 if q == 0 else s * s / (len(xs) * q)


def _pct(xs: list[float], p: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(p / 100 * len(ys)))]


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def run(configs: list[tuple[str, int]], *, seconds: float, clients: int, pool_limit: int, service_ms: float,
        lat_n: int) -> dict[str, Any]:
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
    tmp = Path(tempfile.mkdtemp(prefix="sfq-bench-gw-"))
    up_port, redis_port = _free_port(), _free_port()
    upstream = Proc([sys.executable, str(Path(__file__).resolve()), "--upstream", str(up_port), str(service_ms)],
                    wait_line="ready", port=up_port)
    redis = Proc([redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                 port=redis_port)
    up_url = f"http://127.0.0.1:{up_port}"
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    results: dict[str, Any] = {"uptime_before": _uptime(), "seconds": seconds, "clients_per_flow": clients,
                               "pool_limit": pool_limit, "service_ms": service_ms, "rows": []}
    try:
        direct = asyncio.run(latency(up_url, [up_url], lat_n))
        results["direct_pair_p50_ms"] = statistics.median(direct) * 1000  # ~0: the method's own offset
        for i, (kind, n) in enumerate(configs):
            cfg = tmp / f"{kind}{n}.yaml"
            cfg.write_text(policy_text(up_url, redis_url if kind == "redis" else None, pool_limit, f"b{i}:"))
            gws = []
            try:
                for _ in range(n):
                    gws.append(Proc([sys.executable, "-m", "sfq", "serve", "--config", str(cfg), "--port", "0",
                                     "--access-log", "off"], wait_line="listening on http://"))
                urls = [_gateway_url(g) for g in gws]
                lat = asyncio.run(latency(up_url, urls, lat_n))
                _get(up_url + "/order?reset=1")
                loop = asyncio.run(closed_loop(urls, clients, seconds))
                order = _get(up_url + "/order?reset=1")
            finally:
                for g in gws:
                    g.stop()
            counts = [order.count(f) for f in FLOWS]
            row = {"config": f"{kind}-{n}", "gateways": n, "state": kind,
                   "throughput": loop["requests"] / loop["wall"],
                   "added_p50_ms": statistics.median(lat) * 1000,
                   "added_p99_ms": _pct(lat, 99) * 1000,
                   "drift_ab": drift(order), "jain": jain(counts), "served": dict(zip(FLOWS, counts))}
            results["rows"].append(row)
            print(f"  {row['config']}: {row['throughput']:.0f} req/s, added p50 {row['added_p50_ms']:.2f} ms "
                  f"p99 {row['added_p99_ms']:.2f} ms, drift {row['drift_ab']}, Jain {row['jain']:.4f}", flush=True)
    finally:
        upstream.stop()
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    results["uptime_after"] = _uptime()
    return results


def table(res: dict[str, Any]) -> str:
    """The markdown table; "of which Redis" is the added p50 minus the in-memory gateway's."""
    mem = next((r for r in res["rows"] if r["state"] == "memory"), None)
    lines = ["| gateways | state | throughput (req/s) | added p50 (ms) | of which Redis (ms) | added p99 (ms) "
             "| drift A-B (requests) | Jain (4 flows) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        extra = "" if mem is None or r is mem else f"{r['added_p50_ms'] - mem['added_p50_ms']:+.2f}"
        lines.append(f"| {r['gateways']} | {r['state']} | {r['throughput']:,.0f} | {r['added_p50_ms']:.2f} | {extra} | "
                     f"{r['added_p99_ms']:.2f} | {r['drift_ab']} | {r['jain']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--upstream", nargs=2, metavar=("PORT", "SERVICE_MS"), help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=5.0, help="closed-loop seconds per configuration (5)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients per flow (8)")
    ap.add_argument("--pool-limit", type=int, default=8, help="the pool's max_in_flight (8)")
    ap.add_argument("--service-ms", type=float, default=5.0, help="the upstream's service time per request (5)")
    ap.add_argument("--latency-requests", type=int, default=300, help="sequential requests for the latency (300)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 s per configuration (not for quoting)")
    ap.add_argument("--out", default=str(HERE / "results" / "gateways.json"))
    a = ap.parse_args(argv)
    if a.upstream:
        upstream_main(int(a.upstream[0]), float(a.upstream[1]))
        return 0
    configs = [("memory", 1), ("redis", 1), ("redis", 2), ("redis", 4)]
    if a.quick:
        a.seconds, a.latency_requests, configs = 1.0, 40, [("memory", 1), ("redis", 2)]
    res = run(configs, seconds=a.seconds, clients=a.clients, pool_limit=a.pool_limit, service_ms=a.service_ms,
              lat_n=a.latency_requests)
    res["quick"] = a.quick
    if not a.quick:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nload: before: {res['uptime_before']}\n      after:  {res['uptime_after']}")
    print(f"upstream against itself (the method's offset): p50 {res['direct_pair_p50_ms']:+.2f} ms\n")
    print(table(res))
    return 0


def test_bench_gateways_smoke() -> None:
    """The quick version once (CI's benchmark smoke run); nothing is timed."""
    import pytest

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    pytest.importorskip("redis")
    res = run([("memory", 1), ("redis", 2)], seconds=0.5, clients=2, pool_limit=4, service_ms=2.0, lat_n=10)
    assert [r["config"] for r in res["rows"]] == ["memory-1", "redis-2"]
    assert all(r["throughput"] > 0 and sum(r["served"].values()) > 0 for r in res["rows"])


if __name__ == "__main__":
    sys.exit(main())
