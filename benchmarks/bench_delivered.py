"""Delivered service through ``sfq serve``: the shares, Jain's index and drift of four orgs
with equal weights, one over-declaring ``max_tokens`` 40x, one keeping a request waiting, one
interactive; then an org whose estimate is trained low. The workload, the loopback engines
(two, of unequal speed, 4 requests at a time each, usage reported honestly) and the measures
are those of ``tests/serve/test_serve_delivered.py`` (``tests/serve/delivered_workload.py``),
run longer and under each charge mode of the policy file (``cost.charge``).

Service is prompt + 2 x output tokens as the engines delivered them. Reported per case and
charge mode: each org's share of the backlogged orgs' service (after a warm-up), Jain's
index over them, the least share of the over-declaring (or trained-low) org over any
twentieth of the run's work, the drift (the largest gap in service units that opened between
two backlogged orgs over any interval, and in requests' worth: the largest request's
service, prompt + 2 x output), and the
interactive org's time to first token (p50, p99).

Run from the repository root::

    python benchmarks/bench_delivered.py                       # ~5 minutes: both cases, 3 modes
    python benchmarks/bench_delivered.py --seconds 20 --modes served

Results go to ``benchmarks/results/delivered.json`` and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "serve"))  # the workload and the gateway launcher of the tests
if not os.environ.get("PYTHONPATH"):
    try:
        import sfq  # noqa: F401
    except ImportError:  # a checkout without an install: the child gateway needs python/ too
        os.environ["PYTHONPATH"] = str(ROOT / "python")

import numpy as np  # noqa: E402
from delivered_workload import (  # noqa: E402
    Fleet,
    OrgLoad,
    drift,
    jain,
    least_window_share,
    over_declared_orgs,
    policy_text,
    run_workload,
    service,
    shares,
    trained_low_orgs,
)
from serve_helpers import GatewayProcess  # noqa: E402

SPEEDS = (2.0, 1.0)
#: seconds per service unit at speed 1 (as in the tests): the trained-low case runs a faster
#: engine, so that its window holds many requests' worth of service
UNIT_OVER_DECLARED = 0.002
UNIT_TRAINED_LOW = 0.001
MODES = ("served", "settle", "seed")


def _run(orgs: list[OrgLoad], seconds: float, charge: str, unit: float) -> tuple[Any, Fleet]:
    fleet = Fleet(SPEEDS, unit=unit).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "policy.yaml"
            cfg.write_text(policy_text([e.url for e in fleet.engines], orgs, charge=charge))
            gw = GatewayProcess(cfg)
            try:
                res = asyncio.run(run_workload(gw.url, orgs, seconds, fleet.log))
            finally:
                gw.stop()
    finally:
        fleet.stop()
    return res, fleet


def _measures(res: Any, names: list[str], watch: str, t0: float, t1: float, request_units: float) -> dict[str, Any]:
    svc = service(res.log, names, t0, t1)
    total = sum(svc.values())
    d = drift(res.log, names, t0, t1)
    return {
        "shares": {k: round(v, 4) for k, v in shares(svc).items()},
        "jain": round(jain(list(svc.values())), 4),
        f"least_window_share_{watch}": round(least_window_share(res.log, names, watch, total / 20, t0, t1), 4),
        "drift_units": round(d, 1),
        "drift_requests": round(d / request_units, 2),
        "request_units": request_units,
        "service_units": round(total, 1),
        "requests_completed": dict(res.ok),
        "errors": {k: len(v) for k, v in res.errors.items()},
    }


def case_over_declared(seconds: float, charge: str) -> dict[str, Any]:
    orgs = over_declared_orgs()
    res, fleet = _run(orgs, seconds, charge, UNIT_OVER_DECLARED)
    names = [o.name for o in orgs if o.backlogged]
    out = _measures(res, names, "D", res.start + 2.0, res.start + seconds, 20 + 2 * 50)
    tt = res.ttft["B"]
    out["interactive_ttft_s"] = ({"p50": round(float(np.percentile(tt, 50)), 4),
                                  "p99": round(float(np.percentile(tt, 99)), 4), "n": len(tt)} if tt else None)
    out["engines_served"] = [e.served for e in fleet.engines]
    return out


def case_trained_low(seconds: float, switch: float, charge: str) -> dict[str, Any]:
    orgs = trained_low_orgs(switch)
    res, fleet = _run(orgs, seconds, charge, UNIT_TRAINED_LOW)
    names = [o.name for o in orgs]
    out = _measures(res, names, "D", res.start + switch, res.start + seconds, 20 + 2 * 400)
    out["before_switch_shares"] = {k: round(v, 4) for k, v in
                                   shares(service(res.log, names, res.start + 1.0, res.start + switch)).items()}
    out["engines_served"] = [e.served for e in fleet.engines]
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | charge | shares | Jain | least share of D (1/20 of the work) | drift (units / requests) | "
             "interactive TTFT p50 / p99 |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        m = r["result"]
        sh = " / ".join(f"{k} {v:.1%}" for k, v in m["shares"].items())
        tt = m.get("interactive_ttft_s")
        tts = f"{tt['p50']:.3f} s / {tt['p99']:.3f} s" if tt else ""
        lines.append(f"| {r['case']} | {r['charge']} | {sh} | {m['jain']:.3f} | {m['least_window_share_D']:.1%} | "
                     f"{m['drift_units']:.0f} / {m['drift_requests']} | {tts} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="load per run of the first case (default 40)")
    ap.add_argument("--seconds-trained", type=float, default=45.0, help="load per run of the second case (45)")
    ap.add_argument("--switch", type=float, default=15.0, help="when the trained-low org starts using all (15)")
    ap.add_argument("--modes", default=",".join(MODES), help="charge modes to run (served,settle,seed)")
    ap.add_argument("--cases", default="over-declared,trained-low", help="cases to run")
    ap.add_argument("--json", default=str(HERE / "results" / "delivered.json"))
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    cases = args.cases.split(",")
    for charge in modes:
        if "over-declared" in cases:
            rows.append({"case": "over-declared", "charge": charge,
                         "result": case_over_declared(args.seconds, charge)})
            print(markdown(rows[-1:]), flush=True)
        if "trained-low" in cases:
            rows.append({"case": "trained-low", "charge": charge,
                         "result": case_trained_low(args.seconds_trained, args.switch, charge)})
            print(markdown(rows[-1:]), flush=True)
    import sfq

    doc = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "core": sfq.CORE, "python": platform.python_version(),
           "machine": platform.machine(), "cpus": os.cpu_count(), "loadavg_before": load_before,
           "loadavg_after": os.getloadavg(), "engines": {"speeds": SPEEDS, "slots": 4, "unit_s": {"over-declared": UNIT_OVER_DECLARED,
                                                                      "trained-low": UNIT_TRAINED_LOW}},
           "seconds": args.seconds, "seconds_trained": args.seconds_trained, "switch": args.switch, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    print()
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
