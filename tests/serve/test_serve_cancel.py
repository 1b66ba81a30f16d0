"""A client that goes away cancels its request: before dispatch it never reaches the
upstream; after dispatch the upstream sees the call aborted."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

from serve_helpers import GatewayProcess, Upstream, wait_until


def _send(gw: GatewayProcess, body: dict, key: str = "sk-a", path: str = "/v1/completions") -> socket.socket:
    """Send a request on a raw connection and return it, unanswered (the test closes it)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])))
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
