"""``sfq serve --workers N``: requests per second with 1 and 2 workers (not a timed test).

The same Redis-backed policy (one real ``redis-server`` on loopback, four orgs of equal
weight, one pool with ``max_in_flight: 128``) served by ``sfq serve --workers 1`` (one
process, no parent) and ``--workers 2`` (a parent and two workers on one port), with the
gateway's defaults on: the access log (to a file), the metrics. In front of the fast loopback
upstream (``serve_upstream.py``: a bare asyncio protocol, one canned reply). The load: ``wrk``
when installed (``--connections`` connections, a Lua script for the POST), else this file's own
closed-loop generator in a process of its own (a bare asyncio protocol per connection,
keep-alive, one request at a time per connection, the four orgs' keys in turn). Each run: the
gateway started, ``--warmup`` seconds of load, then ``--seconds`` measured; the configurations
interleaved over ``--rounds`` rounds, medians quoted.

Every process shares the machine's cores (the gateway's, Redis, the upstream and the load
generator): the CPU each used in the measured run is read from ``/proc`` and reported, in
cores, next to the rate, and so is how the connections fell on the workers (their access-log
lines, by request-id prefix).

Run from the repository root (``redis-server`` installed: ``apt-get install redis-server``)::

    python benchmarks/bench_workers.py                  # 3 rounds x (1, 2 workers), ~1.5 minutes
    python benchmarks/bench_workers.py --workers 1,2,4 --rounds 5
    python benchmarks/bench_workers.py --quick          # a smoke run (numbers not for quoting)

Results go to ``benchmarks/results/workers.json`` (with ``uptime`` before and after: the
machine's load is part of the result) and a markdown table on stdout. Under pytest
``test_bench_workers_smoke`` runs the quick version once, skipping when ``redis-server`` is
missing; nothing is timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ORGS = ("a", "b", "c", "d")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ------------------------------------------------------------------ the load generator (a process)
def _request(key: str) -> bytes:
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


class _Client(asyncio.Protocol):
    """One keep-alive connection, one request at a time, until ``stop_at`` (``perf_counter``:
    uvloop's ``loop.time()`` counts whole milliseconds)."""

    def __init__(self, req: bytes, out: dict[str, Any], start: float, stop_at: float, done: asyncio.Future[None]):
        self.req, self.out, self.start, self.stop_at, self.done = req, out, start, stop_at, done
        self.buf = bytearray()
        self.t: asyncio.Transport | None = None
        self.sent = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = transport  # type: ignore[assignment]
        self._send()

    def _send(self) -> None:
        assert self.t is not None
        self.sent = time.perf_counter()
        self.t.write(self.req)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            m = re.search(rb"\r\ncontent-length: *(\d+)", head)
            n = int(m.group(1)) if m else 0
            if len(self.buf) < end + 4 + n:
                return
            del self.buf[:end + 4 + n]
            now = time.perf_counter()
            if now >= self.start:
                self.out["ok" if head[9:12] == b"200" else "bad"] += 1
                self.out["lat"].append(now - self.sent)
            if now >= self.stop_at:
                assert self.t is not None
                self.t.close()
                return
            self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _load(port: int, connections: int, warmup: float, seconds: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    out: dict[str, Any] = {"ok": 0, "bad": 0, "lat": []}
    start = time.perf_counter() + warmup
    stop_at = start + seconds
    dones = []
    for i in range(connections):
        done: asyncio.Future[None] = loop.create_future()
        dones.append(done)
        req = _request(f"sk-{ORGS[i % len(ORGS)]}")

        def client(r: bytes = req, d: asyncio.Future[None] = done) -> _Client:
            return _Client(r, out, start, stop_at, d)

        await loop.create_connection(client, "127.0.0.1", port)
    await asyncio.wait_for(asyncio.gather(*dones), warmup + seconds + 60)
    lat = sorted(out.pop("lat"))
    out["rate"] = out["ok"] / seconds
    out["p50_ms"] = lat[len(lat) // 2] * 1000 if lat else None
    out["p99_ms"] = lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000 if lat else None
    return out


def load_main(port: int, connections: int, warmup: float, seconds: float) -> None:
    try:
        import uvloop

        res = uvloop.run(_load(port, connections, warmup, seconds))
    except ImportError:
        res = asyncio.run(_load(port, connections, warmup, seconds))
    print(json.dumps(res), flush=True)


_WRK_LUA = """
local keys = {"sk-a", "sk-b", "sk-c", "sk-d"}
local n = 0
wrk.method = "POST"
wrk.body = '{"model":"m","prompt":"hello","max_tokens":4}'
wrk.headers["Content-Type"] = "application/json"
request = function()
  n = n + 1
  wrk.headers["Authorization"] = "Bearer " .. keys[(n % 4) + 1]
  return wrk.format()
end
"""


def _wrk(port: int, connections: int, warmup: float, seconds: float, tmp: Path) -> dict[str, Any]:
    script = tmp / "post.lua"
    script.write_text(_WRK_LUA)
    url = f"http://127.0.0.1:{port}/v1/completions"
    if warmup > 0:
        subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(warmup))}s", "-s", str(script), url],
                       capture_output=True, timeout=warmup + 60)
    p = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency", "-s",
                        str(script), url], capture_output=True, text=True, timeout=seconds + 60)
    rate = re.search(r"Requests/sec:\s*([\d.]+)", p.stdout)
    bad = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", p.stdout)

    def ms(q: str) -> float | None:
        m = re.search(rf"\s{q}%\s+([\d.]+)(us|ms|s)", p.stdout)
        if not m:
            return None
        return float(m.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]

    return {"rate": float(rate.group(1)) if rate else 0.0, "bad": int(bad.group(1)) if bad else 0,
            "p50_ms": ms("50"), "p99_ms": ms("99"), "tool": "wrk"}


# ------------------------------------------------------------------ processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    def __init__(self, cmd: list[str], *, wait_line: str | None = None, stdout: Any = subprocess.PIPE,
                 limit: float = 30.0) -> None:
        self.proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self._found = threading.Event()
        self._wait_line = wait_line
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                threading.Thread(target=self._read, args=(pipe,), daemon=True).start()
        if wait_line is not None and not self._found.wait(limit):
            self.stop()
            raise RuntimeError(f"{cmd[:6]} did not start:\n{''.join(self.lines)}")

    def _read(self, pipe: Any) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.lines.append(line)
            if self._wait_line is not None and self._wait_line in line:
                self._found.set()

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        return self.proc.returncode


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def policy_text(upstream: str, redis_url: str | None, prefix: str) -> str:
    """The benchmark's policy; ``redis_url`` ``None``: the same without ``state`` (in memory)."""
    orgs = "".join(f"  org-{f}: {{keys: [sk-{f}], classes: [batch]}}\n" for f in ORGS)
    state = "" if redis_url is None else \
        f"state: {{redis: \"{redis_url}\", prefix: \"{prefix}\", lease_seconds: 10}}\n"
    return (f"pools:\n  main:\n    models: [m]\n    backends:\n      - {{url: \"{upstream}\", max_in_flight: 256}}\n"
            f"    limits: {{max_in_flight: 128}}\nclasses:\n  batch: {{weight: 1}}\norgs:\n{orgs}{state}")


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def one_run(workers: int, *, cfg: Path, tmp: Path, tag: str, connections: int, warmup: float, seconds: float,
            redis_pid: int, upstream_pid: int, use_wrk: bool, memory: bool = False) -> dict[str, Any]:
    log_file = tmp / f"access-{tag}.log"
    wait = "workers listening on" if workers > 1 else "listening on http://"
    gw = Proc([sys.executable, "-m", "sfq", "serve", "--config", str(cfg), "--port", "0", "--workers", str(workers),
               "--access-log", str(log_file)], wait_line=wait, stdout=subprocess.DEVNULL)
    try:
        line = next(x for x in gw.lines if wait in x)
        port = int(re.search(r"http://[^\s:]+:(\d+)", line).group(1))  # type: ignore[union-attr]
        m = re.search(r"\(pids ([\d, ]+);", line)
        pids = [int(x) for x in m.group(1).split(", ")] if m else []
        procs = {"gateway": [gw.proc.pid, *pids], "redis": [redis_pid], "upstream": [upstream_pid]}
        before = {k: sum(_cpu(p) for p in v) for k, v in procs.items()}
        t0 = time.perf_counter()
        if use_wrk:
            res = _wrk(port, connections, warmup, seconds, tmp)
            load_cpu = None
        else:
            lg = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--load", str(port),
                                   str(connections), str(warmup), str(seconds)], stdout=subprocess.PIPE, text=True)
            # the load generator's CPU: sampled as it ends (it is our child: wait4's rusage)
            _, status, usage = os.wait4(lg.pid, 0)
            lg.returncode = os.waitstatus_to_exitcode(status)
            assert lg.stdout is not None
            res = json.loads(lg.stdout.read())
            load_cpu = usage.ru_utime + usage.ru_stime
        wall = time.perf_counter() - t0
        after = {k: sum(_cpu(p) for p in v) for k, v in procs.items()}
        trips = 0 if memory else _round_trips(port, workers)
    finally:
        rc = gw.stop()
    per_worker = Counter(json.loads(x)["request_id"][:16] for x in log_file.read_text().splitlines())
    answered = sum(per_worker.values())  # warm-up included, as the CPU figures
    cores = {k: round((after[k] - before[k]) / wall, 3) for k in procs}
    if load_cpu is not None:
        cores["load"] = round(load_cpu / wall, 3)
    row = {"workers": workers, "state": "memory" if memory else "redis", "tag": tag, "rate": res["rate"],
           "bad": res["bad"], "p50_ms": res["p50_ms"], "p99_ms": res["p99_ms"], "cores": cores,
           "lines_per_worker": sorted(per_worker.values(), reverse=True),
           "gateway_cpu_ms_per_request": (after["gateway"] - before["gateway"]) * 1000 / max(1, answered),
           "redis_round_trips_per_request": trips / max(1, answered) if trips is not None else None, "exit": rc}
    print(f"  {tag}: {workers} worker(s), {row['state']}: {row['rate']:.0f} req/s (bad {row['bad']}), "
          f"p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms; cores {cores}; "
          f"gateway CPU {row['gateway_cpu_ms_per_request']:.3f} ms and "
          f"{row['redis_round_trips_per_request'] or 0:.2f} Redis round trips per request; lines per worker "
          f"{row['lines_per_worker']}", flush=True)
    return row


def _round_trips(port: int, workers: int) -> int | None:
    """The Redis round trips of every worker so far (``/health``'s state, over new connections
    until each worker's gateway id was seen; ``None`` if one was not seen in 100 tries)."""
    import urllib.request

    seen: dict[str, int] = {}
    for _ in range(100):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            st = json.loads(r.read()).get("state") or {}
        seen[str(st.get("gateway"))] = int(st.get("round_trips", 0))
        if len(seen) == workers:
            return sum(seen.values())
    return None


def run(workers: list[int], *, rounds: int, connections: int, warmup: float, seconds: float,
        use_wrk: bool, memory: bool = False) -> dict[str, Any]:
    """Each round: every worker count on the Redis policy, then (``memory``) one process with
    the same policy in memory, the reference of what one process does without Redis."""
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
    tmp = Path(tempfile.mkdtemp(prefix="sfq-bench-workers-"))
    up_port, redis_port = _free_port(), _free_port()
    upstream = Proc([sys.executable, str(HERE / "serve_upstream.py"), str(up_port)], wait_line="ready")
    redis = Proc([redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                 wait_line="Ready to accept connections")
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    res: dict[str, Any] = {"uptime_before": _uptime(), "cpus": os.cpu_count(), "rounds": rounds,
                           "connections": connections, "warmup": warmup, "seconds": seconds,
                           "load": "wrk" if use_wrk else "bench_workers.py's own", "rows": []}
    try:
        for r in range(rounds):
            for n, mem in [*((n, False) for n in workers), *([(1, True)] if memory else [])]:
                tag = f"r{r + 1}{'m' if mem else 'w'}{n}"
                cfg = tmp / f"{tag}.yaml"
                cfg.write_text(policy_text(f"http://127.0.0.1:{up_port}", None if mem else redis_url, f"bw{tag}:"))
                res["rows"].append(one_run(n, cfg=cfg, tmp=tmp, tag=tag, connections=connections, warmup=warmup,
                                           seconds=seconds, redis_pid=redis.proc.pid, upstream_pid=upstream.proc.pid,
                                           use_wrk=use_wrk, memory=mem))
    finally:
        upstream.stop()
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    res["uptime_after"] = _uptime()
    res["summary"] = summary(res)
    return res


def summary(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted({(r["state"] != "redis", r["workers"]) for r in res["rows"]}):
        rows = [r for r in res["rows"] if (r["state"] != "redis", r["workers"]) == key]
        name = f"{key[1]}" if not key[0] else f"{key[1]} (memory)"
        out[name] = {"median_rate": statistics.median(r["rate"] for r in rows),
                       "rates": [round(r["rate"], 1) for r in rows],
                       "median_p50_ms": statistics.median(r["p50_ms"] for r in rows),
                       "median_cpu_ms": statistics.median(r["gateway_cpu_ms_per_request"] for r in rows),
                       "median_round_trips": statistics.median(r["redis_round_trips_per_request"] or 0 for r in rows),
                       "median_cores": {k: statistics.median(r["cores"].get(k, 0.0) for r in rows)
                                        for k in rows[0]["cores"]}}
    if "1" in out:
        for v in out.values():
            v["ratio"] = v["median_rate"] / out["1"]["median_rate"] if out["1"]["median_rate"] else None
    return out


def table(res: dict[str, Any]) -> str:
    lines = ["| workers | req/s (median) | runs | vs 1 worker | p50 (ms) | gateway CPU per request (ms) "
             "| Redis round trips per request | cores: gateway / Redis / upstream / load |",
             "|---:|---:|---|---:|---:|---:|---:|---|"]
    for n, v in res["summary"].items():
        c = v["median_cores"]
        lines.append(f"| {n} | {v['median_rate']:,.0f} | {' / '.join(f'{x:,.0f}' for x in v['rates'])} | "
                     f"{v['ratio']:.2f}x | {v['median_p50_ms']:.1f} | {v['median_cpu_ms']:.3f} | "
                     f"{v['median_round_trips']:.2f} | {c.get('gateway', 0):.2f} / "
                     f"{c.get('redis', 0):.2f} / {c.get('upstream', 0):.2f} / {c.get('load', float('nan')):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--load", nargs=4, metavar=("PORT", "CONNS", "WARMUP", "SECONDS"), help=argparse.SUPPRESS)
    ap.add_argument("--workers", default="1,2", help="worker counts to compare (1,2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the configurations interleaved (3)")
    ap.add_argument("--connections", type=int, default=32, help="keep-alive connections of the load (32)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of load before measuring (3)")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds measured per run (10)")
    ap.add_argument("--no-wrk", action="store_true", help="use this file's own load generator even with wrk")
    ap.add_argument("--memory", action="store_true",
                    help="also run one process with the policy in memory (no Redis), as a reference")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 1 s (not for quoting)")
    ap.add_argument("--out", default=str(HERE / "results" / "workers.json"))
    a = ap.parse_args(argv)
    if a.load:
        load_main(int(a.load[0]), int(a.load[1]), float(a.load[2]), float(a.load[3]))
        return 0
    if a.quick:
        a.rounds, a.warmup, a.seconds = 1, 0.5, 1.0
    use_wrk = shutil.which("wrk") is not None and not a.no_wrk
    res = run([int(x) for x in a.workers.split(",")], rounds=a.rounds, connections=a.connections, warmup=a.warmup,
              seconds=a.seconds, use_wrk=use_wrk, memory=a.memory)
    res["quick"] = a.quick
    if not a.quick:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nload: before: {res['uptime_before']}\n      after:  {res['uptime_after']}\n")
    print(table(res))
    return 0


def test_bench_workers_smoke() -> None:
    """The quick version once; nothing is timed."""
    import pytest

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    pytest.importorskip("redis")
    res = run([1, 2], rounds=1, connections=4, warmup=0.2, seconds=0.5, use_wrk=False)
    assert [r["workers"] for r in res["rows"]] == [1, 2]
    assert all(r["rate"] > 0 and r["bad"] == 0 and r["exit"] == 0 for r in res["rows"])


if __name__ == "__main__":
    sys.exit(main())
