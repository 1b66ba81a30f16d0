"""``sfq top``: its frame from a ``/stats`` document, one frame of a real ``sfq serve`` after a
real load (``--once``), the live view in a terminal (digits and Tab switch pools, ``q``
quits), and the errors: a gateway
that cannot be reached, a server answering something else than ``/stats``' JSON (exit 2, the
URL named).

The load: two orgs of weights 2 and 1 flood one loopback engine (``support.workload``) for a
few seconds through the official ``openai`` client; once it has ended nothing more is served,
so ``/stats`` (window 60 s) holds still and the frame can be compared with it figure by figure.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from support.processes import LIMIT, Gateway, free_port, wait_until
from support.workload import Fleet, OrgLoad, policy_text, start_workload

from sfq.serve.top import StatsError, fetch_stats, render

pytest.importorskip("rich")
pytest.importorskip("openai")

SAMPLE = Path(__file__).with_name("stats_sample.json")
ORGS = [OrgLoad("heavy", "sk-heavy-secret", clients=6, weight=2.0), OrgLoad("light", "sk-light-secret", clients=6)]


def _top(*args: str, timeout: float = LIMIT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sfq", "top", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "160"})


def _frame(stats: dict[str, Any], pool: str | None = None) -> str:
    from rich.console import Console

    console = Console(width=160, record=True, file=open(os.devnull, "w"))
    console.print(render(stats, pool, url="http://gw:8080"))
    return console.export_text()


def _row(frame: str, org: str) -> list[str]:
    line = next(x for x in frame.splitlines() if x.startswith(org + " "))
    return line[len(org):].split()


def test_a_frame_puts_each_orgs_share_next_to_its_promise() -> None:
    stats = json.loads(SAMPLE.read_text())
    frame = _frame(stats, "llama")
    assert "pool llama  Jain 0.970  waiting 12  in flight 8" in frame
    assert "window 60 s" in frame and "http://gw:8080" in frame
    # weight, share, expected, waiting, in flight, oldest wait, p99 wait
    assert _row(frame, "acme") == ["2", "61.0%", "66.0%", "10", "5", "1.20", "s", "900", "ms"]
    # a name is text, not markup (rich's or anyone's); null figures are dashes
    assert _row(frame, "<img src=x onerror=alert(1)>") == ["1", "39.0%", "34.0%", "2", "3", "-", "-"]
    lines = frame.splitlines()
    assert lines.index(next(x for x in lines if x.startswith("acme"))) < lines.index(
        next(x for x in lines if x.startswith("<img"))), "the largest share first"
    assert "[1] llama  [2] mistral" in frame
    # the classes: weight (strict for a strict class), waiting, in flight, deadline misses, the
    # time-to-first-token objective, its attainment over the window, the p99 time to first token,
    # completed, failed, refused; a class without an objective shows none (not 100 %)
    assert "deadline missed" in frame and "objective" in frame and "attainment" in frame
    assert _row(frame, "interactive") == ["6", "2", "5", "0", "2.00", "s", "96.0%", "1.80", "s", "50", "1", "0"]
    assert _row(frame, "batch") == ["1", "10", "3", "7", "-", "-", "12.0", "s", "15", "0", "2"]
    assert _row(frame, "<b>system</b>") == ["strict", "0", "0", "0", "-", "-", "-", "0", "0", "0"]
    other = _frame(stats, "mistral")
    assert "pool mistral  Jain -" in other and _row(other, "beta")[:3] == ["1", "100.0%", "0.0%"]
    assert "pool llama" in _frame(stats, "no-such-pool")  # an unknown pool: the first one


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway after two orgs flooded its pool ``main`` for 3 s (their load over, its figures
    holding still); its pool ``second`` (the same engine, model ``m2``) was not used."""
    fleet = Fleet((1.0,), slots=4, unit=0.002).start()
    try:
        cfg = tmp_path_factory.mktemp("top") / "policy.yaml"
        url = fleet.engines[0].url
        cfg.write_text(policy_text([url], ORGS).replace(
            "pools:\n", f'pools:\n  second:\n    models: [m2]\n    backends:\n      - {{url: "{url}", name: second-e0}}\n', 1))
        gw = Gateway(cfg)
        try:
            res = start_workload(gw.url, ORGS, 3.0, fleet.log).result(LIMIT + 3.0)
            assert all(not e for e in res.errors.values()), res.errors
            yield gw
        finally:
            gw.stop()
    finally:
        fleet.stop()


def test_once_prints_the_gateways_figures(loaded: Gateway) -> None:
    stats = fetch_stats(loaded.url)
    out = _top("--once", "--url", loaded.url)
    assert out.returncode == 0, out.stderr
    pool = stats["pools"]["main"]
    assert set(pool["orgs"]) == {"heavy", "light"}
    for org, o in pool["orgs"].items():
        row = _row(out.stdout, org)
        assert row[:5] == [f"{o['weight']:g}", f"{100 * o['share']:.1f}%", f"{100 * o['expected_share']:.1f}%",
                           "0", "0"], (org, row, o)
    # the heavy org, listed first, got about twice the light one's service, as its weight promises
    assert out.stdout.index("\nheavy ") < out.stdout.index("\nlight ")
    assert abs(pool["orgs"]["heavy"]["share"] - 2 / 3) < 0.1, pool
    # the classes the load used, with their weights, as /stats has them
    assert set(pool["classes"]) == {"batch"} and pool["classes"]["batch"]["weight"] == 1.0
    batch = pool["classes"]["batch"]
    row = _row(out.stdout, "batch")
    assert row[:6] + row[-3:] == ["1", "0", "0", "0", "-", "-", f"{batch['requests']['completed']}", "0", "0"]
    assert batch["attainment"] is None and batch["attainment_requests"] >= batch["requests"]["completed"]
    assert "sk-heavy-secret" not in out.stdout and "sk-light-secret" not in out.stdout


def test_pool_that_does_not_exist_is_refused(loaded: Gateway) -> None:
    out = _top("--once", "--url", loaded.url, "--pool", "nope")
    assert out.returncode == 2
    assert f"{loaded.url}/stats has no pool 'nope' (pools: main, second)" in out.stderr


def test_live_view_in_a_terminal_switches_pools_and_quits_on_q(loaded: Gateway) -> None:
    main, sub = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "sfq", "top", "--url", loaded.url, "--interval", "0.2"],
                            stdin=sub, stdout=sub, stderr=sub, env={**os.environ, "COLUMNS": "160", "TERM": "xterm"})
    os.close(sub)
    seen = bytearray()

    def since(start: int) -> bytes:
        while select.select([main], [], [], 0.05)[0]:
            try:
                seen.extend(os.read(main, 65536))
            except OSError:
                break
        return bytes(seen[start:])

    def press(key: bytes, then: bytes) -> None:
        start = len(since(0))
        os.write(main, key)
        wait_until(lambda: then in since(start), f"sfq top to draw {then!r} after {key!r}")

    try:
        wait_until(lambda: b"pool main" in since(0) and b"heavy" in since(0) and b"light" in since(0),
                   "sfq top to draw pool main and both orgs")
        press(b"\t", b"pool second")  # from the pool shown by default, the next one
        press(b"\t", b"pool main")
        press(b"2", b"pool second")
        press(b"1", b"pool main")
        press(b"n", b"pool second")
        os.write(main, b"q")
        assert proc.wait(LIMIT) == 0, since(0).decode(errors="replace")[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(LIMIT)
        os.close(main)


def test_a_gateway_out_of_reach_is_exit_2_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = _top("--once", "--url", url)
    assert out.returncode == 2
    assert out.stderr.startswith(f"sfq top: error: cannot reach {url}/stats: "), out.stderr
    with pytest.raises(StatsError, match="cannot reach"):
        fetch_stats(url)


class _NotStats(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b"<html>a web page</html>" if self.path == "/stats" else b'{"hello": "json, but not /stats"}'
        self.send_response(200)
        self.send_header("Content-Type", "text/html" if self.path == "/stats" else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_server_that_answers_no_stats_json_is_exit_2_naming_the_url() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotStats)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = _top("--once", "--url", url)
        assert out.returncode == 2
        assert f"sfq top: error: {url}/stats did not answer JSON" in out.stderr, out.stderr
        out = _top("--once", "--url", url + "/other/stats")
        assert out.returncode == 2
        assert f"{url}/other/stats answered JSON without a 'pools' object" in out.stderr, out.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_a_gateway_without_the_route_is_exit_2(loaded: Gateway) -> None:
    out = _top("--once", "--url", loaded.url + "/nowhere")
    assert out.returncode == 2
    assert f"{loaded.url}/nowhere/stats answered HTTP 404" in out.stderr, out.stderr
