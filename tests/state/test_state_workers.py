"""``sfq serve --workers 2`` as a real process tree on one port, its policy's ledger in a real
redis-server: connections reach both workers (each its own gateway in Redis), a pool's
``max_in_flight`` holds over both (counted at the upstream), SIGHUP reloads every worker,
SIGTERM (or SIGINT) drains every worker and the parent exits 0, a SIGKILLed worker is replaced
while the port goes on answering, the workers stop when the parent is SIGKILLed, a worker that
cannot start stops the parent, and the access log gets whole lines from both workers (a file,
and a pipe on stdout)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from state_helpers import LIMIT, Gateway, RedisServer, Upstream, policy_yaml, wait_until

NEW_ORG = "  team-c:\n    keys: [\"sk-c\"]\n    classes: [batch]\n    weight: 2\n"


def _workers(p: Path, n: int = 2, access_log: str = "off") -> Gateway:
    """``sfq serve --workers n``, returned once every worker listens (the parent says so)."""
    g = Gateway(p, wait=False, extra=("--access-log", access_log, "--workers", str(n)))
    return _listening(g, n)


def _listening(g: Gateway, n: int) -> Gateway:
    wait_until(lambda: _pids(g) or g.proc.poll() is not None, "every worker to listen")
    g.listen()
    assert len(_pids(g)) == n
    return g


def _pids(g: Gateway) -> list[int]:
    """The workers' pids, as the parent named them when every one listened."""
    for line in g.err:
        m = re.search(r"workers listening on \S+ \(pids ([\d, ]+);", line)
        if m:
            return [int(x) for x in m.group(1).split(", ")]
    return []


def _started(g: Gateway) -> list[int]:
    """Every worker pid the parent started, in order."""
    return [int(m.group(1)) for x in g.err for m in [re.search(r"worker \d+ started \(pid (\d+)\)", x)] if m]


def _port(g: Gateway) -> int:
    return int(g.url.rsplit(":", 1)[1])


def _conn(g: Gateway) -> http.client.HTTPConnection:
    """A new connection: the kernel gives it to whichever worker accepts first."""
    return http.client.HTTPConnection("127.0.0.1", _port(g), timeout=LIMIT)


def _get(c: http.client.HTTPConnection, path: str) -> tuple[int, dict[str, Any]]:
    c.request("GET", path)
    r = c.getresponse()
    return r.status, json.loads(r.read())


def _post(c: http.client.HTTPConnection, key: str, prompt: str) -> tuple[int, str]:
    c.request("POST", "/v1/completions", body=json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}),
              headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    return r.status, r.getheader("x-request-id") or ""


def _gateway_of(c: http.client.HTTPConnection) -> str:
    """The gateway id in Redis of the worker holding this connection (its ``/health``)."""
    code, body = _get(c, "/health")
    assert code == 200, body
    return str(body["state"]["gateway"])


def _gateway_ids(g: Gateway, want: int, also: Any = None) -> set[str]:
    """Gateway ids seen over new connections until ``want`` differ (or ``also(ids)`` holds)."""
    ids: set[str] = set()

    def more() -> bool:
        c = _conn(g)
        try:
            ids.add(_gateway_of(c))
        finally:
            c.close()
        return len(ids) >= want and (also is None or also(ids))

    wait_until(more, f"{want} workers to answer on the port")
    return ids


def _connect_refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def test_two_workers_answer_on_one_port_and_keep_one_pool_limit(redis_server: RedisServer, tmp_path: Path,
                                                                 prefix: str, gateways: list[Gateway]):
    up = Upstream(delay=0.0).start()
    try:
        p = tmp_path / "p.yaml"
        p.write_text(policy_yaml(up.url, redis_server.url, pool_limit=2, prefix=prefix))
        g = _workers(p)
        gateways.append(g)
        assert len(_gateway_ids(g, 2)) == 2  # two gateways in Redis behind one port
        up.hold = True
        views: dict[str, int] = {}  # gateway id -> its requests (waiting, or holding a slot), as last seen
        statuses: list[int] = []
        threads: list[threading.Thread] = []

        def send(i: int) -> None:
            c = _conn(g)
            try:
                statuses.append(_post(c, ("sk-a", "sk-b")[i % 2], f"held {i}")[0])
            finally:
                c.close()

        def seen_all() -> bool:
            c = _conn(g)
            try:
                code, body = _get(c, "/health")
            finally:
                c.close()
            views[body["state"]["gateway"]] = body["pools"]["main"]["waiting"] + body["state"]["holding"]
            return sum(views.values()) >= len(threads)

        # one request at a time on a new connection, until both workers hold some
        while sum(1 for v in views.values() if v) < 2 and len(threads) < 40:
            threads.append(threading.Thread(target=send, args=(len(threads),)))
            threads[-1].start()
            wait_until(seen_all, f"request {len(threads)} to reach a worker")
        assert sum(1 for v in views.values() if v) == 2, views
        wait_until(lambda: up.now == 2, "the pool's two slots to be taken")
        assert up.peak == 2, f"the upstream saw {up.peak} at once; the pool's limit is 2 for both workers"
        up.release()
        for t in threads:
            t.join(LIMIT * 2)
        assert statuses == [200] * len(threads)
        assert up.peak == 2
    finally:
        up.release()
        up.stop()


def test_sighup_reloads_every_worker(redis_server: RedisServer, upstream: Upstream, tmp_path: Path, prefix: str,
                                     gateways: list[Gateway]):
    p = tmp_path / "p.yaml"
    p.write_text(policy_yaml(upstream.url, redis_server.url, prefix=prefix))
    g = _workers(p)
    gateways.append(g)
    c = _conn(g)
    assert _post(c, "sk-c", "before")[0] == 401  # no such key yet
    c.close()
    p.write_text(policy_yaml(upstream.url, redis_server.url, prefix=prefix, orgs_extra=NEW_ORG))
    g.proc.send_signal(signal.SIGHUP)
    pids = set(_pids(g))
    wait_until(lambda: {int(m.group(1)) for x in g.err for m in [re.search(r"sfq\.serve\[(\d+)\] INFO reloaded", x)]
                        if m} == pids, "both workers to reload")
    # on each worker: the new org's key is taken and /stats shows its weight
    checked: set[str] = set()

    def check_one() -> bool:
        c = _conn(g)
        try:
            gid = _gateway_of(c)
            assert _post(c, "sk-c", "after")[0] == 200
            code, stats = _get(c, "/stats")
            assert code == 200 and stats["pools"]["main"]["orgs"]["team-c"]["weight"] == 2.0, stats
            checked.add(gid)
        finally:
            c.close()
        return len(checked) == 2

    wait_until(check_one, "both workers to serve the reloaded policy")
    assert g.proc.poll() is None and set(_started(g)) == pids  # nothing restarted


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_drains_every_worker_and_the_parent_exits_0(redis_server: RedisServer, tmp_path: Path,
                                                            prefix: str, gateways: list[Gateway], sig: int):
    up = Upstream(delay=0.0).start()
    try:
        p = tmp_path / "p.yaml"
        p.write_text(policy_yaml(up.url, redis_server.url, prefix=prefix))
        g = Gateway(p, wait=False, grace=LIMIT, extra=("--access-log", "off", "--workers", "2"))
        gateways.append(g)
        _listening(g, 2)
        pids = _pids(g)
        up.hold = True
        out: list[int] = []
        c = _conn(g)
        t = threading.Thread(target=lambda: out.append(_post(c, "sk-a", "held")[0]))
        t.start()
        wait_until(lambda: up.now == 1, "the request to run")
        g.proc.send_signal(sig)
        wait_until(lambda: _connect_refused(_port(g)), "the port to refuse new connections")
        assert g.proc.poll() is None  # a worker still finishes its running request
        up.release()
        t.join(LIMIT)
        assert out == [200]
        assert g.proc.wait(LIMIT) == 0
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert sum("exited with status 0" in x for x in g.err) == 2, "".join(g.err)
    finally:
        up.release()
        up.stop()


def test_a_killed_worker_is_replaced_and_the_port_keeps_answering(redis_server: RedisServer, upstream: Upstream,
                                                                  tmp_path: Path, prefix: str,
                                                                  gateways: list[Gateway]):
    p = tmp_path / "p.yaml"
    p.write_text(policy_yaml(upstream.url, redis_server.url, prefix=prefix))
    g = _workers(p)
    gateways.append(g)
    before = _gateway_ids(g, 2)
    pids = _pids(g)
    os.kill(pids[0], signal.SIGKILL)
    wait_until(lambda: any(f"(pid {pids[0]}) was killed by SIGKILL" in x and "starting another" in x for x in g.err),
               "the parent to see the worker die")
    statuses: list[int] = []

    def replaced() -> bool:
        statuses.append(g.health()[0])  # the other worker answers meanwhile
        return len(_started(g)) == 3

    wait_until(replaced, "a new worker to start")
    assert set(statuses) == {200}
    new = _started(g)[-1]
    assert new not in pids
    # the new worker answers on the port, as a new gateway in Redis
    after = _gateway_ids(g, 2, also=lambda ids: bool(ids - before))
    assert len(after - before) == 1
    assert g.stop() == 0


def _gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie its new parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_workers_stop_when_the_parent_is_killed(redis_server: RedisServer, upstream: Upstream, tmp_path: Path,
                                                    prefix: str, gateways: list[Gateway]):
    p = tmp_path / "p.yaml"
    p.write_text(policy_yaml(upstream.url, redis_server.url, prefix=prefix))
    g = _workers(p)
    gateways.append(g)
    pids = _pids(g)
    g.kill()  # SIGKILL: nothing of the parent's runs
    wait_until(lambda: all(_gone(pid) for pid in pids), "the orphaned workers to stop")
    wait_until(lambda: _connect_refused(_port(g)), "the port to be free")


def test_a_worker_that_cannot_start_stops_the_parent(redis_server: RedisServer, upstream: Upstream, tmp_path: Path,
                                                     prefix: str, gateways: list[Gateway]):
    p1, p2 = tmp_path / "p1.yaml", tmp_path / "p2.yaml"
    p1.write_text(policy_yaml(upstream.url, redis_server.url, pool_limit=4, prefix=prefix))
    p2.write_text(policy_yaml(upstream.url, redis_server.url, pool_limit=5, prefix=prefix))
    gateways.append(Gateway(p1))
    g = Gateway(p2, wait=False, extra=("--access-log", "off", "--workers", "2"))
    gateways.append(g)
    assert g.proc.wait(LIMIT) == 1
    wait_until(lambda: any("different policy" in x for x in g.err) and any("failed to start" in x for x in g.err),
               "the reason on stderr")


class _Piped(Gateway):
    """``sfq serve --workers 2`` with the access log on stdout, a pipe this test reads."""

    def __init__(self, config: Path) -> None:
        cmd = [sys.executable, "-m", "sfq", "serve", "--config", str(config), "--port", "0", "--grace", "2",
               "--workers", "2"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.err: list[str] = []
        self.out = bytearray()
        threading.Thread(target=self._read, daemon=True).start()
        self.reader = threading.Thread(target=self._read_out, daemon=True)
        self.reader.start()
        self.url = ""
        _listening(self, 2)

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for chunk in iter(lambda: self.proc.stdout.read1(1 << 16), b""):  # type: ignore[union-attr]
            self.out += chunk


@pytest.mark.parametrize("to", ["file", "stdout"])
def test_both_workers_write_whole_access_lines(redis_server: RedisServer, upstream: Upstream, tmp_path: Path,
                                               prefix: str, gateways: list[Gateway], to: str):
    p = tmp_path / "p.yaml"
    p.write_text(policy_yaml(upstream.url, redis_server.url, pool_limit=64, prefix=prefix))
    log_file = tmp_path / "access.log"
    g = _workers(p, access_log=str(log_file)) if to == "file" else _Piped(p)
    gateways.append(g)
    n, per = 16, 8  # 16 clients, 8 requests each, each on a new connection
    statuses: list[int] = []
    ids: list[str] = []

    def client(i: int) -> None:
        for j in range(per):
            c = _conn(g)
            try:
                code, rid = _post(c, ("sk-a", "sk-b")[i % 2], f"{'xy' * 300} {i} {j}")
            finally:
                c.close()
            statuses.append(code)
            ids.append(rid)

    ts = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(LIMIT * 2)
    assert statuses == [200] * (n * per)
    assert g.stop() == 0  # every worker flushed its lines
    if isinstance(g, _Piped):
        g.reader.join(LIMIT)  # to the pipe's end (every worker gone)
    data = log_file.read_bytes() if to == "file" else bytes(g.out) if isinstance(g, _Piped) else b""
    lines = data.split(b"\n")
    assert lines[-1] == b""
    parsed = [json.loads(x) for x in lines[:-1]]  # every line whole: one JSON object each
    assert sorted(x["request_id"] for x in parsed) == sorted(ids)
    assert len({rid[:16] for rid in ids}) == 2  # from both workers (each its own request-id prefix)
