"""``sfq serve`` next to the proxies it is measured against, side by side in one run.

The proxies, each pinned to one core (the proxy core, CPU 1 on a 2-core machine):

* ``nginx``: nginx ``proxy_pass`` (Debian's package; one process, upstream keep-alive,
  ``proxy_buffering off`` for streams, no access log): what a proxy costs when it is not Python;
* ``bare``: ``bare_proxy.py``, the least an aiohttp proxy does (bytes in, bytes out; uvloop
  when installed): the floor of sfq's own stack;
* ``sfq``: ``sfq serve`` with one org, one class, one pool and its defaults: access log on
  (to a file), metrics on, the fair queue and the policy on every request.

The upstream is nginx too, on the other core (CPU 0) with the load generators: a fixed chat
completion (``return 200``), and a fixed stream of 50 events (49 content chunks and a usage
chunk, then ``data: [DONE]``) written one event at a time, ``--event-gap-ms`` apart (nginx's
echo module, Debian's ``libnginx-mod-http-echo``; without it the 50 events go out in one write
and the result says so), so that each event reaches the proxy on its own read, as tokens do.

Measured, in rounds interleaved proxy by proxy (nginx, bare, sfq, nginx, bare, sfq, ...), each
round in three blocks (rate, streams, latency):

1. **req/s on one core**: ``wrk -t1 -c64`` (closed loop, a Lua script for the POST body and the
   ``Authorization`` header) for ``--seconds``; **CPU per request**: the proxy process's
   utime + stime (``/proc/PID/stat``) over that run divided by the requests wrk completed.
2. **CPU per streamed chunk**: ``wrk -c{--stream-conns}`` on streaming requests; the proxy's
   CPU over the events it passed (50 per stream; the client asks for usage, so every event
   reaches it). Also the CPU per whole stream.
3. **Added latency at a fixed rate**: ``openloop.py`` (open loop, latency from each request's
   due time: no coordinated omission; Debian has no ``wrk2``) at ``--rate`` requests/s,
   straight to the upstream and then through each proxy; the added p50/p99 is the proxy's
   minus the upstream's own, in the same round. The proxy's CPU per request at that rate too.

Every figure is the median over rounds, with the min and max. The busy time of the proxy core
that was not the proxy's (``/proc/stat``: other processes on a shared machine) is recorded
per run: the machine's noise is part of the result.

Run from the repository root (``apt-get install nginx libnginx-mod-http-echo wrk``)::

    python benchmarks/bench_proxy.py                       # 5 rounds, about 4 minutes
    python benchmarks/bench_proxy.py --rounds 3 --seconds 3
    python benchmarks/bench_proxy.py --proxies bare,sfq
    python benchmarks/bench_proxy.py --sfq before=/path/to/old/python --sfq after=python
    python benchmarks/bench_proxy.py --quick               # a smoke run (numbers not for quoting)

``--sfq NAME=DIR`` (repeatable) runs ``sfq serve`` from the checkout ``DIR`` (what goes on
``PYTHONPATH``) as a proxy called ``sfq-NAME``, interleaved with the others: a before/after
comparison on the same machine in the same minutes. ``--scraped sfq-NAME`` (repeatable) has a
thread on the load generators' core ``GET /metrics`` from that proxy every ``--scrape-every``
seconds (1) while it is measured, as Prometheus would: the scrape's CPU counts in its CPU per
request (run the same checkout twice, once scraped, for the side-by-side)::

    python benchmarks/bench_proxy.py --proxies sfq --blocks rate,stream --sfq base=../wt-base/python \
        --sfq metrics=python --sfq scraped=python --scraped sfq-scraped Results go to
``benchmarks/results/proxy.json`` and ``benchmarks/results/proxy.md`` (the table), and the
table to stdout. Under pytest (CI's benchmark smoke run) ``test_bench_proxy_smoke`` runs the
quick version once and skips when nginx or wrk is missing; nothing is timed.
"""

from __future__ import annotations

import argparse
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
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench_serve import Proc as _ServeProc, _pin  # noqa: E402  (the same child-process helpers)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEY = "sk-bench"
EVENTS = 50  # data events per stream (49 content chunks + 1 usage chunk), then data: [DONE]
ECHO_MODULES = ("/usr/lib/nginx/modules/ngx_http_echo_module.so", "/usr/share/nginx/modules/ngx_http_echo_module.so")

CHAT_BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16},
                       separators=(",", ":"))
STREAM_BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 64,
                          "stream": True, "stream_options": {"include_usage": True}}, separators=(",", ":"))
REPLY = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21}}, separators=(",", ":"))


def sse_events() -> list[str]:
    """The 50 events' payloads of the fixed stream (without ``data: `` and the blank line)."""
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}
    out = []
    for i in range(EVENTS - 1):
        delta = {"role": "assistant", "content": ""} if i == 0 else {"content": f" tok{i}"}
        out.append(json.dumps({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                    "finish_reason": "stop" if i == EVENTS - 2 else None}]},
                              separators=(",", ":")))
    out.append(json.dumps({**head, "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": EVENTS - 2,
                                                            "total_tokens": 10 + EVENTS}}, separators=(",", ":")))
    return out


# ------------------------------------------------------------------ machine
def cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return []


def cpu_plan() -> tuple[int | None, int | None]:
    """(the proxy's core, the upstream's and load generators' core)."""
    c = cpus()
    return (c[1], c[0]) if len(c) >= 2 else (None, None)


def core_busy(cpu: int | None) -> float:
    """Seconds core ``cpu`` has been busy (everything but idle and iowait), from /proc/stat."""
    if cpu is None:
        return float("nan")
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith(f"cpu{cpu} "):
                f = [int(x) for x in line.split()[1:]]
                return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")
    return float("nan")


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with status {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listening on port {port} after {limit:g} s")


class Proc(_ServeProc):
    """``bench_serve``'s child process (pinned to ``cpu``, its output collected by reader
    threads), named, with the scheduler's account of its CPU too."""

    def __init__(self, name: str, cmd: list[str], *, cpu: int | None, env: dict[str, str] | None = None) -> None:
        self.name = name
        super().__init__(cmd, cpu=cpu, env=env)

    def run_seconds(self) -> float:
        """The scheduler's account of the same (ns resolution): the sum of every thread's
        ``/proc/PID/task/TID/schedstat`` run time; NaN where the kernel has no schedstat."""
        total = 0
        try:
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                with open(f"/proc/{self.proc.pid}/task/{tid}/schedstat") as fh:
                    total += int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            return float("nan")
        return total / 1e9


# ------------------------------------------------------------------ nginx
def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                          if os.access(p, os.X_OK)), None)


def echo_module() -> str | None:
    return next((p for p in ECHO_MODULES if os.path.exists(p)), None)


def _nginx_conf(tmp: Path, name: str, http: str, module: str | None = None) -> Path:
    d = tmp / name
    d.mkdir(exist_ok=True)
    temps = "".join(f"    {k}_temp_path {d}/{k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    load = f"load_module {module};\n" if module else ""
    conf = d / "nginx.conf"
    conf.write_text(f"""{load}daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 8192; multi_accept on; }}
http {{
    access_log off;
{temps}    keepalive_requests 10000000;
    keepalive_timeout 75s;
{http}}}
""")
    return conf


def _nginx(tmp: Path, name: str, http: str, ports: list[int], cpu: int | None, module: str | None = None) -> Proc:
    binary = nginx_binary()
    assert binary is not None
    conf = _nginx_conf(tmp, name, http, module)
    p = Proc(name, [binary, "-p", str(conf.parent), "-e", str(conf.parent / "error.log"), "-c", str(conf)], cpu=cpu)
    for port in ports:
        wait_port(port, p.proc)
    return p


def upstream_http(json_port: int, sse_port: int, gap_ms: float, echo: bool) -> str:
    reply = REPLY.replace("'", "\\'")
    if echo:
        gap = f"echo_sleep {gap_ms / 1000:.3f};\n" if gap_ms > 0 else ""  # echo_sleep takes 3 decimals
        lines = "".join(f"            echo -n 'data: {e}\\n\\n';\n            echo_flush;\n            {gap}"
                        for e in sse_events())
        sse = f"""            echo_read_request_body;
{lines}            echo -n 'data: [DONE]\\n\\n';
"""
    else:
        body = "".join(f"data: {e}\\n\\n" for e in sse_events()) + "data: [DONE]\\n\\n"
        sse = f"            return 200 '{body}';\n"
    return f"""    server {{
        listen 127.0.0.1:{json_port} backlog=8192;
        location / {{
            default_type application/json;
            return 200 '{reply}';
        }}
    }}
    server {{
        listen 127.0.0.1:{sse_port} backlog=8192;
        location / {{
            default_type text/event-stream;
{sse}        }}
    }}
"""


def proxy_http(json_port: int, sse_port: int, up_json: int, up_sse: int) -> str:
    common = """            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Authorization "";
"""
    return f"""    upstream up_json {{ server 127.0.0.1:{up_json}; keepalive 512; keepalive_requests 10000000; }}
    upstream up_sse {{ server 127.0.0.1:{up_sse}; keepalive 512; keepalive_requests 10000000; }}
    server {{
        listen 127.0.0.1:{json_port} backlog=8192;
        location / {{
            proxy_pass http://up_json;
{common}        }}
    }}
    server {{
        listen 127.0.0.1:{sse_port} backlog=8192;
        location / {{
            proxy_pass http://up_sse;
            proxy_buffering off;
{common}        }}
    }}
"""


# ------------------------------------------------------------------ the proxies
class Proxy:
    """One proxy under test: a URL for plain requests and one for streams, and the process(es)
    whose CPU is counted for each."""

    def __init__(self, name: str, plain: tuple[str, Proc], stream: tuple[str, Proc], what: str) -> None:
        self.name = name
        self.plain_url, self.plain_proc = plain
        self.stream_url, self.stream_proc = stream
        self.what = what


def policy_text(upstream: str) -> str:
    return f"""pools:
  main:
    models: [m]
    backends: [{{url: "{upstream}", max_in_flight: 1024}}]
classes:
  interactive: {{weight: 1}}
orgs:
  bench: {{keys: ["{KEY}"], classes: [interactive]}}
"""


def sfq_pythonpath() -> str:
    """Where this process finds ``sfq`` (the installed package, or the checkout's python/)."""
    try:
        import sfq
    except ImportError:
        sys.path.insert(0, str(ROOT / "python"))
        import sfq
    return str(Path(sfq.__file__).resolve().parent.parent)


def start_sfq(tmp: Path, label: str, pythonpath: str, upstream: str, cpu: int | None) -> tuple[str, Proc]:
    cfg = tmp / f"{label}.yaml"
    cfg.write_text(policy_text(upstream))
    env = {"PYTHONPATH": pythonpath + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    p = Proc(label, [sys.executable, "-m", "sfq", "serve", "--config", str(cfg), "--port", "0", "--grace", "1",
                     "--access-log", str(tmp / f"{label}.access.log")], cpu=cpu, env=env)
    return p.wait_for(r"listening on (http://\S+)").group(1), p


def start_bare(label: str, upstream: str, cpu: int | None) -> tuple[str, Proc]:
    p = Proc(label, [sys.executable, str(HERE / "bare_proxy.py"), upstream], cpu=cpu)
    port = p.wait_for(r"ready (\d+)").group(1)
    return f"http://127.0.0.1:{port}", p


# ------------------------------------------------------------------ load
def lua_script(tmp: Path, name: str, body: str) -> Path:
    p = tmp / f"{name}.lua"
    p.write_text(f"""wrk.method = "POST"
wrk.body = {json.dumps(body)}
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {KEY}"
""")
    return p


def _dur(v: str, unit: str) -> float:
    return float(v) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]


def wrk(url: str, script: Path, *, conns: int, seconds: float, cpu: int | None) -> dict[str, Any]:
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script),
           url + "/v1/chat/completions"]
    out = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=_pin(cpu), timeout=seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr[-2000:]}")
    text = out.stdout
    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", text)
    if m is None:
        raise RuntimeError(f"cannot read wrk's output:\n{text}")
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)

    def pct(p: str) -> float:
        mm = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.M)
        return _dur(*mm.groups()) * 1e3 if mm else float("nan")

    requests = int(m.group(1))
    wall = _dur(m.group(2), m.group(3))
    return {"requests": requests, "wall_s": wall, "rps": requests / wall, "non_2xx": int(bad.group(1)) if bad else 0,
            "socket_errors": sum(int(x) for x in errs.groups()) if errs else 0, "p50_ms": pct("50"),
            "p99_ms": pct("99")}


def openloop(url: str, *, rate: float, seconds: float, cpu: int | None, warmup: float = 0.5) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "openloop.py"), url + "/v1/chat/completions", "--rate", f"{rate:g}",
           "--seconds", f"{seconds:g}", "--warmup", f"{warmup:g}", "--body", CHAT_BODY, "--key", KEY]
    out = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=_pin(cpu), timeout=seconds + warmup + 90)
    if out.returncode != 0:
        raise RuntimeError(f"openloop failed ({out.returncode}): {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@contextmanager
def measured(proc: Proc | None, core: int | None) -> Iterator[dict[str, float]]:
    """The CPU the process used, and what the rest of the machine used of its core, meanwhile."""
    out: dict[str, float] = {}
    c0 = proc.cpu_seconds() if proc is not None else 0.0
    r0 = proc.run_seconds() if proc is not None else 0.0
    b0 = core_busy(core)
    t0 = time.monotonic()
    yield out
    out["cpu_s"] = (proc.cpu_seconds() - c0) if proc is not None else 0.0
    out["schedstat_cpu_s"] = (proc.run_seconds() - r0) if proc is not None else 0.0
    out["wall_s"] = time.monotonic() - t0
    out["other_on_core"] = (core_busy(core) - b0 - out["cpu_s"]) / out["wall_s"]


@contextmanager
def scraping(url: str | None, every: float) -> Iterator[dict[str, float]]:
    """``GET url/metrics`` every ``every`` seconds in a thread meanwhile (nothing when ``url``
    is ``None``); says how many scrapes and how many bytes the last one was."""
    import threading

    out: dict[str, float] = {}
    if url is None:
        yield out
        return
    stop = threading.Event()

    def loop() -> None:
        n = 0
        while not stop.wait(every):
            with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
                out["scrape_bytes"] = len(r.read())
            n += 1
            out["scrapes"] = n

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join(60)


def check(proxy: Proxy) -> None:
    """One plain request and one stream through ``proxy``: the reply and all 50 events come back."""
    def post(url: str, body: str) -> bytes:
        req = urllib.request.Request(url + "/v1/chat/completions", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return bytes(r.read())

    reply = json.loads(post(proxy.plain_url, CHAT_BODY))
    if reply.get("usage", {}).get("completion_tokens") != 9:
        raise RuntimeError(f"{proxy.name}: unexpected reply {reply!r}")
    raw = post(proxy.stream_url, STREAM_BODY)
    events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    if len(events) != EVENTS + 1 or events[-1] != b"data: [DONE]":
        raise RuntimeError(f"{proxy.name}: {len(events)} events in the stream, expected {EVENTS} and [DONE]: "
                           f"{raw[:300]!r} ... {raw[-300:]!r}")


# ------------------------------------------------------------------ the run
def run(a: argparse.Namespace) -> dict[str, Any]:
    proxy_cpu, load_cpu = cpu_plan()
    res: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "quick": a.quick, "cpus": cpus(),
        "proxy_cpu": proxy_cpu, "load_cpu": load_cpu, "python": sys.version.split()[0],
        "cpu_model": _cpu_model(), "uptime_before": uptime(),
        "options": {"blocks": sorted(a.blocks), "rounds": a.rounds, "seconds": a.seconds, "conns": a.conns,
                    "stream_conns": a.stream_conns,
                    "rate": a.rate, "latency_seconds": a.latency_seconds, "event_gap_ms": a.event_gap_ms},
    }
    try:
        import uvloop
        res["uvloop"] = uvloop.__version__
    except ImportError:
        res["uvloop"] = None
    wanted = [p.strip() for p in a.proxies.split(",") if p.strip()]
    module = echo_module()
    res["stream_pacing"] = (f"one event per write, {a.event_gap_ms:g} ms apart (nginx echo module)" if module
                            else "all 50 events in one write (nginx's echo module is not installed)")
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as d, ExitStack() as stack:
        tmp = Path(d)
        up_json, up_sse = free_port(), free_port()
        stack.callback(_nginx(tmp, "upstream", upstream_http(up_json, up_sse, a.event_gap_ms, module is not None),
                              [up_json, up_sse], load_cpu, module).stop)
        upj, ups = f"http://127.0.0.1:{up_json}", f"http://127.0.0.1:{up_sse}"
        direct = Proxy("direct", (upj, None), (ups, None), "the upstream itself")  # type: ignore[arg-type]
        proxies: list[Proxy] = []
        for name in wanted:
            if name == "nginx":
                pj, ps = free_port(), free_port()
                p = _nginx(tmp, "proxy", proxy_http(pj, ps, up_json, up_sse), [pj, ps], proxy_cpu)
                stack.callback(p.stop)
                proxies.append(Proxy("nginx", (f"http://127.0.0.1:{pj}", p), (f"http://127.0.0.1:{ps}", p),
                                     "nginx proxy_pass"))
            elif name == "bare":
                plain = start_bare("bare-plain", upj, proxy_cpu)
                stack.callback(plain[1].stop)
                stream = start_bare("bare-stream", ups, proxy_cpu)
                stack.callback(stream[1].stop)
                proxies.append(Proxy("bare", plain, stream, "bare aiohttp proxy"
                                     + (" (uvloop)" if res["uvloop"] else "")))
            elif name == "sfq":
                for label, path in a.sfq or [("", sfq_pythonpath())]:
                    pname = f"sfq-{label}" if label else "sfq"
                    plain = start_sfq(tmp, pname + "-plain", path, upj, proxy_cpu)
                    stack.callback(plain[1].stop)
                    stream = start_sfq(tmp, pname + "-stream", path, ups, proxy_cpu)
                    stack.callback(stream[1].stop)
                    what = f"sfq serve, one org, defaults ({label or 'this checkout'})"
                    proxies.append(Proxy(pname, plain, stream, what))
                    res.setdefault("sfq_checkouts", {})[pname] = path
            else:
                raise SystemExit(f"unknown proxy {name!r}; proxies: nginx, bare, sfq")
        for p in [direct, *proxies]:
            check(p)
        plain_lua = lua_script(tmp, "plain", CHAT_BODY)
        stream_lua = lua_script(tmp, "stream", STREAM_BODY)
        warm = 1.0
        for p in proxies:  # warm-up: allocators, caches, connection pools
            wrk(p.plain_url, plain_lua, conns=a.conns, seconds=warm, cpu=load_cpu)
            if "stream" in a.blocks:
                wrk(p.stream_url, stream_lua, conns=a.stream_conns, seconds=warm, cpu=load_cpu)
        rounds: list[dict[str, Any]] = []
        for r in range(a.rounds):
            rd: dict[str, Any] = {"plain": {}, "stream": {}, "latency": {}}
            for p in proxies if "rate" in a.blocks else ():
                with scraping(p.plain_url if p.name in a.scraped else None, a.scrape_every) as scrapes, \
                        measured(p.plain_proc, proxy_cpu) as m:
                    w = wrk(p.plain_url, plain_lua, conns=a.conns, seconds=a.seconds, cpu=load_cpu)
                w.update(scrapes)
                w.update(m)
                w["cpu_ms_per_request"] = m["cpu_s"] / max(1, w["requests"]) * 1e3
                rd["plain"][p.name] = w
            for p in proxies if "stream" in a.blocks else ():
                with scraping(p.stream_url if p.name in a.scraped else None, a.scrape_every) as scrapes, \
                        measured(p.stream_proc, proxy_cpu) as m:
                    w = wrk(p.stream_url, stream_lua, conns=a.stream_conns, seconds=a.seconds, cpu=load_cpu)
                w.update(scrapes)
                w.update(m)
                w["events"] = w["requests"] * EVENTS
                w["cpu_us_per_chunk"] = m["cpu_s"] / max(1, w["events"]) * 1e6
                w["cpu_ms_per_stream"] = m["cpu_s"] / max(1, w["requests"]) * 1e3
                rd["stream"][p.name] = w
            if "latency" in a.blocks:
                with measured(None, proxy_cpu) as m:
                    base = openloop(upj, rate=a.rate, seconds=a.latency_seconds, cpu=load_cpu)
                base.update(m)
                rd["latency"]["direct"] = base
            for p in proxies if "latency" in a.blocks else ():
                with measured(p.plain_proc, proxy_cpu) as m:
                    ol = openloop(p.plain_url, rate=a.rate, seconds=a.latency_seconds, cpu=load_cpu)
                ol.update(m)
                ol["cpu_ms_per_request"] = m["cpu_s"] / max(1, ol["sent"]) * 1e3  # warm-up included
                ol["added_p50_ms"] = ol["p50_ms"] - base["p50_ms"]
                ol["added_p99_ms"] = ol["p99_ms"] - base["p99_ms"]
                rd["latency"][p.name] = ol
            rounds.append(rd)
            print(f"round {r + 1}/{a.rounds}: " + "; ".join(_brief(rd, p.name) for p in proxies), file=sys.stderr,
                  flush=True)
        res["rounds"] = rounds
        res["proxies"] = {p.name: p.what for p in proxies}
    res["uptime_after"] = uptime()
    res["summary"] = summarise(res)
    return res


def _brief(rd: dict[str, Any], name: str) -> str:
    out = [name]
    if name in rd["plain"]:
        out.append(f"{rd['plain'][name]['rps']:.0f} req/s {rd['plain'][name]['cpu_ms_per_request']:.3f} ms/req")
    if name in rd["stream"]:
        out.append(f"{rd['stream'][name]['cpu_us_per_chunk']:.1f} us/chunk")
    if name in rd["latency"]:
        out.append(f"{rd['latency'][name]['added_p50_ms']:+.2f}/{rd['latency'][name]['added_p99_ms']:+.2f} ms")
    return " ".join(out)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


METRICS = (("plain", "rps"), ("plain", "cpu_ms_per_request"), ("plain", "other_on_core"),
           ("stream", "cpu_us_per_chunk"), ("stream", "cpu_ms_per_stream"), ("stream", "other_on_core"),
           ("latency", "added_p50_ms"), ("latency", "added_p99_ms"), ("latency", "p50_ms"), ("latency", "p99_ms"),
           ("latency", "cpu_ms_per_request"), ("latency", "errors"))


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    """Per proxy and figure: median, min and max over the rounds."""
    out: dict[str, Any] = {}
    names = list(res["proxies"]) + ["direct"]
    for name in names:
        s: dict[str, Any] = {}
        for block, key in METRICS:
            xs = [rd[block][name][key] for rd in res["rounds"] if name in rd[block] and key in rd[block][name]]
            if xs:
                s[f"{block}.{key}"] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        out[name] = s
    return out


def table(res: dict[str, Any]) -> str:
    s = res["summary"]
    bare = s.get("bare")
    n = len(res["rounds"])

    def f(name: str, key: str, fmt: str, unit: str = "", ratio: bool = False) -> str:
        v = s[name].get(key)
        if v is None:
            return "-"
        text = f"{fmt.format(v['median'])}{unit} ({fmt.format(v['min'])}-{fmt.format(v['max'])})"
        if ratio and bare is not None and name != "bare" and key in bare and bare[key]["median"] > 0:
            text += f", **{v['median'] / bare[key]['median']:.2f}x** bare"
        return text

    rows = ["| proxy | req/s on one core | CPU per request | CPU per streamed chunk | CPU per 50-event stream "
            f"| added p50 / p99 at {res['options']['rate']:g} req/s | CPU per request at that rate |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for name, what in res["proxies"].items():
        lat = s[name]
        p50, p99 = lat.get("latency.added_p50_ms"), lat.get("latency.added_p99_ms")
        added = (f"{p50['median']:+.2f} / {p99['median']:+.2f} ms (p99 {p99['min']:+.1f} to {p99['max']:+.1f})"
                 if p50 and p99 else "-")
        rows.append(f"| {what} | {f(name, 'plain.rps', '{:,.0f}')} | "
                    f"{f(name, 'plain.cpu_ms_per_request', '{:.3f}', ' ms', True)} | "
                    f"{f(name, 'stream.cpu_us_per_chunk', '{:.1f}', ' µs', True)} | "
                    f"{f(name, 'stream.cpu_ms_per_stream', '{:.2f}', ' ms')} | {added} | "
                    f"{f(name, 'latency.cpu_ms_per_request', '{:.3f}', ' ms', True)} |")
    d = s["direct"]
    if "latency.p50_ms" in d:
        rows.append(f"| (the upstream alone, the latency's baseline) | | | | | "
                    f"p50 {d['latency.p50_ms']['median']:.2f} / p99 {d['latency.p99_ms']['median']:.2f} ms | |")
    other = [rd[b][p]["other_on_core"] for rd in res["rounds"] for b in ("plain", "stream") for p in rd[b]]
    note = (f"\nMedians of {n} interleaved round{'s' if n != 1 else ''} (min-max in brackets); "
            f"{res['cpu_model']}, Python {res['python']}, uvloop {res['uvloop']}; proxy on CPU {res['proxy_cpu']}, "
            f"upstream and load on CPU {res['load_cpu']}; streams: {res['stream_pacing']}. Other processes used "
            f"{statistics.median(other) if other else float('nan'):.0%} (median; max "
            f"{max(other) if other else float('nan'):.0%}) of the proxy's core during the rate and stream runs. "
            f"Load before: {res['uptime_before'].split('load average:')[-1].strip()}; after: "
            f"{res['uptime_after'].split('load average:')[-1].strip()}.")
    return "\n".join(rows) + "\n" + note + paired(res)


def paired(res: dict[str, Any]) -> str:
    """With several ``--sfq`` checkouts: each one against the one before it, round by round
    (the ratio of the same figure measured seconds apart cancels most of a shared machine's
    drift): the median of the per-round ratios, and their min-max."""
    names = [n for n in res["proxies"] if n.startswith("sfq-")]
    if len(names) < 2:
        return ""
    rows = ["\n\nPaired, each checkout against the one before it (median of the per-round ratios, min-max):\n",
            "| checkout | against | CPU per request | CPU per streamed chunk | req/s |",
            "| --- | --- | ---: | ---: | ---: |"]
    for ref, name in zip(names, names[1:]):
        cells = []
        for block, key in (("plain", "cpu_ms_per_request"), ("stream", "cpu_us_per_chunk"), ("plain", "rps")):
            xs = [rd[block][name][key] / rd[block][ref][key] for rd in res["rounds"]
                  if name in rd[block] and ref in rd[block] and rd[block][ref][key] > 0]
            cells.append(f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})" if xs else "-")
        rows.append(f"| {name} | {ref} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="sfq serve next to nginx and a bare aiohttp proxy (module docstring).")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds of each wrk run (4)")
    ap.add_argument("--conns", type=int, default=64, help="wrk connections for the rate runs (64)")
    ap.add_argument("--stream-conns", type=int, default=16, help="wrk connections for the stream runs (16)")
    ap.add_argument("--rate", type=float, default=1000.0, help="requests/s of the latency runs (1000)")
    ap.add_argument("--latency-seconds", type=float, default=4.0, help="seconds of each latency run (4)")
    ap.add_argument("--event-gap-ms", type=float, default=1.0, help="ms between the upstream's stream events (1)")
    ap.add_argument("--proxies", default="nginx,bare,sfq", help="comma-separated: nginx, bare, sfq")
    ap.add_argument("--blocks", default="rate,stream,latency", help="comma-separated: rate, stream, latency")
    ap.add_argument("--sfq", action="append", type=_sfq_spec, metavar="NAME=DIR",
                    help="run sfq serve from checkout DIR as proxy sfq-NAME (repeatable; default: this one)")
    ap.add_argument("--scraped", action="append", default=[], metavar="PROXY",
                    help="scrape this proxy's /metrics while it is measured (repeatable; e.g. sfq-scraped)")
    ap.add_argument("--scrape-every", type=float, default=1.0, help="seconds between two scrapes (1)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 1 s (numbers not for quoting)")
    ap.add_argument("--out", default=str(HERE / "results" / "proxy.json"), help="the JSON (and .md next to it)")
    a = ap.parse_args(argv)
    a.blocks = {b.strip() for b in a.blocks.split(",") if b.strip()}
    if not a.blocks or a.blocks - {"rate", "stream", "latency"}:
        ap.error(f"--blocks: choose from rate, stream, latency, got {sorted(a.blocks)}")
    if a.quick:
        a.rounds, a.seconds, a.latency_seconds, a.rate = 1, 1.0, 1.0, 200.0
    if not a.scrape_every > 0:
        ap.error(f"--scrape-every must be > 0 seconds, got {a.scrape_every!r}")
    if a.rounds < 1 or not a.seconds > 0 or not a.latency_seconds > 0 or not a.rate > 0 or a.conns < 1 \
            or a.stream_conns < 1 or a.event_gap_ms < 0:
        ap.error("--rounds, --conns and --stream-conns must be >= 1; --seconds, --latency-seconds and --rate > 0; "
                 "--event-gap-ms >= 0")
    return a


def _sfq_spec(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not (Path(path) / "sfq").is_dir():
        raise argparse.ArgumentTypeError(f"expected NAME=DIR with DIR/sfq a package directory, got {text!r}")
    return name, str(Path(path).resolve())


def missing_tools() -> list[str]:
    return [t for t, ok in (("nginx", nginx_binary() is not None), ("wrk", shutil.which("wrk") is not None)) if not ok]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    missing = missing_tools()
    if missing:
        raise SystemExit(f"bench_proxy needs {' and '.join(missing)} "
                         "(apt-get install nginx libnginx-mod-http-echo wrk)")
    res = run(a)
    text = table(res)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return res


def test_bench_proxy_smoke(tmp_path: Path) -> None:
    """CI's smoke run: one quick round of every proxy (nothing timed); skips without nginx or wrk."""
    import pytest

    missing = missing_tools()
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (apt-get install nginx libnginx-mod-http-echo wrk)")
    res = main(["--quick", "--out", str(tmp_path / "proxy.json")])
    rd = res["rounds"][0]
    for name in ("nginx", "bare", "sfq"):
        assert rd["plain"][name]["requests"] > 0 and rd["plain"][name]["non_2xx"] == 0
        assert rd["stream"][name]["requests"] > 0 and rd["stream"][name]["non_2xx"] == 0
        assert rd["latency"][name]["ok"] > 0
    assert (tmp_path / "proxy.md").read_text().startswith("| proxy |")


if __name__ == "__main__":
    main()
