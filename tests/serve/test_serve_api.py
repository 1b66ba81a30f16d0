"""``sfq serve`` black-box through the official ``openai`` client: replies, streams, the other
routes, and every error status surfacing as the client's own exception type."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serve_helpers import UPSTREAM_KEY, GatewayProcess, Upstream, make_client, wait_until

CHAT = [{"role": "user", "content": "hello"}]


def test_chat_and_completion_replies(client, upstream: Upstream, gateway: GatewayProcess):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
    assert r.choices[0].message.content == "xxxx"
    assert r.usage is not None and r.usage.completion_tokens == 4
    c = client.completions.create(model="m", prompt="hi there", max_tokens=2)
    assert c.choices[0].text == "xx"
    # the upstream got the body, its own key, and none of the client's headers
    path, body, headers = upstream.requests[-1]
    assert path == "/v1/completions" and body["prompt"] == "hi there"
    assert headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert not any("sk-a" in v for _, _, h in upstream.requests for v in h.values())
    line = wait_until(lambda: [x for x in gateway.access() if x["path"] == "/v1/completions"
                               and x["status"] == 200], "the access log line")[-1]
    assert (line["org"], line["class"], line["pool"], line["model"]) == ("team-a", "interactive", "main", "m")
    assert line["outcome"] == "completed" and line["completion_tokens"] == 2 and line["cost_charged"] > 0
    assert line["wait"] is not None and line["wait"] >= 0


def test_streams_pass_through(client, upstream: Upstream, gateway: GatewayProcess):
    chunks = list(client.chat.completions.create(model="m", messages=CHAT, max_tokens=5, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "xxxxx"
    assert all(ch.usage is None for ch in chunks)  # not asked for: not passed on
    with_usage = list(client.completions.create(model="m", prompt="p", max_tokens=3, stream=True,
                                                stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in with_usage if ch.choices) == "xxx"
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 3
    line = wait_until(lambda: [x for x in gateway.access() if x["stream"] and x["path"] == "/v1/chat/completions"],
                      "the stream's access log line")[-1]
    assert line["outcome"] == "completed" and line["completion_tokens"] == 5 and line["events"] == 5


def test_models_health_metrics(client, gateway: GatewayProcess):
    assert sorted(m.id for m in client.models.list()) == ["gone", "m"]
    with pytest.raises(openai.AuthenticationError):
        make_client(gateway, "nope").models.list()
    status, body = gateway.get("/health")  # no key needed
    h = json.loads(body)
    assert status == 200 and h["status"] == "ok"
    assert set(h["pools"]) == {"main", "down"} and h["pools"]["main"]["models"] == ["m"]
    assert len(h["backends"]) == 2
    client.completions.create(model="m", prompt="counted", max_tokens=1)
    assert gateway.metric("sfq_requests_total", org="team-a", outcome="completed") >= 1
    assert gateway.metric("sfq_queue_wait_seconds_count", pool="main") >= 1  # (per class and pool: no org label)
    _, text = gateway.get("/metrics")
    for name in ("sfq_queue_length", "sfq_in_flight", "sfq_queue_wait_seconds_bucket"):
        assert name.encode() in text


def test_the_client_errors(client, gateway: GatewayProcess):
    with pytest.raises(openai.AuthenticationError) as e401:
        make_client(gateway, "sk-wrong").chat.completions.create(model="m", messages=CHAT)
    assert e401.value.status_code == 401 and e401.value.code == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError):
        make_client(gateway, "sk-b").chat.completions.create(model="m", messages=CHAT,
                                                             extra_headers={"X-SFQ-Class": "interactive"})
    with pytest.raises(openai.NotFoundError) as e404:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert e404.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x", extra_headers={"X-SFQ-Timeout": "soon"})
    with pytest.raises(openai.InternalServerError) as e502:
        client.completions.create(model="m", prompt="err500")
    assert e502.value.status_code == 502
    with pytest.raises(openai.InternalServerError) as e503:
        client.completions.create(model="m", prompt="err503")  # retried (safe), then the retries ran out
    assert e503.value.status_code == 503
    # nobody listens on the pool's only backend: 503 at once (not at the deadline), with Retry-After
    for _ in range(2):  # the first finds out (its backend leaves rotation), the second is refused at once
        with pytest.raises(openai.InternalServerError) as e503:
            client.completions.create(model="gone", prompt="x", extra_headers={"X-SFQ-Timeout": "30"})
        assert e503.value.status_code == 503 and e503.value.response.headers.get("Retry-After") == "1"
    # an error after the stream started ends it with an error event: the client raises
    with pytest.raises(openai.APIError, match="a backend failed"):
        for _ in client.completions.create(model="m", prompt="cut", max_tokens=6, stream=True):
            pass


def test_raw_http_errors(gateway: GatewayProcess):
    """What the client library cannot send: a body that is not JSON, a missing key, an
    unknown route; every answer in OpenAI's error shape."""
    def post(body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
        import urllib.request

        req = urllib.request.Request(gateway.url + "/v1/chat/completions", data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, body = post(b"{not json", {"Authorization": "Bearer sk-a"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = post(b"{not json", {})
    assert status == 401  # the key is checked first
    status, body = post(json.dumps({"model": "m", "messages": CHAT}).encode(), {"Authorization": "Basic sk-a"})
    assert status == 401 and set(body["error"]) >= {"message", "type", "code"}
    status, body = gateway.get("/v2/anything")
    assert status == 404 and json.loads(body)["error"]["code"] == "unknown_route"
    assert "GET /stats, GET /dashboard)" in json.loads(body)["error"]["message"]  # the routes there are


def test_429s_say_when_to_come_back(client, gate: Upstream, gateway: GatewayProcess):
    limited = make_client(gateway, "sk-limited")
    limited.completions.create(model="m", prompt="first", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as rl:
        limited.completions.create(model="m", prompt="second", max_tokens=1)
    assert rl.value.code == "rate_limited" and int(rl.value.response.headers["Retry-After"]) >= 1
    # queue_full: the backend (max_in_flight 1) is held, the strict class's one place is taken
    system = {"X-SFQ-Class": "system"}
    with ThreadPoolExecutor(2) as ex:
        held = ex.submit(client.completions.create, model="m", prompt="hold-429", max_tokens=1)
        wait_until(lambda: "hold-429" in gate.holding, "the held request to reach the upstream")
        queued = ex.submit(client.completions.create, model="m", prompt="queued-429", max_tokens=1,
                           extra_headers=system)
        wait_until(lambda: gateway.metric("sfq_queue_length", org="team-a", **{"class": "system"}) == 1,
                   "the strict request to wait")
        with pytest.raises(openai.RateLimitError) as qf:
            client.completions.create(model="m", prompt="third", max_tokens=1, extra_headers=system)
        assert qf.value.code == "queue_full" and int(qf.value.response.headers["Retry-After"]) >= 1
        gate.release()
        assert held.result().choices[0].text == "x" and queued.result().choices[0].text == "x"


def test_an_oversized_body_gets_413_in_openai_shape(gateway: GatewayProcess):
    """A body over the size limit gets 413 in OpenAI's shape (not aiohttp's text page)."""
    big = b'{"model": "m", "prompt": "' + b"a" * (33 << 20) + b'"}'
    with socket.create_connection(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\n"
                  b"Content-Type: application/json\r\nContent-Length: " + str(len(big)).encode() + b"\r\n\r\n")
        try:
            s.sendall(big)
        except OSError:
            pass  # the gateway may answer and close before reading it all
        data = s.recv(65536)
    assert data.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in data


def test_a_deadline_that_runs_out_while_running_aborts_the_call(client, gate: Upstream):
    with pytest.raises(openai.InternalServerError) as e504:
        client.completions.create(model="m", prompt="hold-deadline", max_tokens=1,
                                  extra_headers={"X-SFQ-Timeout": "0.5"})
    assert e504.value.status_code == 504 and e504.value.code == "deadline_exceeded"
    wait_until(lambda: "hold-deadline" in gate.aborted, "the upstream to see the call aborted")
