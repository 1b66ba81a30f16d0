"""The isolation figure (issue 42, part 5): a quiet tenant's time to first token while two others
flood, divided by the same tenant's TTFT alone on the same fleet, with the fleet's throughput
beside FIFO's (work conservation).

Real ``python -m sfq serve`` processes, the official ``openai`` client, ``--engines`` loopback
engines (``tests/support/workload.py``'s ``FakeEngine``; one by default) of ``--slots`` slots
(32) each, all backends of the gateway's one pool, whose service time grows with the tokens
(``--unit`` seconds a token of prompt, twice that a token of output: 10 ms an output token by
default, so a flood answer of 50-350 tokens holds its slot 0.5-3.5 s). The tenants:

* ``flood-a``, ``flood-b``: ``--clients`` closed-loop clients each (default 40 per engine;
  plain completions, ``max_tokens`` 350, answers of U[50, 350] tokens, seeded), together always
  more than the pool's slots: both are backlogged throughout (the flood grows with the pool);
* ``quiet``: streamed chat completions of 20 tokens, Poisson arrivals every ``--interval`` s on
  average (seeded), far below its share, whatever the pool's size (a quiet tenant stays quiet). Its TTFT is the time from the request to the first
  chunk with content (the engine's role chunk comes before its prefill and is not counted).

Per configuration one gateway on the same engines: first the quiet tenant alone for
``--alone`` s (its TTFT alone), then the flood and the quiet tenant together for
``--warmup`` + ``--seconds`` s (measured after the warm-up). The configurations:

* ``fifo``: every key in one org with one class: one flow, first come first served (the FIFO
  of ``bench_overload.py``; what a proxy without sfq does);
* ``priority``: the quiet tenant's class ``strict: true`` (served before the weighted ones);
* ``sfq``: three orgs of weight 1 (SFQ between them, Goyal, Vin and Cheng 1996);
* ``sfq-deadlines``: ``sfq`` with the quiet tenant's class setting ``deadline_seconds`` and
  ``ttft_objective_seconds`` (EDF inside its flow, docs/design.md §5d);
* ``headroom-K`` (a prototype, ``--configs``): ``sfq-deadlines`` with the pool's
  ``limits.headroom: K``: when no more than K slots are free, only a flow with nothing running
  or below its part of the other slots may take one (as Kubernetes API Priority and Fairness
  lets seats be borrowed), so a quiet tenant finds a slot at once; what it costs is K slots
  idle while the flood holds its part.

Reported per configuration: the quiet tenant's TTFT p50 and p99 alone and under the flood
(seconds); the flood figures over the alone figure of the run set (the median of every
configuration's alone runs: the quiet tenant alone does not depend on the policy, and one
row's alone p99 of 40 requests is noisy); the objective attainment (TTFT within
``--objective`` s); the output tokens the engine completed per second in the measured window,
and that throughput over the same run's FIFO figure. With ``--runs N`` every configuration
runs N times, interleaved (run ``i`` goes through all of them, from the ``i``-th on, with seed
``--seed + 100 i``), and each figure is the median of the runs with their min and max.

Run from the repository root::

    python benchmarks/bench_isolation.py                 # ~5 minutes: 6 configurations
    python benchmarks/bench_isolation.py --runs 3 --configs fifo,sfq,sfq-deadlines,headroom-2
    python benchmarks/bench_isolation.py --quick         # a smoke run (numbers not for quoting)
    python benchmarks/bench_isolation.py --engines 2 --configs fifo,sfq-deadlines,headroom-2

Results go to ``benchmarks/results/isolation.json`` (not with ``--quick``) and a markdown table
on stdout. Under pytest ``test_bench_isolation_smoke`` runs a tiny version; nothing is timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # the loopback engine and process helpers (tests/support)
if not os.environ.get("PYTHONPATH"):
    try:
        import sfq  # noqa: F401
    except ImportError:  # a checkout without an install: the child gateways need python/ too
        os.environ["PYTHONPATH"] = str(ROOT / "python")

from support.processes import Gateway  # noqa: E402
from support.workload import Fleet  # noqa: E402

CONFIGS = ("fifo", "priority", "sfq", "sfq-deadlines", "headroom-1", "headroom-2")
KEYS = {"flood-a": "k-a", "flood-b": "k-b", "quiet": "k-q"}
FLOOD = (50, 350)  # answer tokens, uniform
QUIET_TOKENS = 20


def policy(config: str, urls: list[str], slots: int, objective: float, deadline: float) -> str:
    """The gateway's policy for one configuration (one pool over the engines at ``urls``, each
    of ``slots`` slots)."""
    headroom = f"\n    limits: {{headroom: {int(config.split('-')[1])}}}" if config.startswith("headroom-") else ""
    backends = "".join(f"\n      - {{url: \"{u}\", max_in_flight: {slots}}}" for u in urls)
    head = f"""\
pools:
  main:
    models: [m]
    backends:{backends}{headroom}
cost: {{input_weight: 1, output_weight: 2, charge: served}}
"""
    if config == "fifo":
        return head + f"""\
classes:
  all: {{weight: 1, small_cost: null}}
orgs:
  everyone: {{keys: [{", ".join(KEYS.values())}], classes: [all]}}
"""
    quiet = {"priority": "{strict: true, max_in_flight: %d, max_queue_age_seconds: 3600}" % (slots * len(urls)),
             "sfq": "{weight: 1, small_cost: null}",
             "sfq-deadlines": "{weight: 1, small_cost: null, deadline_seconds: %g, ttft_objective_seconds: %g}"
                              % (deadline, objective)}[
                                  "sfq-deadlines" if config.startswith("headroom-") else config]
    return head + f"""\
classes:
  batch: {{weight: 1, small_cost: null}}
  interactive: {quiet}
orgs:
  flood-a: {{keys: [k-a], classes: [batch]}}
  flood-b: {{keys: [k-b], classes: [batch]}}
  quiet: {{keys: [k-q], classes: [interactive]}}
"""


def _prompt(org: str, use: int) -> str:
    head = f"org={org} use={use} |"
    return head + " " + "p" * max(0, 80 - len(head) - 1)


async def _drive(url: str, seconds: float, *, flood_clients: int, interval: float, seed: int,
                 ttft: list[tuple[float, float]], errors: list[str]) -> None:
    """The quiet tenant (and, with ``flood_clients``, the flood) for ``seconds``; appends
    ``(sent, ttft)`` of the quiet tenant's requests."""
    import openai

    end = time.monotonic() + seconds
    mk = {org: openai.AsyncOpenAI(base_url=url + "/v1", api_key=k, max_retries=0, timeout=120.0)
          for org, k in KEYS.items()}

    async def flooder(org: str, i: int) -> None:
        rng = random.Random(f"{seed}-{org}-{i}")
        while time.monotonic() < end:
            use = rng.randint(*FLOOD)
            try:
                await mk[org].completions.create(model="m", prompt=_prompt(org, use), max_tokens=FLOOD[1])
            except Exception as exc:  # counted: the run reports them
                errors.append(f"{org}: {type(exc).__name__}: {exc}")

    async def quiet_one() -> None:
        t0 = time.monotonic()
        try:
            s = await mk["quiet"].chat.completions.create(
                model="m", messages=[{"role": "user", "content": _prompt("quiet", QUIET_TOKENS)}],
                max_tokens=QUIET_TOKENS, stream=True)
            first = None
            async for ev in s:
                if first is None and ev.choices and ev.choices[0].delta.content:
                    first = time.monotonic() - t0
            if first is not None:
                ttft.append((t0, first))
        except Exception as exc:
            errors.append(f"quiet: {type(exc).__name__}: {exc}")

    async def quiet() -> None:
        rng = random.Random(f"{seed}-quiet")
        tasks = []
        while time.monotonic() < end:
            tasks.append(asyncio.ensure_future(quiet_one()))
            await asyncio.sleep(rng.expovariate(1.0 / interval))
        await asyncio.gather(*tasks)

    jobs = [quiet()] + [flooder(org, i) for org in ("flood-a", "flood-b") for i in range(flood_clients)]
    await asyncio.gather(*jobs)
    for c in mk.values():
        await c.close()


def _q(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s))) - 1))]


def run_config(config: str, *, slots: int, unit: float, clients: int, interval: float, alone: float,
               warmup: float, seconds: float, objective: float, deadline: float, seed: int,
               engines: int = 1) -> dict[str, Any]:
    fleet = Fleet([1.0] * engines, slots=slots, unit=unit).start()
    gw = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "policy.yaml"
            cfg.write_text(policy(config, [e.url for e in fleet.engines], slots, objective, deadline))
            gw = Gateway(cfg)
            errors: list[str] = []
            alone_ttft: list[tuple[float, float]] = []
            asyncio.run(_drive(gw.url, alone, flood_clients=0, interval=interval, seed=seed, ttft=alone_ttft,
                               errors=errors))
            busy: list[tuple[float, float]] = []
            t0 = time.monotonic()
            asyncio.run(_drive(gw.url, warmup + seconds, flood_clients=clients, interval=interval, seed=seed + 1,
                               ttft=busy, errors=errors))
            start, stop = t0 + warmup, t0 + warmup + seconds
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()
    a = [x for _, x in alone_ttft]
    b = [x for t, x in busy if start <= t < stop]
    tokens = sum(n for t, _org, n in fleet.done if start <= t < stop)
    a50, a99, b50, b99 = _q(a, 50), _q(a, 99), _q(b, 50), _q(b, 99)
    return {
        "config": config,
        "quiet_alone": {"n": len(a), "p50": a50, "p99": a99},
        "quiet_flood": {"n": len(b), "p50": b50, "p99": b99},
        "p50_ratio": b50 / a50 if a50 and b50 is not None else None,
        "p99_ratio": b99 / a99 if a99 and b99 is not None else None,
        "attainment": sum(x <= objective for x in b) / len(b) if b else None,
        "tokens_per_s": tokens / seconds,
        # per engine: requests served to their end, and the most it held at once (<= slots)
        "engines_served": [e.served for e in fleet.engines],
        "engines_max_holding": [e.max_holding for e in fleet.engines],
        "errors": len(errors),
        "error_sample": errors[:3],
    }


def _spread(xs: list[float | None]) -> dict[str, float | None]:
    """Median, min and max of the runs' figures (``None`` where a run had none)."""
    v = [x for x in xs if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(v), "min": min(v), "max": max(v)}


def run(configs: tuple[str, ...] = CONFIGS, runs: int = 1, **kw: Any) -> dict[str, Any]:
    """``runs`` runs of every configuration, interleaved (run ``i`` goes through them all, from
    the ``i``-th on, before run ``i + 1``), run ``i`` with seed ``seed + 100 i`` for all its
    configurations. Per configuration: the runs (``runs``) and the medians with min and max.
    The alone figure is the median of every alone p50 (p99) of the run set, all configurations
    together (the quiet tenant alone on the same engine; one row's alone p99 of 40 requests is
    a noisy figure); each row's flood p50 (p99) is divided by it. Throughput is divided by the
    same run's FIFO figure."""
    seed = kw.pop("seed", 0)
    per: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for i in range(runs):
        order = configs[i % len(configs):] + configs[:i % len(configs)]
        for c in order:
            r = run_config(c, seed=seed + 100 * i, **kw)
            r["run"] = i
            per[c].append(r)
            print(f"run {i + 1}/{runs} {c}: alone p99 {r['quiet_alone']['p99']}, flood p50 / p99 "
                  f"{r['quiet_flood']['p50']} / {r['quiet_flood']['p99']}, {r['tokens_per_s']:.0f} tokens/s",
                  file=sys.stderr, flush=True)
    for i in range(runs):
        base = next((r["tokens_per_s"] for r in per.get("fifo", []) if r["run"] == i), None)
        for c in configs:
            for r in per[c]:
                if r["run"] == i:
                    r["throughput_vs_fifo"] = r["tokens_per_s"] / base if base else None
    every = [r for c in configs for r in per[c]]
    alone = {q: _spread([r["quiet_alone"][q] for r in every])["median"] for q in ("p50", "p99")}
    rows = []
    for c in configs:
        rs = per[c]
        row: dict[str, Any] = {"config": c, "runs": len(rs)}
        row["quiet_alone"] = {q: _spread([r["quiet_alone"][q] for r in rs]) for q in ("p50", "p99")}
        row["quiet_flood"] = {q: _spread([r["quiet_flood"][q] for r in rs]) for q in ("p50", "p99")}
        for q in ("p50", "p99"):
            row[f"{q}_ratio"] = _spread([r["quiet_flood"][q] / alone[q] if alone[q] and r["quiet_flood"][q]
                                         is not None else None for r in rs])
        row["attainment"] = _spread([r["attainment"] for r in rs])
        row["tokens_per_s"] = _spread([r["tokens_per_s"] for r in rs])
        row["throughput_vs_fifo"] = _spread([r.get("throughput_vs_fifo") for r in rs])
        row["errors"] = sum(r["errors"] for r in rs)
        row["error_sample"] = [e for r in rs for e in r["error_sample"]][:3]
        rows.append(row)
    return {"alone": alone, "rows": rows, "runs": every}


def table(rows: list[dict[str, Any]], alone: dict[str, float | None]) -> str:
    """Medians, [min-max] over the runs when there were several."""
    def f(s: dict[str, Any], d: int = 3, scale: float = 1.0, unit: str = "") -> str:
        if s["median"] is None:
            return "-"
        m = f"{scale * s['median']:.{d}f}{unit}"
        if s["min"] == s["max"]:
            return m
        return f"{m} [{scale * s['min']:.{d}f}-{scale * s['max']:.{d}f}]"

    def g(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    out = [f"alone (the median of every row's runs): p50 {g(alone['p50'])} s, p99 {g(alone['p99'])} s", "",
           "| configuration | runs | its alone p50 / p99 (s) | under the flood p50 / p99 (s) | p50 vs alone | "
           "p99 vs alone | within objective | tokens/s | vs FIFO |", "|---|---:|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["quiet_alone"], r["quiet_flood"]
        out.append(f"| {r['config']} | {r['runs']} | {f(a['p50'])} / {f(a['p99'])} | {f(b['p50'])} / {f(b['p99'])} | "
                   f"{f(r['p50_ratio'], 2, unit='x')} | {f(r['p99_ratio'], 2, unit='x')} | "
                   f"{f(r['attainment'], 1, 100, ' %')} | {f(r['tokens_per_s'], 0)} | "
                   f"{f(r['throughput_vs_fifo'], 1, 100, ' %')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--runs", type=int, default=1, help="runs of every configuration, interleaved")
    ap.add_argument("--engines", type=int, default=1, help="loopback engines in the pool (default 1)")
    ap.add_argument("--slots", type=int, default=32, help="slots of each engine")
    ap.add_argument("--unit", type=float, default=0.005, help="seconds a prompt token, half an output token")
    ap.add_argument("--clients", type=int, default=None,
                    help="closed-loop clients of each flooding tenant (default 40 per engine)")
    ap.add_argument("--interval", type=float, default=0.25, help="the quiet tenant's mean gap (s)")
    ap.add_argument("--alone", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--objective", type=float, default=0.5, help="the quiet class's TTFT objective (s)")
    ap.add_argument("--deadline", type=float, default=2.0, help="the quiet class's deadline_seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=str(HERE / "results" / "isolation.json"))
    a = ap.parse_args(argv)
    if a.engines < 1:
        ap.error("--engines must be >= 1")
    if a.clients is None:
        a.clients = 40 * a.engines
    if a.quick:
        a.clients, a.alone, a.warmup, a.seconds = 8 * a.engines, 2.0, 1.0, 3.0
    if a.runs < 1:
        ap.error("--runs must be >= 1")
    kw = dict(engines=a.engines, slots=a.slots, unit=a.unit, clients=a.clients, interval=a.interval, alone=a.alone, warmup=a.warmup,
              seconds=a.seconds, objective=a.objective, deadline=a.deadline, seed=a.seed)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    res = run(tuple(a.configs.split(",")), runs=a.runs, **kw)
    doc = {"benchmark": "bench_isolation", "python": platform.python_version(), "cpus": os.cpu_count(),
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "wall_s": round(time.monotonic() - t0, 1),
           "params": {**kw, "runs": a.runs, "flood_tokens": FLOOD, "quiet_tokens": QUIET_TOKENS}, **res}
    if not a.quick:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\n{a.engines} engine{'s' if a.engines > 1 else ''} of {a.slots} slots, {a.clients} closed-loop clients "
          f"per flooding tenant; load average before {load_before[0]:.2f}, after {doc['loadavg_after'][0]:.2f}; "
          f"wall {doc['wall_s']} s\n")
    print(table(res["rows"], res["alone"]))
    return 0


def test_bench_isolation_smoke() -> None:
    """A tiny version once (CI's benchmark smoke run): every configuration runs and the quiet
    tenant gets answers alone and under the flood; nothing is timed, no ratio asserted."""
    import pytest

    pytest.importorskip("openai")
    res = run(("fifo", "sfq-deadlines", "headroom-1"), runs=2, slots=4, unit=0.001, clients=2, interval=0.1,
              alone=0.5, warmup=0.2, seconds=1.0, objective=0.5, deadline=2.0, seed=0)
    assert [r["config"] for r in res["rows"]] == ["fifo", "sfq-deadlines", "headroom-1"]
    assert [(r["run"], r["config"]) for r in res["runs"]] == [
        (0, "fifo"), (1, "fifo"), (0, "sfq-deadlines"), (1, "sfq-deadlines"), (0, "headroom-1"), (1, "headroom-1")]
    for r in res["runs"]:
        assert r["quiet_alone"]["n"] > 0 and r["quiet_flood"]["n"] > 0 and r["tokens_per_s"] > 0
        assert r["errors"] == 0, r["error_sample"]
    for r in res["rows"]:
        assert r["runs"] == 2 and r["tokens_per_s"]["min"] <= r["tokens_per_s"]["median"] <= r["tokens_per_s"]["max"]
    assert res["rows"][0]["throughput_vs_fifo"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    print(table(res["rows"], res["alone"]))
    # --engines 2: one pool over both engines, each used and never sent more than its slots
    cfg = policy("headroom-1", ["http://a.invalid", "http://b.invalid"], 4, 0.5, 2.0)
    assert cfg.count("max_in_flight: 4}") == 2 and "headroom: 1" in cfg
    two = run(("fifo", "headroom-1"), runs=1, engines=2, slots=2, unit=0.001, clients=4, interval=0.1,
              alone=0.5, warmup=0.2, seconds=1.0, objective=0.5, deadline=2.0, seed=0)
    for r in two["runs"]:
        assert r["errors"] == 0, r["error_sample"]
        assert r["quiet_flood"]["n"] > 0 and len(r["engines_served"]) == 2 and min(r["engines_served"]) > 0
        assert max(r["engines_max_holding"]) <= 2


if __name__ == "__main__":
    sys.exit(main())
