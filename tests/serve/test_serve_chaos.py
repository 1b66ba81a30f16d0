"""A bounded chaos run against a real ``sfq serve``: for a few seconds, hostile clients (idle
sockets, trickling heads, half-sent bodies, keyless 30 MiB uploads, 100,000-deep JSON, absurd
numbers, garbage) and a misbehaving upstream (5xx, a 401 that echoes the provider key, cut
streams) at once, while an honest tenant is served throughout. The gateway's memory stays
bounded, and every model request that reached it has exactly one outcome in the metrics and
one access-log line with the status its client got."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from pathlib import Path

import openai
from serve_helpers import (
    LIMIT,
    UPSTREAM_KEY,
    GatewayProcess,
    Upstream,
    make_client,
    parse_response,
    policy_yaml,
    read_until_closed,
    wait_until,
)

DURATION = 6.0  # seconds of chaos
SERVER = """\
server:
  header_timeout_seconds: 1
  body_timeout_seconds: 1
  idle_timeout_seconds: 2
  send_timeout_seconds: 2
  max_connections: 96
  pools:
    main: {max_body_bytes: 65536}
"""


def _head(key: str | None, length: int, path: str = "/v1/completions") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode()


class Chaos:
    def __init__(self, gw: GatewayProcess) -> None:
        self.gw = gw
        self.stop = threading.Event()
        self.answers: list[tuple[str, int, str | None]] = []  # (what, status, request id) of model requests
        self.protocol: list[int] = []  # statuses of the protocol-level refusals (no model request)
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.gw.port), timeout=LIMIT)

    def answered(self, what: str, data: bytes) -> None:
        if not data:
            return  # closed before an answer (an idle or evicted connection)
        status, headers, body = parse_response(data)
        if status == 503 and b"too_many_connections" in body:  # the edge's own answer: no request yet
            self.protocol.append(status)
            return
        with self.lock:
            self.answers.append((what, status, headers.get("x-request-id")))

    def loop(self, what: str, fn, pause: float) -> None:
        while not self.stop.is_set():
            try:
                fn()
            except OSError:
                pass  # the gateway closed on us: expected for several of these
            except Exception as exc:  # a bug in the test's own clients
                self.errors.append(f"{what}: {exc!r}")
            time.sleep(pause * random.uniform(0.5, 1.5))

    # ------------------------------------------------------------ the hostile clients
    def idle(self, held: list[socket.socket]) -> None:
        held.append(self.connect())
        if len(held) > 150:
            held.pop(0).close()

    def trickle(self) -> None:
        with self.connect() as s:
            for b in _head("sk-a", 100):
                if self.stop.is_set():
                    return
                s.send(bytes([b]))
                time.sleep(0.2)

    def keyless_upload(self) -> None:
        with self.connect() as s:
            s.sendall(_head(None, 30 << 20))
            try:
                s.sendall(b"[" * (1 << 20))
            except OSError:
                pass
            self.answered("keyless", read_until_closed(s))

    def half_body(self) -> None:
        with self.connect() as s:
            s.sendall(_head("sk-b", 10000) + b'{"model": "m", "prompt": "')
            self.answered("half", read_until_closed(s))

    def body(self, what: str, body: bytes, key: str = "sk-b") -> None:
        with self.connect() as s:
            s.sendall(_head(key, len(body)) + body)
            self.answered(what, read_until_closed(s))

    def garbage(self) -> None:
        with self.connect() as s:
            s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
            data = read_until_closed(s)
            if data:
                self.protocol.append(parse_response(data)[0])


def test_chaos(upstream: Upstream, refused_url: str, tmp_path: Path):
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(upstream.url, refused_url) + SERVER)
    gw = GatewayProcess(cfg, nofile=512)
    held: list[socket.socket] = []
    try:
        honest = make_client(gw, "sk-a")
        honest.completions.create(model="m", prompt="warm", max_tokens=1)
        total0 = gw.metric("sfq_requests_total")
        # (a line is written in the event-loop iteration after its answer: wait for the warm-up's)
        lines0 = wait_until(lambda: len(gw.access()), "the warm-up's access log line")
        base = gw.rss()
        peak = [0]
        c = Chaos(gw)
        deep = b"[" * 100_000 + b"]" * 100_000
        absurd = json.dumps({"model": "m", "prompt": "p", "max_tokens": 10 ** 9}).encode()
        too_big = json.dumps({"model": "m", "prompt": "x" * 70000}).encode()
        upstream_bad = [json.dumps({"model": "m", "prompt": p, "max_tokens": 3, "stream": p == "cut"}).encode()
                        for p in ("err500", "echo401", "cut", "err503")]
        workers = [
            ("idle", lambda: c.idle(held), 0.02),
            *[("trickle", c.trickle, 0.05)] * 6,
            *[("keyless", c.keyless_upload, 0.05)] * 2,
            ("half", c.half_body, 0.05),
            ("deep", lambda: c.body("deep", deep), 0.05),
            ("absurd", lambda: c.body("absurd", absurd), 0.05),
            ("too_big", lambda: c.body("too_big", too_big), 0.05),
            ("upstream", lambda: c.body("upstream", random.choice(upstream_bad)), 0.05),
            ("garbage", c.garbage, 0.1),
        ]
        threads = [threading.Thread(target=c.loop, args=w, daemon=True) for w in workers]

        def watch() -> None:
            while not c.stop.is_set():
                peak[0] = max(peak[0], gw.rss() - base)
                time.sleep(0.05)

        threads.append(threading.Thread(target=watch, daemon=True))
        for t in threads:
            t.start()
        served = 0
        t_end = time.monotonic() + DURATION
        try:
            while time.monotonic() < t_end:  # the honest tenant, throughout
                r = honest.chat.completions.create(model="m", max_tokens=2,
                                                   messages=[{"role": "user", "content": f"honest {served}"}])
                assert r.choices[0].message.content == "xx"
                served += 1
        finally:
            c.stop.set()
            for t in threads:
                t.join(LIMIT)
            for s in held:
                s.close()
        assert not c.errors, c.errors[:5]
        print(f"chaos: {served} honest requests served; {len(c.answers)} hostile model requests answered "
              f"({sorted({(w, st) for w, st, _ in c.answers})}); {len(c.protocol)} protocol refusals; "
              f"gateway RSS grew by at most {peak[0] / 2**20:.1f} MiB")
        assert served >= 10
        assert peak[0] < 48 << 20, f"the gateway grew by {peak[0] / 2**20:.0f} MiB"
        want = {"keyless": {401}, "half": {408}, "deep": {400}, "absurd": {400}, "too_big": {413},
                "upstream": {200, 502, 503}}  # 200: the cut stream, ended by an error event
        for what, status, rid in c.answers:
            assert status in want[what], (what, status)
            assert rid is not None and rid.startswith("req_")
        assert set(c.protocol) <= {400, 503}
        # the books: one access-log line and one outcome per model request, each with the status its client got
        # (some clients were cut before they read their answer: the gateway logged and counted those too)
        wait_until(lambda: gw.metric("sfq_requests_total") - total0 == len(gw.access()) - lines0,
                   "every request in the log and the metrics")
        lines = gw.access()[lines0:]
        assert len(lines) >= served + len(c.answers)
        assert all(x["status"] != 0 for x in lines)
        by_id = {x["request_id"]: x for x in lines}
        assert len(by_id) == len(lines)  # one line per request
        for what, status, rid in c.answers:
            assert by_id[rid]["status"] == status, (what, by_id[rid])
        assert not gw.log_has(UPSTREAM_KEY)
        # and after it all, the gateway still serves
        assert honest.completions.create(model="m", prompt="after", max_tokens=1).choices[0].text == "x"
    finally:
        for s in held:
            s.close()
        gw.stop()
