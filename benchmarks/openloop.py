"""A fixed-rate, open-loop HTTP load generator for ``bench_proxy.py`` (what ``wrk2`` does; Debian
has no ``wrk2``). Request ``i`` is due at ``t0 + i / rate`` whether or not earlier ones have
been answered, and its latency runs from that due time, not from when it went out, so a
stall of the server (or of this process) counts against every request it delays: no
coordinated omission. Keep-alive connections are opened as needed (aiohttp, uvloop when
installed).

Usage: ``python benchmarks/openloop.py URL --rate 1000 --seconds 5 --body JSON --key KEY``;
prints one JSON object: requests, errors, achieved rate, the latency percentiles (ms), how
late the generator itself sent (``send_lag_p99_ms``), and its own CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import aiohttp


def pct(xs: list[float], q: float) -> float:
    """The ``q``-th percentile of sorted ``xs`` (linear interpolation); NaN when empty."""
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def run(url: str, rate: float, seconds: float, body: bytes, key: str, warmup: float) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    lat: list[float] = []  # from the due time
    svc: list[float] = []  # from the send
    lag: list[float] = []
    clock = time.perf_counter  # uvloop's loop.time() moves in whole milliseconds
    errors = 0
    pending: set[asyncio.Task[None]] = set()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=30)) as s:

        async def one(due: float, keep: bool) -> None:
            nonlocal errors
            sent = clock()
            try:
                async with s.post(url, data=body, headers=headers) as r:
                    await r.read()
                    ok = r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                ok = False
            done = clock()
            if keep:
                if ok:
                    lat.append(done - due)
                    svc.append(done - sent)
                    lag.append(sent - due)
                else:
                    errors += 1

        period = 1.0 / rate
        n_warm = int(warmup * rate)
        n = n_warm + int(seconds * rate)
        cpu0 = time.process_time()
        t0 = clock() + 0.05
        for i in range(n):
            due = t0 + i * period
            delay = due - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            t = asyncio.ensure_future(one(due, i >= n_warm))
            pending.add(t)
            t.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending)
        cpu = time.process_time() - cpu0
    lat.sort()
    svc.sort()
    lag.sort()
    return {"rate": rate, "seconds": seconds, "sent": n, "requests": len(lat) + errors, "ok": len(lat),
            "errors": errors,
            "p50_ms": pct(lat, 50) * 1e3, "p90_ms": pct(lat, 90) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
            "max_ms": (lat[-1] if lat else float("nan")) * 1e3, "send_lag_p99_ms": pct(lag, 99) * 1e3,
            "from_send_p50_ms": pct(svc, 50) * 1e3, "from_send_p99_ms": pct(svc, 99) * 1e3,
            "generator_cpu_s": cpu, "pid": os.getpid()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--rate", type=float, default=1000.0, help="requests per second (1000)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds (5)")
    ap.add_argument("--warmup", type=float, default=0.5, help="seconds sent first and not counted (0.5)")
    ap.add_argument("--body", required=True, help="the POST body (JSON)")
    ap.add_argument("--key", default="sk-bench", help="the bearer key")
    a = ap.parse_args()
    if not a.rate > 0 or not a.seconds > 0:
        ap.error(f"--rate and --seconds must be > 0, got {a.rate!r} and {a.seconds!r}")
    try:
        from uvloop import run as arun
    except ImportError:
        from asyncio import run as arun
    print(json.dumps(arun(run(a.url, a.rate, a.seconds, a.body.encode(), a.key, a.warmup))), flush=True)


if __name__ == "__main__":
    main()
