"""A client that goes away cancels its request: before dispatch it never reaches the
upstream; after dispatch the upstream sees the call aborted."""

from __future__ import annotations

import json
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

from serve_helpers import GatewayProcess, Upstream, wait_until


def _send(gw: GatewayProcess, body: dict, key: str = "sk-a", path: str = "/v1/completions",
          rcvbuf: int | None = None) -> socket.socket:
    """Send a request on a raw connection and return it, unanswered (the test closes it)."""
    data = json.dumps(body).encode()
    s = socket.socket()
    if rcvbuf is not None:  # before connecting, so that the TCP window follows it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_disconnect_while_queued_never_reaches_the_upstream(client, gate: Upstream, gateway: GatewayProcess):
    before = gateway.metric("sfq_requests_total", org="team-b", outcome="cancelled_before_start")
    with ThreadPoolExecutor(1) as ex:
        held = ex.submit(client.completions.create, model="m", prompt="hold-c1", max_tokens=1)
        wait_until(lambda: "hold-c1" in gate.holding, "the held request to reach the upstream")
        s = _send(gateway, {"model": "m", "prompt": "never-sent", "max_tokens": 1}, key="sk-b")
        wait_until(lambda: gateway.metric("sfq_queue_length", org="team-b") == 1, "the second request to wait")
        s.close()
        wait_until(lambda: gateway.metric("sfq_requests_total", org="team-b", outcome="cancelled_before_start")
                   == before + 1, "the cancellation to be counted")
        assert gateway.metric("sfq_queue_length", org="team-b") == 0
        gate.release()
        assert held.result().choices[0].text == "x"
    client.completions.create(model="m", prompt="after", max_tokens=1)  # the pool goes on
    assert "never-sent" not in gate.texts()
    line = wait_until(lambda: [x for x in gateway.access() if x["org"] == "team-b" and x["status"] == 499],
                      "the access log line of the cancelled request")[-1]
    assert line["outcome"] == "cancelled_before_start" and line["cost_charged"] == 0


def test_disconnect_while_running_aborts_the_upstream_call(client, gate: Upstream, gateway: GatewayProcess):
    before = gateway.metric("sfq_requests_total", org="team-a", outcome="cancelled_during_execution")
    for i, stream in enumerate((False, True)):
        text = f"hold-abort-{i}"
        s = _send(gateway, {"model": "m", "prompt": text, "max_tokens": 1, "stream": stream})
        wait_until(lambda: text in gate.holding, "the request to reach the upstream")
        s.close()
        wait_until(lambda: text in gate.aborted, "the upstream to see the call aborted")
        wait_until(lambda: gateway.metric("sfq_requests_total", org="team-a", outcome="cancelled_during_execution")
                   == before + i + 1, "the cancellation to be counted")
    assert gateway.metric("sfq_in_flight", org="team-a") == 0
    gate.release()
    assert client.completions.create(model="m", prompt="next", max_tokens=1).choices[0].text == "x"


def test_disconnect_mid_stream_aborts_the_upstream_stream(gateway: GatewayProcess, upstream: Upstream):
    s = _send(gateway, {"model": "m", "prompt": "drip-1", "max_tokens": 400, "stream": True})
    got = b""
    while got.count(b"data: ") < 2:  # the stream has started and is flowing
        piece = s.recv(65536)
        assert piece, "the gateway closed the stream"
        got += piece
    assert got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got
    s.close()
    wait_until(lambda: "drip-1" in upstream.aborted, "the upstream to see the stream aborted")
    line = wait_until(lambda: [x for x in gateway.access() if x["stream"] and x["status"] == 499],
                      "the access log line of the abandoned stream")[-1]
    assert line["outcome"] == "cancelled_during_execution" and line["events"] >= 2


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) << 10 for line in fh if line.startswith("VmRSS:"))


def test_a_client_that_stops_reading_holds_the_upstream_back(gateway: GatewayProcess, upstream: Upstream):
    """Backpressure: a 128 MiB stream to a client that stops reading after 256 KiB. However long
    it stalls, the gateway holds no more than its buffers (a gateway that buffered the response
    would take all 128 MiB at loopback speed), and the upstream is held back."""
    s = _send(gateway, {"model": "m", "prompt": "big-1", "max_tokens": 2048, "stream": True}, rcvbuf=1 << 16)
    got = 0
    while got < 256 << 10:
        piece = s.recv(65536)
        assert piece, "the gateway closed the stream"
        got += len(piece)
    base = _rss(gateway.proc.pid)
    grew = 0
    deadline = time.monotonic() + 2.0  # the observation window, not a timing check
    while time.monotonic() < deadline:
        grew = max(grew, _rss(gateway.proc.pid) - base)
        time.sleep(0.05)
    assert grew < 32 << 20, f"the gateway grew by {grew / 2**20:.1f} MiB for a client that stopped reading"
    assert "big-1" not in upstream.finished and upstream.sent["big-1"] < 128 << 20
    s.close()
    wait_until(lambda: "big-1" in upstream.aborted, "the upstream to see the stream aborted")


def test_clients_that_leave_mid_write_are_cancellations_not_errors(gateway: GatewayProcess, upstream: Upstream):
    """Clients that close (or reset) their connection while the gateway is writing to them (a
    fast stream; a load generator at the end of its run): each request ends cancelled, logged
    as 499, never as the gateway's own error, and its upstream call is aborted."""
    for i in range(8):  # one at a time (the tests' pool runs one request at a time)
        s = _send(gateway, {"model": "m", "prompt": f"big-reset-{i}", "max_tokens": 400, "stream": True})
        got = 0
        while got < 1 << 17:  # the stream flows (64 KiB events)
            piece = s.recv(65536)
            assert piece, "the gateway closed the stream"
            got += len(piece)
        # closed while the gateway writes (a reset for odd ones): its next write finds the
        # transport closing, or the connection lost
        if i % 2:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        wait_until(lambda: f"big-reset-{i}" in upstream.aborted, "the upstream call aborted")
    lines = wait_until(lambda: (x := [x for x in gateway.access() if x["stream"] and x["status"] == 499])
                       and len(x) >= 8 and x, "the access log lines of the reset streams")
    assert all(x["outcome"] == "cancelled_during_execution" for x in lines)
    assert not gateway.log_has("unexpected error"), "a client's reset was logged as the gateway's own error"
