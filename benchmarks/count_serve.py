"""Instructions per request and per streamed chunk of ``sfq serve`` (valgrind's callgrind): a
measure a shared machine's load cannot move, for comparing checkouts.

For each checkout (``--sfq NAME=DIR``, what goes on ``PYTHONPATH``; default this one), in turn:
``sfq serve`` with the set-up of ``bench_proxy.py`` (one org, its defaults, access log to a
file, metrics on) runs under ``valgrind --tool=callgrind`` in front of the nginx upstream of
``bench_proxy.py``; a warm-up of ``--warmup`` requests; the counters zeroed
(``callgrind_control -z``); exactly ``--requests`` chat completions from ``--conns``
concurrent keep-alive connections; a dump (``callgrind_control -d``); the same for
``--streams`` 50-event streams. The dump's total of instructions executed in the process
(user space: libpython, uvloop, the core, everything; not the kernel's side of system calls)
divided by the requests, or by the streamed events, is the figure. It is deterministic up to
the timers that fire during the run (health checks, keep-alive expiry): a checkout measured
twice agrees within about 1%.

Instructions are not nanoseconds (cache misses and system calls are not in them), but a
change that removes Python work removes its instructions, whatever else runs on the machine.
Callgrind runs the server about 50 times slower: a few hundred requests take tens of seconds.

Run from the repository root (valgrind, nginx and its echo module installed)::

    python benchmarks/count_serve.py --sfq before=/path/to/old/python --sfq after=python
    python benchmarks/count_serve.py --requests 300 --streams 40

Results go to ``benchmarks/results/count-serve.json`` and a table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_proxy as bp  # noqa: E402


async def _send(url: str, body: str, n: int, conns: int) -> int:
    """``n`` POSTs over ``conns`` keep-alive connections (closed loop); returns the 200s."""
    import aiohttp

    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {bp.KEY}"}
    left = n
    ok = 0

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal left, ok
        while left > 0:
            left -= 1
            async with s.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                await r.read()
                ok += r.status == 200

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conns),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(worker(s) for _ in range(conns)))
    return ok


def _instructions(dump: Path) -> int:
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary line in {dump}")


def _control(args: list[str]) -> None:
    out = subprocess.run(["callgrind_control", *args], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"callgrind_control {' '.join(args)}: {out.stdout[-500:]} {out.stderr[-500:]}")


def measure(name: str, pythonpath: str, upstream: str, body: str, n: int, warmup: int, conns: int,
            tmp: Path) -> dict[str, Any]:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(bp.policy_text(upstream))
    out = tmp / f"{name}.callgrind"
    proxy_cpu, _ = bp.cpu_plan()
    p = bp.Proc(name, ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no",
                       sys.executable, "-m", "sfq", "serve", "--config", str(cfg), "--port", "0",
                       "--access-log", str(tmp / f"{name}.access.log")], cpu=proxy_cpu, env={"PYTHONPATH": pythonpath})
    try:
        url = p.wait_for(r"listening on (http://\S+)", limit=600).group(1)
        asyncio.run(_send(url, body, warmup, conns))
        before = set(tmp.glob(f"{name}.callgrind*"))
        _control(["-z", str(p.proc.pid)])
        t0 = time.monotonic()
        ok = asyncio.run(_send(url, body, n, conns))
        wall = time.monotonic() - t0
        _control(["-d", str(p.proc.pid)])
        deadline = time.monotonic() + 60
        while not (dumps := set(tmp.glob(f"{name}.callgrind*")) - before) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not dumps:
            raise RuntimeError(f"{name}: callgrind wrote no dump")
        time.sleep(0.5)  # let it finish writing
        ir = _instructions(max(dumps, key=lambda f: f.stat().st_mtime))
    finally:
        p.stop()
        for f in tmp.glob(f"{name}.callgrind*"):
            f.unlink()
    if ok != n:
        raise RuntimeError(f"{name}: {ok} of {n} requests answered 200")
    return {"requests": n, "instructions": ir, "per_request": ir / n, "wall_s": wall}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sfq", action="append", type=bp._sfq_spec, metavar="NAME=DIR",
                    help="a checkout to measure (repeatable; default: this one)")
    ap.add_argument("--requests", type=int, default=400, help="chat completions counted (400)")
    ap.add_argument("--streams", type=int, default=40, help="50-event streams counted (40; 0: none)")
    ap.add_argument("--warmup", type=int, default=100, help="requests before counting (100)")
    ap.add_argument("--conns", type=int, default=4, help="concurrent connections (4)")
    ap.add_argument("--out", default=str(HERE / "results" / "count-serve.json"))
    a = ap.parse_args(argv)
    missing = bp.missing_tools() + [t for t in ("valgrind", "callgrind_control") if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"count_serve needs {', '.join(missing)}")
    checkouts = a.sfq or [("this", bp.sfq_pythonpath())]
    res: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "python": sys.version.split()[0], "options": {k: v for k, v in vars(a).items()
                                                                          if k not in ("sfq", "out")},
                           "checkouts": {}}
    with tempfile.TemporaryDirectory(prefix="count-serve-") as d:
        tmp = Path(d)
        up_json, up_sse = bp.free_port(), bp.free_port()
        _, load_cpu = bp.cpu_plan()
        module = bp.echo_module()
        up = bp._nginx(tmp, "upstream", bp.upstream_http(up_json, up_sse, 1.0, module is not None),
                       [up_json, up_sse], load_cpu, module)
        try:
            for name, path in checkouts:
                print(f"== {name} ({path})", file=sys.stderr, flush=True)
                r: dict[str, Any] = {"path": path}
                r["plain"] = measure(f"{name}-plain", path, f"http://127.0.0.1:{up_json}", bp.CHAT_BODY,
                                     a.requests, a.warmup, a.conns, tmp)
                if a.streams:
                    r["stream"] = measure(f"{name}-stream", path, f"http://127.0.0.1:{up_sse}", bp.STREAM_BODY,
                                          a.streams, max(1, a.warmup // 10), a.conns, tmp)
                    r["stream"]["per_chunk"] = r["stream"]["per_request"] / bp.EVENTS
                res["checkouts"][name] = r
        finally:
            up.stop()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    return res


def table(res: dict[str, Any]) -> str:
    rows = ["| checkout | instructions per request | per streamed chunk | request vs the one before | chunk vs before |",
            "| --- | ---: | ---: | ---: | ---: |"]
    prev: dict[str, Any] | None = None
    for name, r in res["checkouts"].items():
        pr = r["plain"]["per_request"]
        pc = r.get("stream", {}).get("per_chunk")
        vs_r = f"{pr / prev['plain']['per_request'] - 1:+.1%}" if prev else ""
        vs_c = (f"{pc / prev['stream']['per_chunk'] - 1:+.1%}" if prev and pc and "stream" in prev else "")
        rows.append(f"| {name} | {pr / 1e3:,.0f} k | {pc / 1e3:,.1f} k | {vs_r} | {vs_c} |" if pc else
                    f"| {name} | {pr / 1e3:,.0f} k | - | {vs_r} | |")
        prev = r
    return "\n".join(rows)


if __name__ == "__main__":
    main()
