"""``sfq serve`` at the edge, black-box over raw sockets and the official client: idle, trickling
and half-sent connections are closed; the key is checked before the body is read; bodies and
numbers are bounded; the protocol's own errors are in OpenAI's shape with no version banner;
the connection cap keeps serving."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from serve_helpers import (
    LIMIT,
    GatewayProcess,
    Upstream,
    make_client,
    parse_response,
    policy_yaml,
    raw_exchange,
    read_response,
    read_until_closed,
    wait_until,
)

from sfq.policy import ServerSpec

SERVER = """\
server:
  header_timeout_seconds: 1
  body_timeout_seconds: 1
  idle_timeout_seconds: 2
  send_timeout_seconds: 2
  max_body_bytes: 1048576
  pools:
    main: {max_body_bytes: 65536}
"""
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def policy_file(upstream: Upstream, refused_url: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("edge") / "policy.yaml"
    p.write_text(policy_yaml(upstream.url, refused_url) + SERVER)
    return p


def _head(path: str = "/v1/completions", key: str | None = "sk-a", length: int | None = None,
          extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def _post(gw: GatewayProcess, body: bytes | dict, key: str | None = "sk-a", extra: str = "") -> tuple[int, dict, dict]:
    b = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, headers, raw = parse_response(raw_exchange(gw, _head(key=key, length=len(b),
                                                                 extra="Connection: close\r\n" + extra) + b))
    return status, headers, json.loads(raw)


def test_the_defaults_close_a_stalled_connection_within_30_s():
    d = ServerSpec()
    assert max(d.header_timeout_seconds, d.idle_timeout_seconds, d.send_timeout_seconds) <= 30
    assert d.body_timeout_seconds <= 30


def test_idle_trickling_and_half_sent_connections_are_closed(gateway: GatewayProcess):
    # nothing sent at all: closed by the idle timeout
    with socket.create_connection(("127.0.0.1", gateway.port)) as s:
        assert read_until_closed(s) == b""
    # a head that trickles in, a byte at a time: closed (408 when the head deadline closes it)
    got: list[bytes] = []
    with socket.create_connection(("127.0.0.1", gateway.port)) as s:
        def trickle() -> None:
            for b in _head(length=10):
                try:
                    s.send(bytes([b]))
                except OSError:
                    return
                time.sleep(0.2)

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        got.append(read_until_closed(s))
        t.join(LIMIT)
    assert got[0] == b"" or got[0].startswith(b"HTTP/1.1 408 ")
    # a keep-alive connection after its response: closed once idle
    before = gateway.metric("sfq_refusals_total", org="team-a", reason="bad_request")
    with socket.create_connection(("127.0.0.1", gateway.port)) as s:
        s.sendall(_head(length=14) + b'{"model": "m"}')
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 400 ")  # no prompt: answered, the connection kept
        assert read_until_closed(s) == b""
    # a body that stops half-way: 408, closed, counted
    status, headers, body = parse_response(raw_exchange(gateway, _head(length=1000) + b'{"model": "m"'))
    assert status == 408 and body and json.loads(body)["error"]["code"] == "request_timeout"
    assert headers["connection"] == "close" and headers["x-should-retry"] == "true"
    wait_until(lambda: gateway.metric("sfq_refusals_total", org="team-a", reason="bad_request") == before + 2,
               "the 400 and the 408 to be counted")


def test_the_key_is_checked_before_the_body_is_read(gateway: GatewayProcess):
    base = gateway.rss()
    answers = []
    socks = []
    try:
        for _ in range(6):  # keyless uploads announcing 30 MiB: answered at once, nothing read
            s = socket.create_connection(("127.0.0.1", gateway.port))
            socks.append(s)
            s.sendall(_head(key=None, length=30 << 20) + b"[" * 4096)
        for s in socks:
            answers.append(parse_response(read_until_closed(s)))
    finally:
        for s in socks:
            s.close()
    assert all(st == 401 and h["connection"] == "close" for st, h, _ in answers)
    assert gateway.rss() - base < 16 << 20
    # Expect: 100-continue gets no "100 Continue" without a key ...
    data = raw_exchange(gateway, _head(key="sk-wrong", length=20, extra="Expect: 100-continue\r\n"))
    assert data.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in data
    # ... and one, then the answer, with a key
    body = json.dumps({"model": "m", "prompt": "p", "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=LIMIT) as s:
        s.sendall(_head(length=len(body), extra="Expect: 100-continue\r\nConnection: close\r\n"))
        assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n")
        s.sendall(body)
        assert read_until_closed(s).startswith(b"HTTP/1.1 200 ")


def test_bodies_are_bounded_per_pool(gateway: GatewayProcess, client: openai.OpenAI):
    before = gateway.metric("sfq_refusals_total", reason="too_large")
    with pytest.raises(openai.APIStatusError) as e413:  # pool main takes 64 KiB
        client.completions.create(model="m", prompt="x" * 70000, max_tokens=1)
    assert e413.value.status_code == 413 and e413.value.code == "request_too_large"
    assert "65536" in e413.value.message and e413.value.response.headers["x-should-retry"] == "false"
    # over the gateway's own limit (1 MiB): refused from the announced length, before any of it is sent
    status, headers, body = parse_response(raw_exchange(gateway, _head(length=2 << 20)))
    assert status == 413 and headers["connection"] == "close" and json.loads(body)["error"]["code"] == \
        "request_too_large"
    wait_until(lambda: gateway.metric("sfq_refusals_total", reason="too_large") == before + 2, "the 413s counted")


def test_bad_numbers_are_400s_naming_the_field(gateway: GatewayProcess, client: openai.OpenAI):
    cases = [({"max_tokens": 1_000_000_000}, ("'max_tokens'", "16777216")), ({"n": 10 ** 8}, ("'n'", "128")),
             ({"max_tokens": 2.5}, ("'max_tokens'", "2.5")), ({"max_tokens": "7"}, ("'max_tokens'", "'7'")),
             ({"max_tokens": 1 << 24, "n": 128}, ("max_tokens or n",))]
    for extra, words in cases:
        with pytest.raises(openai.BadRequestError) as e400:
            client.completions.create(model="m", prompt="p", extra_body=extra)
        assert all(w in e400.value.message for w in words), (extra, e400.value.message)
    status, headers, body = _post(gateway, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, _, body = _post(gateway, b'{"model": "m", "prompt": "p", "max_tokens": 1e999}')
    assert status == 400
    assert gateway.metric("sfq_requests_total", outcome="refused") >= 7


def test_protocol_errors_are_openai_shaped_without_a_banner(gateway: GatewayProcess, client: openai.OpenAI):
    answers = {
        "garbage": raw_exchange(gateway, b"GARBAGE\r\n\r\n"),
        "long header": raw_exchange(gateway, _head(extra="X-Long: " + "a" * 9000 + "\r\n")),
        "many headers": raw_exchange(gateway, _head(extra="".join(f"X-{i}: {'b' * 400}\r\n" for i in range(100)))),
        "bad length": raw_exchange(gateway, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n"),
    }
    for what, data in answers.items():
        status, headers, body = parse_response(data)
        err = json.loads(body)["error"]
        assert status in (400, 431) and set(err) >= {"message", "type", "code", "request_id"}, what
        assert headers["server"] == "sfq" and headers["x-should-retry"] == "false", what
        assert headers["x-request-id"] == err["request_id"], what
    assert parse_response(answers["long header"])[0] == 431 and parse_response(answers["many headers"])[0] == 431
    # and no answer names the server's software or its version
    r = client.completions.with_raw_response.create(model="m", prompt="p", max_tokens=1)
    seen = [r.headers.get("server")]
    with client.completions.with_streaming_response.create(model="m", prompt="p", max_tokens=2, stream=True) as s:
        seen.append(s.headers.get("server"))
    for path in ("/health", "/metrics", "/nowhere"):
        seen.append(parse_response(raw_exchange(gateway, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close"
                                                         f"\r\n\r\n".encode()))[1].get("server"))
    assert seen == ["sfq"] * 5


def test_a_body_whose_encoding_breaks_mid_way_is_a_400_at_once(gateway: GatewayProcess):
    """aiohttp reports a bad chunk as a new failed message; the request reading its body gets
    the error (400) instead of waiting out the body deadline."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=LIMIT) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n")
        time.sleep(0.2)  # the handler is reading the body now
        s.sendall(b"ZZ\r\nnot a chunk\r\n")
        status, headers, body = parse_response(read_until_closed(s))  # 400, not the deadline's 408
    assert status == 400 and "could not be read" in json.loads(body)["error"]["message"]


def test_two_authorization_headers_are_a_400(gateway: GatewayProcess):
    status, headers, body = _post(gateway, {"model": "m", "prompt": "p"}, key="sk-a",
                                  extra="Authorization: Bearer sk-b\r\n")
    assert status == 400 and "more than one Authorization" in body["error"]["message"]
    assert headers["x-should-retry"] == "false"


def test_x_should_retry_and_request_ids(gateway: GatewayProcess, client: openai.OpenAI, gate: Upstream):
    def error_of(fn, *a, **kw) -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError) as e:
            fn(*a, **kw)
        return e.value

    c = client.completions.create
    limited = make_client(gateway, "sk-limited").completions.create
    limited(model="m", prompt="p", max_tokens=1)  # its one request a minute
    seen = {
        401: error_of(make_client(gateway, "sk-wrong").completions.create, model="m", prompt="p"),
        403: error_of(make_client(gateway, "sk-b").completions.create, model="m", prompt="p",
                      extra_headers={"X-SFQ-Class": "interactive"}),
        404: error_of(c, model="nope", prompt="p"),
        400: error_of(c, model="m", prompt="p", max_tokens=0),
        504: error_of(c, model="m", prompt="hold-retry", max_tokens=1, extra_headers={"X-SFQ-Timeout": "0.3"}),
        429: error_of(limited, model="m", prompt="p", max_tokens=1),
        502: error_of(c, model="m", prompt="err500"),
        503: error_of(c, model="m", prompt="err503"),
    }
    want = {401: "false", 403: "false", 404: "false", 400: "false", 504: "false", 429: "true", 502: "true",
            503: "true"}
    for status, err in seen.items():
        assert err.status_code == status
        rid = err.response.headers["x-request-id"]
        assert err.response.headers["x-should-retry"] == want[status], status
        assert err.body["request_id"] == rid  # type: ignore[index]
        line = wait_until(lambda: [x for x in gateway.access() if x["request_id"] == rid], f"{rid}'s log line")[0]
        assert line["status"] == status
    # a reply names its request too
    r = client.completions.with_raw_response.create(model="m", prompt="p", max_tokens=1)
    assert r.headers["x-request-id"].startswith("req_")


def test_a_client_that_reads_nothing_is_dropped_after_the_send_timeout(gateway: GatewayProcess,
                                                                       upstream: Upstream):
    """No deadline: a stream whose client stops reading is dropped once nothing moved for
    ``send_timeout_seconds``; the request is cancelled and its slot freed."""
    before = gateway.metric("sfq_gateway_connections_closed_total", cause="send_timeout")
    body = json.dumps({"model": "m", "prompt": "big-nodeadline", "max_tokens": 4096, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    s.connect(("127.0.0.1", gateway.port))
    try:
        s.sendall(_head(length=len(body)) + body)
        got = 0
        while got < 128 << 10:
            piece = s.recv(65536)
            assert piece, "the gateway closed the stream"
            got += len(piece)
        wait_until(lambda: "big-nodeadline" in upstream.aborted, "the upstream to see the stream aborted")
        assert gateway.metric("sfq_gateway_connections_closed_total", cause="send_timeout") == before + 1
        assert gateway.metric("sfq_in_flight", org="team-a") == 0 and "big-nodeadline" not in upstream.finished
    finally:
        s.close()


def test_a_reload_puts_the_server_section_in_force(upstream: Upstream, refused_url: str, tmp_path: Path):
    import signal

    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(upstream.url, refused_url))
    gw = GatewayProcess(cfg)
    try:
        a = make_client(gw)
        assert a.completions.create(model="m", prompt="y" * 5000, max_tokens=1).choices[0].text == "x"
        cfg.write_text(policy_yaml(upstream.url, refused_url) + "server: {pools: {main: {max_body_bytes: 4096}}}\n")
        gw.signal(signal.SIGHUP)
        wait_until(lambda: gw.log_has("reloaded"), "the reload")
        with pytest.raises(openai.APIStatusError) as e413:
            a.completions.create(model="m", prompt="y" * 5000, max_tokens=1)
        assert e413.value.status_code == 413 and "4096" in e413.value.message
        cfg.write_text(policy_yaml(upstream.url, refused_url) + "server: {pools: {nope: {max_body_bytes: 4096}}}\n")
        gw.signal(signal.SIGHUP)
        wait_until(lambda: gw.log_has("server.pools.nope"), "the refusal, naming the field")
    finally:
        gw.stop()


# ------------------------------------------------------------------ the connection cap
@pytest.fixture
def capped(gate: Upstream, tmp_path: Path) -> Iterator[GatewayProcess]:
    """A gateway capped at 16 connections, in front of an upstream that takes 16 at once."""
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(f"""\
pools:
  main:
    models: [m]
    backends: [{{url: "{gate.url}", max_in_flight: 16, api_key_env: SFQ_TEST_UPSTREAM_KEY}}]
classes:
  interactive: {{weight: 1}}
orgs:
  team-a: {{keys: ["sk-a"], classes: [interactive]}}
server: {{max_connections: 16, idle_timeout_seconds: 30}}
""")
    gw = GatewayProcess(cfg)
    try:
        yield gw
    finally:
        gw.stop()


def test_over_the_cap_idle_connections_make_room(capped: GatewayProcess):
    idle = [socket.create_connection(("127.0.0.1", capped.port)) for _ in range(40)]
    try:
        a = make_client(capped)
        for i in range(5):
            assert a.completions.create(model="m", prompt=f"p{i}", max_tokens=1).choices[0].text == "x"
        for s in idle:
            s.settimeout(0.01)
        closed = 0
        for s in idle:
            try:
                closed += s.recv(1) == b""
            except (TimeoutError, ConnectionResetError):
                pass
        assert closed >= 40 - 16
        assert capped.metric("sfq_gateway_connections_closed_total", cause="evicted") >= 40 - 16
        assert capped.metric("sfq_gateway_connections") <= 16
    finally:
        for s in idle:
            s.close()


def test_when_every_connection_is_serving_a_new_one_gets_503(capped: GatewayProcess, gate: Upstream):
    busy = []
    try:
        for i in range(16):
            body = json.dumps({"model": "m", "prompt": f"hold-cap-{i}", "max_tokens": 1}).encode()
            s = socket.create_connection(("127.0.0.1", capped.port))
            busy.append(s)
            s.sendall(_head(length=len(body)) + body)
        wait_until(lambda: len([t for t in gate.holding if t.startswith("hold-cap-")]) == 16,
                   "16 requests to run")
        status, headers, raw = parse_response(raw_exchange(capped, b""))
        assert status == 503 and json.loads(raw)["error"]["code"] == "too_many_connections"
        assert headers["retry-after"] == "1" and headers["x-should-retry"] == "true"
        gate.release()
        for s in busy:  # every one of them is answered
            assert read_response(s).startswith(b"HTTP/1.1 200 ")
    finally:
        for s in busy:
            s.close()


def test_at_256_file_descriptors_300_idle_sockets_do_not_stop_service(gate: Upstream, refused_url: str,
                                                                      tmp_path: Path):
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(gate.url, refused_url))  # the defaults: the cap comes from the limit
    gw = GatewayProcess(cfg, nofile=256)
    idle: list[socket.socket] = []
    try:
        with ThreadPoolExecutor(8) as ex:
            idle = list(ex.map(lambda _: socket.create_connection(("127.0.0.1", gw.port), timeout=LIMIT), range(300)))
        a = make_client(gw)
        for i in range(5):
            assert a.completions.create(model="m", prompt=f"fd{i}", max_tokens=1).choices[0].text == "x"
        assert gw.log_has("at most ")
    finally:
        for s in idle:
            s.close()
        gw.stop()
