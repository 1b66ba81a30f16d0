"""What ``sfq serve`` answers when things go wrong upstream or downstream, black-box: no backend's
words (nor its key) reach a client; an endless event from a backend is cut; a client that stops
reading its stream is ended at its deadline; Idempotency-Key joiners keep their own deadline and
outlive the first client; ``/health`` says when a pool has no backend in rotation; every
request is counted once, with the status the client got."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from serve_helpers import (
    LIMIT,
    UPSTREAM_KEY,
    GatewayProcess,
    Upstream,
    make_client,
    parse_response,
    policy_yaml,
    read_response,
    read_until_closed,
    wait_until,
)

from sfq.backends.sse import EventTooLarge, SSEParser
from sfq.policy import parse_policy

CHAT = [{"role": "user", "content": "hello"}]


def _send(gw: GatewayProcess, body: dict, key: str = "sk-a", headers: str = "", rcvbuf: int | None = None
          ) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", gw.port))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n{headers}"
              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_no_backend_words_reach_a_client(client: openai.OpenAI, gateway: GatewayProcess, upstream: Upstream):
    with pytest.raises(openai.APIStatusError) as e:  # the upstream's 401 echoes the gateway's provider key
        client.completions.create(model="m", prompt="echo401", max_tokens=1)
    err = e.value
    rid = err.response.headers["x-request-id"]
    text = err.response.text
    assert err.status_code == 502 and err.code == "upstream_error" and "HTTP 401" in err.message
    assert UPSTREAM_KEY not in text and upstream.url not in text and "127.0.0.1" not in text
    assert err.response.headers["x-should-retry"] == "false"  # the backend refused it: a retry cannot help
    with pytest.raises(openai.InternalServerError) as e500:
        client.completions.create(model="m", prompt="err500", max_tokens=1)
    assert upstream.url not in e500.value.response.text and "injected" not in e500.value.response.text
    # the operator's log has what the backend said, under the request id, with the key redacted
    line = wait_until(lambda: next((x for x in list(gateway.err) if rid in x), None), "the log line")
    assert "HTTP 401" in line and upstream.url in line and "[redacted]" in line
    assert not gateway.log_has(UPSTREAM_KEY)
    # a stream cut mid-way: an error event, in the same words
    with pytest.raises(openai.APIError) as cut:
        for _ in client.completions.create(model="m", prompt="cut", max_tokens=6, stream=True):
            pass
    assert "a backend failed" in str(cut.value) and upstream.url not in str(cut.value)


def test_the_sse_parser_cuts_an_event_at_its_limit():
    p = SSEParser(max_event_bytes=1000)
    assert p.feed(b"data: " + b"x" * 900 + b"\n\n") == [b"x" * 900]
    with pytest.raises(EventTooLarge):
        for _ in range(20):
            p.feed(b"y" * 100)
    assert p.pending == 0  # nothing is held for it
    with pytest.raises(EventTooLarge):  # many data lines of one event count together
        SSEParser(max_event_bytes=1000).feed(b"data: abcdefghi\n" * 200)
    with pytest.raises(ValueError, match="max_event_bytes"):
        SSEParser(max_event_bytes=0)


def test_streamed_events_reach_the_client_as_the_upstream_wrote_them(client: openai.OpenAI, gateway: GatewayProcess):
    """The gateway passes each event's bytes on as they came (the upstream here writes Python's
    ``json.dumps``, spaces after separators: a re-encoding would be compact), and the official
    client reads them."""
    import urllib.request

    body = {"model": "m", "messages": [{"role": "user", "content": "bytes-1"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(gateway.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer sk-a", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=LIMIT) as r:
        lines = [x[6:] for x in r.read().split(b"\n\n") if x.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]" and len(lines) == 5 + 2  # five tokens, the usage, the end
    for raw in lines[:-1]:
        assert raw == json.dumps(json.loads(raw)).encode(), raw  # the upstream's own bytes
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "bytes-2"}],
                                                 max_tokens=3, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "xxx"


def test_an_endless_event_from_a_backend_is_cut(client: openai.OpenAI, gateway: GatewayProcess,
                                                 upstream: Upstream):
    """A 200 MiB line from the upstream: the stream ends with an error event and the gateway
    holds no more than the event limit (64 MiB) meanwhile."""
    base = gateway.rss()
    peak = [0]

    def watch() -> None:
        while "huge" not in upstream.aborted and "huge" not in upstream.finished:
            peak[0] = max(peak[0], gateway.rss() - base)
            time.sleep(0.02)

    with ThreadPoolExecutor(1) as ex:
        w = ex.submit(watch)
        with pytest.raises(openai.APIError, match="a backend failed"):
            for _ in client.completions.create(model="m", prompt="huge", max_tokens=1, stream=True):
                pass
        w.result(LIMIT)
    print(f"a 200 MiB line: the gateway grew by at most {peak[0] / 2**20:.0f} MiB; the upstream sent "
          f"{upstream.sent['huge'] / 2**20:.0f} MiB before it was cut")
    assert "huge" in upstream.aborted and upstream.sent["huge"] < 200 << 20
    assert peak[0] < 150 << 20, f"the gateway grew by {peak[0] / 2**20:.0f} MiB"
    line = wait_until(lambda: [x for x in gateway.access() if x["stream"] and x.get("error_status") == 502],
                      "the stream's access log line")[-1]
    assert line["status"] == 200 and line["outcome"] == "failed"  # what the client got: 200, then the error event


def test_a_client_that_stops_reading_is_ended_at_its_deadline(gateway: GatewayProcess, upstream: Upstream):
    before = gateway.metric("sfq_failures_total", org="team-a", reason="deadline")
    s = _send(gateway, {"model": "m", "prompt": "big-stall", "max_tokens": 4096, "stream": True},
              headers="X-SFQ-Timeout: 2\r\n", rcvbuf=1 << 16)
    try:
        got = 0
        while got < 128 << 10:
            piece = s.recv(65536)
            assert piece, "the gateway closed the stream"
            got += len(piece)
        # ... and reads no more: at its deadline the request ends, the upstream call is aborted
        wait_until(lambda: "big-stall" in upstream.aborted, "the upstream to see the stream aborted")
        wait_until(lambda: gateway.metric("sfq_failures_total", org="team-a", reason="deadline") == before + 1,
                   "the deadline to be counted")
        assert gateway.metric("sfq_in_flight", org="team-a") == 0
        assert "big-stall" not in upstream.finished
        read_until_closed(s)  # the gateway dropped the connection
    finally:
        s.close()
    line = wait_until(lambda: [x for x in gateway.access() if x["reason"] == "deadline" and x["stream"]],
                      "the access log line")[-1]
    assert line["status"] == 200 and line["outcome"] == "failed"


def test_a_joiner_keeps_its_own_deadline(gateway: GatewayProcess, client: openai.OpenAI, gate: Upstream):
    first = _send_keyed(gateway, "hold-j1", "key-1")
    try:
        wait_until(lambda: "hold-j1" in gate.holding, "the first request to run")
        with pytest.raises(openai.InternalServerError) as e504:
            client.completions.create(model="m", prompt="hold-j1", max_tokens=1,
                                      extra_headers={"Idempotency-Key": "key-1", "X-SFQ-Timeout": "0.5"})
        assert e504.value.status_code == 504 and e504.value.code == "deadline_exceeded"
        assert e504.value.response.headers["x-should-retry"] == "false"
        assert gate.texts().count("hold-j1") == 1  # it joined: not sent twice
        gate.release()
        assert parse_response(read_response(first))[0] == 200
    finally:
        first.close()


def test_a_joiner_outlives_the_first_client(gateway: GatewayProcess, client: openai.OpenAI, gate: Upstream):
    first = _send_keyed(gateway, "hold-j2", "key-2")
    with ThreadPoolExecutor(1) as ex:
        try:
            wait_until(lambda: "hold-j2" in gate.holding, "the first request to run")
            joiner = ex.submit(client.completions.create, model="m", prompt="hold-j2", max_tokens=1,
                               extra_headers={"Idempotency-Key": "key-2"})
            time.sleep(0.3)  # the joiner reaches the gateway (loopback) and joins the first
        finally:
            first.close()  # the first client leaves: the call goes on for the joiner
        time.sleep(0.5)
        assert "hold-j2" not in gate.aborted and gate.holding.count("hold-j2") == 1  # not sent twice
        gate.release()
        assert joiner.result(LIMIT).choices[0].text == "x"


def _send_keyed(gw: GatewayProcess, text: str, key: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", gw.port))
    data = json.dumps({"model": "m", "prompt": text, "max_tokens": 1}).encode()
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\nIdempotency-Key: {key}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


# ------------------------------------------------------------------ /health
def test_health_says_when_a_pool_has_no_backend_in_rotation(upstream: Upstream, refused_url: str, tmp_path: Path):
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(upstream.url, refused_url))
    gw = GatewayProcess(cfg)
    try:
        c = make_client(gw)
        assert c.completions.create(model="m", prompt="p", max_tokens=1).choices[0].text == "x"
        status, body = gw.get("/health?pool=main")
        assert status == 200 and json.loads(body)["status"] == "ok"
        with pytest.raises(openai.APIStatusError):  # nothing listens behind pool "down"
            c.completions.create(model="gone", prompt="p", max_tokens=1, extra_headers={"X-SFQ-Timeout": "1"})

        def health(q: str = "") -> tuple[int, dict[str, Any]]:
            st, b = gw.get("/health" + q)
            return st, json.loads(b)

        st, h = wait_until(lambda: (lambda r: r if r[0] == 503 else None)(health()), "/health to say 503")
        assert h["status"] == "unavailable" and "'down'" in h["reason"] and "unhealthy" in h["reason"]
        assert health("?pool=down")[0] == 503 and health("?pool=main")[0] == 200
        st, h = health("?pool=nope")
        assert st == 404 and h["error"]["code"] == "unknown_pool"
        # a backend paused by a 429's Retry-After is out of rotation too, until the pause ends
        with pytest.raises(openai.APIStatusError):
            c.completions.create(model="m", prompt="err429-4", max_tokens=1)
        st, h = wait_until(lambda: (lambda r: r if r[0] == 503 else None)(health("?pool=main")),
                           "pool main to be out of rotation")
        assert "paused" in h["reason"]
        wait_until(lambda: health("?pool=main")[0] == 200, "the pause to end")
    finally:
        gw.stop()


# ------------------------------------------------------------------ the books
def test_every_request_is_counted_once_with_the_status_it_got(gateway: GatewayProcess, client: openai.OpenAI):
    total0 = gateway.metric("sfq_requests_total")
    lines0 = len(gateway.access())
    statuses = []
    for fn in (lambda: client.completions.create(model="m", prompt="p", max_tokens=1),
               lambda: make_client(gateway, "sk-wrong").completions.create(model="m", prompt="p"),
               lambda: client.completions.create(model="nope", prompt="p"),
               lambda: client.completions.create(model="m", prompt="p", max_tokens=0),
               lambda: client.completions.create(model="m", prompt="err500"),
               lambda: client.completions.create(model="m", prompt="x" * (33 << 20))):
        try:
            fn()
            statuses.append(200)
        except openai.APIStatusError as exc:
            statuses.append(exc.status_code)
    assert statuses == [200, 401, 404, 400, 502, 413]
    wait_until(lambda: len(gateway.access()) == lines0 + 6, "six access log lines")
    assert [x["status"] for x in gateway.access()[lines0:]] == statuses
    assert gateway.metric("sfq_requests_total") == total0 + 6


class _BrokenEstimator:
    """An estimator that raises what none should: a bug, for the gateway's catch-all."""

    def estimate(self, body: Any, flow: Any = None) -> Any:
        raise RuntimeError("a bug with a secret in its text: sk-upstream-secret")


async def test_a_500_is_answered_counted_and_logged(caplog: pytest.LogCaptureFixture):
    """An unexpected error (a bug) gets a 500 in OpenAI's shape, is counted, and its access
    log line says 500, never 0 (the gateway in-process, over loopback, with the async client)."""
    from aiohttp import web

    from sfq.serve import Gateway
    from sfq.serve.edge import EdgeSite

    policy = parse_policy("""
pools:
  p: {models: [m], backends: [{url: "http://127.0.0.1:9", name: b}]}
classes: {c: {}}
orgs: {a: {keys: [k], classes: [c]}}
""")
    gw = Gateway(policy)
    gw.pd.estimator = _BrokenEstimator()  # type: ignore[assignment]
    runner = web.AppRunner(gw.app, handler_cancellation=True, access_log=None, lingering_time=0)
    await runner.setup()
    site = EdgeSite(runner, gw.edge, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=LIMIT)
        with caplog.at_level("INFO", logger="sfq.serve"):
            with pytest.raises(openai.InternalServerError) as e500:
                await c.completions.create(model="m", prompt="p", max_tokens=1)
        assert e500.value.status_code == 500 and e500.value.code == "internal_error"
        assert "secret" not in e500.value.response.text
        assert e500.value.response.headers["x-should-retry"] == "true"
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "sfq.serve.access"]
        assert [x["status"] for x in lines] == [500] and lines[0]["outcome"] == "refused"
        assert gw.pd.stats()["flows"]["a/c/p"]["refused"] == 1
        assert any(r.levelname == "ERROR" and lines[0]["request_id"] in r.getMessage() for r in caplog.records)
        await c.close()
    finally:
        await runner.cleanup()
        await asyncio.sleep(0)
