"""Where ``sfq serve``'s CPU goes, per request and per streamed chunk (py-spy, grouped by component).

The set-up of ``bench_proxy.py`` (an nginx upstream and ``wrk`` on one core, ``sfq serve`` with
one org and its defaults, access log and metrics on, on the other), one mode at a time:

* ``plain``: chat completions, ``wrk -c64`` (closed loop, the gateway saturated);
* ``stream``: 50-event streams, ``wrk -c16``.

Each mode runs twice: first without the profiler, for the CPU per request (``/proc/PID/stat``
over the run, as in ``bench_proxy.py``), then under ``py-spy record --native`` (Python and C
frames; the sampled process is paused for each sample, so its throughput drops, not its
shape). Every sample is given to one component:

1. by what runs anywhere on its stack, in this order: garbage collection (CPython's
   ``gc_collect_main``), ``getpid`` (asyncio's running-loop check calls it on Python < 3.12),
   the access log (``logging`` or the gateway's ``_log``), aiohttp trace hooks
   (``aiohttp/tracing.py``), metrics (``prometheus_client``, ``sfq/policy/metrics.py``), JSON
   (``json``, ``_json.c``, ``orjson`` and sfq's wrappers around it);
2. otherwise by its innermost Python frame (helpers such as ``abc``, ``typing``, ``enum``,
   ``contextlib`` count for their caller): ``sfq/serve`` the gateway handler, ``sfq/dispatch``
   the dispatcher, ``sfq/engine``, ``sfq/policy``, ``sfq/cost.py`` and the core the policy
   engine, ``sfq/backends`` the backend, aiohttp (and yarl, multidict) the client or the server
   by the nearest enclosing frame that is one or the other, ``asyncio`` the event loop; a stack
   with no Python frame at all (uvloop, libuv, epoll) is the event loop too.

A component's share of the samples times the unprofiled CPU per request (or per event) is its
cost. System calls count for the component that made them.

Run from the repository root (``pip install py-spy``; nginx, its echo module and wrk as for
``bench_proxy.py``; py-spy needs ptrace: root, or ``kernel.yama.ptrace_scope=0``)::

    python benchmarks/profile_serve.py                  # both modes, about 1 minute
    python benchmarks/profile_serve.py --modes plain --seconds 15
    python benchmarks/profile_serve.py --from benchmarks/results/profile-serve.json   # re-render

The JSON (components, their top frames, the raw collapsed stacks' counts) goes to
``benchmarks/results/profile-serve.json``; the tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_proxy as bp  # noqa: E402

COMPONENTS = ("aiohttp client", "aiohttp server", "event loop", "policy engine", "dispatcher", "gateway handler",
              "backend (sfq)", "access log", "trace hooks", "JSON decode/encode", "metrics", "GC", "os.getpid",
              "other")
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*?)(?::(?P<line>\d+))?\)$")
_GENERIC = ("<frozen abc>", "<frozen ", "typing.py", "enum.py", "contextlib.py", "functools.py", "weakref.py",
            "_weakrefset.py", "collections/", "copy.py", "types.py", "re/", "abc.py", "dataclasses.py")
_CLIENT = ("aiohttp/client.py", "aiohttp/client_reqrep.py", "aiohttp/connector.py", "aiohttp/client_proto.py",
           "aiohttp/client_exceptions.py", "aiohttp/client_ws.py", "aiohappyeyeballs/")
_SERVER = ("aiohttp/web_",)
#: sfq's own wrappers around orjson (their frames are the JSON work)
_JSON_HELPERS = {("_loads", "sfq/backends/openai.py"), ("_dumps", "sfq/serve/app.py")}
_SHARED = ("aiohttp/", "yarl/", "multidict/", "propcache/", "aiosignal/", "frozenlist/")


def parse_frame(text: str) -> tuple[str, str, bool]:
    """(function, file, is_python) of one py-spy frame ``func (file:line)``."""
    m = _FRAME.match(text)
    if m is None:
        return text, "", False
    f = m.group("file")
    return m.group("func"), f, f.endswith(".py") or f.startswith("<frozen")


def classify(frames: list[str]) -> tuple[str, str]:
    """(component, the frame it is charged to) of one sample, frames root first."""
    parsed = [parse_frame(f) for f in frames]
    for func, file, py in reversed(parsed):
        if not py and re.match(r"(gc_collect_main|gc_collect_with_callback|gc_collect_generations|collect_gen)",
                               func):
            return "GC", func
    for func, file, py in reversed(parsed):
        if not py and "getpid" in func:
            return "os.getpid", func
    rules = (("access log", lambda fn, fl: fl.startswith("logging/") or (fn == "Gateway._log" and
                                                                         fl == "sfq/serve/app.py")),
             ("trace hooks", lambda fn, fl: fl == "aiohttp/tracing.py" or fn == "_on_reuse"),
             ("metrics", lambda fn, fl: fl.startswith("prometheus_client/") or fl == "sfq/policy/metrics.py"),
             ("JSON decode/encode", lambda fn, fl: fl.startswith(("json/", "orjson/")) or fl == "_json.c"
              or (fn, fl) in _JSON_HELPERS))
    leaf = _leaf(parsed)
    for name, rule in rules:
        if any(rule(fn, fl) for fn, fl, _ in parsed):
            return name, leaf
    for i in range(len(parsed) - 1, -1, -1):
        func, file, py = parsed[i]
        if not py or any(file.startswith(g) or g in file for g in _GENERIC):
            continue
        comp = _component(file, parsed[:i])
        if comp == "event loop" and i < len(parsed) - 1:  # inside uvloop / libuv: name the C function
            return comp, parsed[-1][0]
        if comp is not None:
            return comp, f"{func} ({file})"
    return ("other", leaf) if any(py for _, _, py in parsed) else ("event loop", leaf)


def _leaf(parsed: list[tuple[str, str, bool]]) -> str:
    for func, file, py in reversed(parsed):
        if py and not any(file.startswith(g) or g in file for g in _GENERIC):
            return f"{func} ({file})"
    return parsed[-1][0] if parsed else ""


def _component(file: str, outer: list[tuple[str, str, bool]]) -> str | None:
    if file.startswith("sfq/serve/"):
        return "gateway handler"
    if file.startswith("sfq/dispatch/"):
        return "dispatcher"
    if file.startswith(("sfq/engine/", "sfq/policy/", "sfq/state/")) or file in ("sfq/cost.py", "sfq/_core.py",
                                                                              "sfq/_scheduler_py.py"):
        return "policy engine"
    if file.startswith("sfq/backends/"):
        return "backend (sfq)"
    if file.startswith(_CLIENT):
        return "aiohttp client"
    if file.startswith(_SERVER):
        return "aiohttp server"
    if file.startswith(_SHARED):
        for _, f, _ in reversed(outer):  # the nearest enclosing frame that is one or the other
            if f.startswith(_CLIENT):
                return "aiohttp client"
            if f.startswith(_SERVER):
                return "aiohttp server"
        return "aiohttp server"
    if file.startswith(("asyncio/", "uvloop/", "<frozen runpy>")):
        return "event loop"
    if file.startswith("sfq/"):
        return "other"
    return None


def breakdown(raw: str) -> dict[str, Any]:
    """Samples per component and per charged frame from py-spy's raw (collapsed) output."""
    comps: Counter[str] = Counter()
    frames: dict[str, Counter[str]] = defaultdict(Counter)
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        k = int(n)
        comp, frame = classify(stack.split(";"))
        comps[comp] += k
        frames[comp][frame] += k
        total += k
    return {"samples": total, "components": dict(comps.most_common()),
            "top_frames": {c: frames[c].most_common(8) for c in comps}}


# ------------------------------------------------------------------ the run
def run_mode(mode: str, tmp: Path, seconds: float, rate: int, native: bool) -> dict[str, Any]:
    proxy_cpu, load_cpu = bp.cpu_plan()
    up_json, up_sse = bp.free_port(), bp.free_port()
    module = bp.echo_module()
    up = bp._nginx(tmp, f"upstream-{mode}", bp.upstream_http(up_json, up_sse, 1.0, module is not None),
                   [up_json, up_sse], load_cpu, module)
    try:
        port = up_json if mode == "plain" else up_sse
        url, gw = bp.start_sfq(tmp, f"sfq-{mode}", bp.sfq_pythonpath(), f"http://127.0.0.1:{port}", proxy_cpu)
        try:
            lua = bp.lua_script(tmp, mode, bp.CHAT_BODY if mode == "plain" else bp.STREAM_BODY)
            conns = 64 if mode == "plain" else 16
            bp.wrk(url, lua, conns=conns, seconds=2, cpu=load_cpu)  # warm-up
            with bp.measured(gw, proxy_cpu) as m:
                w = bp.wrk(url, lua, conns=conns, seconds=seconds, cpu=load_cpu)
            units = w["requests"] * (1 if mode == "plain" else bp.EVENTS)
            out: dict[str, Any] = {"mode": mode, "unprofiled": {**w, **m},
                                   "cpu_us_per_unit": m["cpu_s"] / max(1, units) * 1e6,
                                   "unit": "request" if mode == "plain" else "streamed chunk"}
            raw = tmp / f"{mode}.txt"
            cmd = ["py-spy", "record", "-p", str(gw.proc.pid), "-d", f"{seconds + 1:.0f}", "-r", str(rate),
                   "-f", "raw", "-o", str(raw)] + (["--native"] if native else [])
            spy = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            time.sleep(0.5)
            wp = bp.wrk(url, lua, conns=conns, seconds=seconds, cpu=load_cpu)
            log = spy.communicate(timeout=seconds + 60)[0].decode("utf-8", "replace")
            if spy.returncode != 0 or not raw.exists():
                raise RuntimeError(f"py-spy failed ({spy.returncode}):\n{log[-2000:]}")
            text = raw.read_text()
            out["profiled_rps"] = wp["rps"]
            out["py_spy"] = log.strip().splitlines()[-2:] if log.strip() else []
            out.update(breakdown(text))
            out["stacks"] = len(text.splitlines())
            return out
        finally:
            gw.stop()
    finally:
        up.stop()


def table(res: dict[str, Any]) -> str:
    lines = []
    for mode, r in res["modes"].items():
        total = r["samples"]
        per = r["cpu_us_per_unit"]
        lines.append(f"\n{mode}: {per:.1f} µs of CPU per {r['unit']} (unprofiled, {r['unprofiled']['rps']:.0f} "
                     f"{'req' if mode == 'plain' else 'streams'}/s), {total} samples\n")
        lines.append(f"| component | share | µs per {r['unit']} | top frames (samples) |")
        lines.append("| --- | ---: | ---: | --- |")
        for comp, n in r["components"].items():
            top = ", ".join(f"`{f}` {k}" for f, k in r["top_frames"][comp][:4])
            lines.append(f"| {comp} | {n / total:.1%} | {per * n / total:.1f} | {top} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="plain,stream", help="comma-separated: plain, stream")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of each run (10)")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second (250)")
    ap.add_argument("--python-only", action="store_true", help="no --native (GC and getpid are then not seen)")
    ap.add_argument("--from", dest="src", help="re-render a JSON written before (runs nothing)")
    ap.add_argument("--keep", metavar="DIR", help="also keep py-spy's collapsed stacks there (MODE.txt)")
    ap.add_argument("--out", default=str(HERE / "results" / "profile-serve.json"))
    a = ap.parse_args(argv)
    if a.src:
        res = json.loads(Path(a.src).read_text())
        print(table(res))
        return dict(res)
    missing = bp.missing_tools() + ([] if shutil.which("py-spy") else ["py-spy"])
    if missing:
        raise SystemExit(f"profile_serve needs {', '.join(missing)}")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("plain", "stream"):
            ap.error(f"unknown mode {m!r}; modes: plain, stream")
    res: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "python": sys.version.split()[0], "cpu_model": bp._cpu_model(), "uptime_before": bp.uptime(), "native": not a.python_only,
                           "modes": {}}
    with tempfile.TemporaryDirectory(prefix="profile-serve-") as d:
        for m in modes:
            print(f"== {m}", file=sys.stderr, flush=True)
            res["modes"][m] = run_mode(m, Path(d), a.seconds, a.rate, not a.python_only)
            if a.keep:
                Path(a.keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(Path(d) / f"{m}.txt", Path(a.keep) / f"{m}.txt")
    res["uptime_after"] = bp.uptime()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    return res


if __name__ == "__main__":
    main()
