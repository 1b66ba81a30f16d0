"""What one request costs ``sfq serve`` in observability: its access-log line and its metric
events, measured alone (no HTTP, no backend), so a change to either shows without the noise
of a whole request.

Groups (divide a round by ``extra_info["requests"]``):

observe-access-file    ``Gateway._log`` of one completed request's entry, access log to a file
                       (``configure_logging(PATH)``), one request per event-loop iteration
                       (what a lightly loaded gateway does: each line is written on its own);
                       against ``observe-loop``, the same loop with no line (subtract it).
observe-access-burst   the same, 64 lines per loop iteration (a loaded gateway: the lines of
                       one iteration are written together).
observe-access-off     the same with ``--access-log off``.
observe-metrics        one request's events on ``PolicyMetrics``: ``queued``, ``started``,
                       ``attempt_ended``, ``ended`` (a completed request, one flow).
observe-scrape         ``generate_latest`` of a registry with 100 flows that each served
                       requests (what one ``GET /metrics`` costs; ``extra_info["requests"]`` is 1).

Run: ``PYTHONPATH=python python -m pytest benchmarks/bench_observe.py --benchmark-only``, or
``PYTHONPATH=DIR python benchmarks/bench_observe.py`` for a table of microseconds per request
(timeit, best of 7) to compare two checkouts (``DIR``: a checkout's ``python/``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
import timeit
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest

from sfq.policy import parse_policy
from sfq.policy.metrics import PolicyMetrics
from sfq.serve import Gateway, configure_logging
from sfq.serve.app import _Entry

N = 2_000
BURST = 64
KEY = ("acme", "interactive", "main")
_POLICY = """
pools:
  main: {models: [m], backends: [{url: "http://127.0.0.1:9", name: b}]}
classes: {interactive: {}}
orgs: {acme: {keys: [k], classes: [interactive]}}
"""


def _entry() -> _Entry:
    """A completed chat completion's entry, as ``_serve`` leaves it."""
    e = _Entry(1000.0, "/v1/chat/completions", "0123456789abcdef0123456789abcdef")
    e.flow = KEY
    e.model = "m"
    e.status = 200
    e.usage = {"prompt_tokens": 21, "completion_tokens": 128, "total_tokens": 149}
    e.r = SimpleNamespace(flow=KEY, outcome="completed", reason=None, tries=1, cost=149.0, charged_total=149.0,
                          backend="b", started_at=1000.0012, arrival=1000.0)  # type: ignore[assignment]
    e.counted = True
    return e


def _gateway(access_log: str) -> Gateway:
    configure_logging(access_log, stream=sys.stderr)
    return Gateway(parse_policy(_POLICY))


def _lines(gw: Gateway, n: int, per_iteration: int, log: bool = True) -> None:
    """``n`` access-log lines, ``per_iteration`` per event-loop iteration, in a fresh loop."""
    e = _entry()

    async def run() -> None:
        for _ in range(n // per_iteration):
            if log:
                for _ in range(per_iteration):
                    gw._log(e, 1000.05)
            await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(run())


def _request_events(m: PolicyMetrics, n: int) -> None:
    for _ in range(n):
        m.queued(KEY)
        m.started(KEY, 0.003, 149.0, False)
        m.attempt_ended(KEY, served_cost=149.0)
        m.ended(KEY, "completed")


def _scrape_registry() -> PolicyMetrics:
    flows = [(f"org{i}", "interactive", "main") for i in range(100)]
    m = PolicyMetrics(flows=flows)
    for k in flows:
        m.queued(k, 2)
        m.started(k, 0.02, 100.0, False)
        m.started(k, 0.2, 100.0, True)
        m.attempt_ended(k, served_cost=80.0)
        m.ended(k, "completed")
        m.ended(k, "refused", "rate_limited")
    return m


@pytest.fixture
def log_file(tmp_path: Path) -> Any:
    yield str(tmp_path / "access.log")
    configure_logging("off", stream=sys.stderr)
    logging.getLogger("sfq").handlers[:] = []


@pytest.mark.benchmark(group="observe-loop")
def test_loop_alone(benchmark: Any, log_file: str) -> None:
    gw = _gateway(log_file)
    benchmark.extra_info["requests"] = N
    benchmark.pedantic(_lines, args=(gw, N, 1, False), rounds=10, warmup_rounds=1)


@pytest.mark.benchmark(group="observe-access-file")
def test_access_line_file(benchmark: Any, log_file: str) -> None:
    gw = _gateway(log_file)
    benchmark.extra_info["requests"] = N
    benchmark.pedantic(_lines, args=(gw, N, 1), rounds=10, warmup_rounds=1)


@pytest.mark.benchmark(group="observe-access-burst")
def test_access_line_burst(benchmark: Any, log_file: str) -> None:
    gw = _gateway(log_file)
    benchmark.extra_info["requests"] = N * 4
    benchmark.pedantic(_lines, args=(gw, N * 4, BURST), rounds=10, warmup_rounds=1)


@pytest.mark.benchmark(group="observe-access-off")
def test_access_line_off(benchmark: Any, log_file: str) -> None:
    gw = _gateway("off")
    benchmark.extra_info["requests"] = N
    benchmark.pedantic(_lines, args=(gw, N, 1), rounds=10, warmup_rounds=1)


@pytest.mark.benchmark(group="observe-metrics")
def test_metric_events(benchmark: Any) -> None:
    m = PolicyMetrics(flows=[KEY])
    benchmark.extra_info["requests"] = N
    benchmark(_request_events, m, N)


@pytest.mark.benchmark(group="observe-scrape")
def test_scrape(benchmark: Any) -> None:
    m = _scrape_registry()
    benchmark.extra_info["requests"] = 1
    benchmark(generate_latest, m.registry)


def _best(fn: Any, n: int) -> float:
    """Microseconds per unit of the best of 7 runs of ``fn`` (which does ``n`` units)."""
    return min(timeit.repeat(fn, number=1, repeat=7)) / n * 1e6


def main() -> None:
    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-observe-") as d:
        path = str(Path(d) / "access.log")
        gw = _gateway(path)
        base = _best(lambda: _lines(gw, N, 1, False), N)
        rows.append(("access line to a file, one per loop iteration (loop subtracted)",
                     _best(lambda: _lines(gw, N, 1), N) - base))
        base_b = _best(lambda: _lines(gw, N * 4, BURST, False), N * 4)
        rows.append((f"access line to a file, {BURST} per loop iteration (loop subtracted)",
                     _best(lambda: _lines(gw, N * 4, BURST), N * 4) - base_b))
        gw_off = _gateway("off")
        rows.append(("access log off (loop subtracted)", _best(lambda: _lines(gw_off, N, 1), N) - base))
        lines = sum(1 for _ in open(path, "rb"))
    m = PolicyMetrics(flows=[KEY])
    rows.append(("metric events of one request (queued, started, attempt_ended, ended)",
                 _best(lambda: _request_events(m, N), N)))
    sm = _scrape_registry()
    rows.append(("one scrape (generate_latest), 100 flows", _best(lambda: generate_latest(sm.registry), 1)))
    print(f"| what | µs |\n| --- | ---: |")
    for what, us in rows:
        print(f"| {what} | {us:.2f} |")
    print(f"({lines} lines written)", file=sys.stderr)


if __name__ == "__main__":
    main()
