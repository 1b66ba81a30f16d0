"""Where ``sfq serve``'s memory per org goes: ``tracemalloc`` by component, N orgs side by side
with 100 (a sibling of ``memory.py``, which measures the core alone).

In one process: the fast loopback upstream (``serve_upstream.py``'s protocol) and the gateway
(``sfq.serve.Gateway`` on an aiohttp runner, as ``sfq serve`` runs it) under the policy
``bench_tenants.py`` uses (one key per org, two classes each). Two measures per size:

* **at rest**: bytes traced after the policy is parsed and the gateway built, before any
  request (the parse's own short-lived objects are freed by then);
* **active**: bytes added once every org has sent two requests (an aiohttp client, 32 at a
  time, the org's key on each), the replies read and the loop idle.

Per org = (N orgs - 100 orgs) / (N - 100), so that the interpreter, the libraries, the
connections and everything else that does not grow with the orgs cancels out. Each block is
counted where the innermost frame of sfq's own code made it (a C allocation of the compiled
core under the engine line that called it, a generated ``__init__`` under its caller), by
component: the metrics counters (``sfq/policy/metrics.py``), the policy config, the classifier,
the engine's queues and requests, the core scheduler (engine lines that call it), limits,
retry budgets, the cost estimator, the access log, the gateway's handlers, shared state.

``tracemalloc`` counts live blocks; the process's RSS also holds the allocator's free space
(``bench_tenants.py`` measures RSS). Usage: ``python benchmarks/memory_orgs.py [--orgs 10000]
[--base 100] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import linecache
import sys
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import sfq  # noqa: F401
except ImportError:  # not installed: the checkout
    sys.path.insert(0, str(HERE.parent / "python"))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

import serve_upstream  # noqa: E402
from bench_tenants import BODY, key, policy_text  # noqa: E402
from sfq.policy import parse_policy  # noqa: E402
from sfq.serve.app import Gateway  # noqa: E402

#: sfq source files (relative to the package) -> component; the first match of a prefix wins
COMPONENTS = (
    ("policy/metrics.py", "metrics counters"),
    ("policy/config.py", "policy config"),
    ("policy/classify.py", "classifier"),
    ("policy/limits.py", "limits"),
    ("policy/retry.py", "retry budgets"),
    ("cost.py", "cost estimator"),
    ("engine/", "engine queues and requests"),
    ("dispatch/", "dispatcher"),
    ("serve/accesslog.py", "access log"),
    ("serve/", "gateway handlers"),
    ("state/", "shared state"),
    ("_scheduler_py.py", "core scheduler"),
)
PKG = str(Path(sfq.__file__).resolve().parent) + "/"


def component(tb: tracemalloc.Traceback) -> str:
    for fr in reversed(tb):  # innermost first
        if fr.filename.startswith(PKG):
            rel = fr.filename[len(PKG):]
            if rel.startswith("engine/") and ".sched." in linecache.getline(fr.filename, fr.lineno):
                return "core scheduler"
            return next((name for prefix, name in COMPONENTS if rel.startswith(prefix)), "other sfq")
    return "outside sfq"


def by_component(snap: tracemalloc.Snapshot) -> Counter[str]:
    c: Counter[str] = Counter()
    for st in snap.statistics("traceback"):
        c[component(st.traceback)] += st.size
    return c


def _snap() -> tracemalloc.Snapshot:
    gc.collect()
    return tracemalloc.take_snapshot()


async def measure(n: int) -> dict[str, Counter[str]]:
    loop = asyncio.get_running_loop()
    up = await loop.create_server(serve_upstream.Upstream, "127.0.0.1", 0)
    upstream = f"http://127.0.0.1:{up.sockets[0].getsockname()[1]}"
    text = policy_text(upstream, n)
    tracemalloc.start(8)
    try:
        s0 = _snap()
        gw = Gateway(parse_policy(text), grace=1)
        runner = web.AppRunner(gw.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/completions"  # type: ignore[union-attr]
        s1 = _snap()
        sem = asyncio.Semaphore(32)
        async with aiohttp.ClientSession() as client:
            async def one(i: int) -> None:
                async with sem, client.post(url, data=BODY, headers={
                        "Authorization": f"Bearer {key(i)}", "Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"org {i}: status {r.status}")
            for _ in range(2):
                await asyncio.gather(*(one(i) for i in range(n)))
            await asyncio.sleep(0.1)
            s2 = _snap()
        await runner.cleanup()
        await gw.drain()
    finally:
        tracemalloc.stop()
        up.close()
    rest, after = by_component(s0), by_component(s1)
    active = by_component(s2)
    return {"rest": Counter({k: after[k] - rest[k] for k in after | rest}),
            "active": Counter({k: active[k] - after[k] for k in active | after})}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--orgs", type=int, default=10_000)
    ap.add_argument("--base", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.orgs <= a.base:
        ap.error("--orgs must be larger than --base")
    big, small = asyncio.run(measure(a.orgs)), asyncio.run(measure(a.base))
    d = a.orgs - a.base
    out: dict[str, Any] = {"orgs": a.orgs, "base": a.base, "core": sfq.CORE, "per_org": {}}
    for phase in ("rest", "active"):
        keys = big[phase] | small[phase]
        out["per_org"][phase] = {k: (big[phase][k] - small[phase][k]) / d for k in keys}
    if a.json:
        print(json.dumps(out, indent=1))
        return out
    print(f"bytes per org, {a.orgs:,} orgs side by side with {a.base} (tracemalloc; sfq.Scheduler: {sfq.CORE})")
    print("| component | at rest | active (2 requests each) |")
    print("|---|---:|---:|")
    rest, act = out["per_org"]["rest"], out["per_org"]["active"]
    names = sorted(set(rest) | set(act), key=lambda k: -(rest.get(k, 0) + act.get(k, 0)))
    for k in names:
        print(f"| {k} | {rest.get(k, 0):,.0f} | {act.get(k, 0):,.0f} |")
    tr, ta = sum(rest.values()), sum(act.values())
    mr, ma = rest.get("metrics counters", 0), act.get("metrics counters", 0)
    print(f"| **total** | **{tr:,.0f}** | **{ta:,.0f}** |")
    print(f"| total without the metrics counters | {tr - mr:,.0f} | {ta - ma:,.0f} |")
    return out


if __name__ == "__main__":
    main()
