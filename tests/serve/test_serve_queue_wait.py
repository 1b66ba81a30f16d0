"""``X-SFQ-Queue-Wait`` (and deadline misses) through a real ``sfq serve`` in front of a real ``sfq demo-backend``,
read with the official ``openai`` client (``with_raw_response``): 0 for a request that started
at once, what a queued one waited, what a refused one waited before its refusal, 0 for one
refused before the queue; the access log's ``queue_wait`` says the same number. No assertion
here measures time: a wait is checked against what the test made happen (a slot held until the
test lets it go) and against the client's own bound (a request cannot wait longer than it took).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from serve_helpers import LIMIT, DemoProcess, GatewayProcess, make_client, wait_until

CHAT = [{"role": "user", "content": "Hi"}]
HEADER = "x-sfq-queue-wait"


@pytest.fixture(scope="module")
def demo() -> Iterator[DemoProcess]:
    d = DemoProcess(slots=4, tokens_per_second=50.0)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def gw(demo: DemoProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    p = tmp_path_factory.mktemp("queue_wait") / "policy.yaml"
    p.write_text(f"""\
pools:
  local:
    models: [demo]
    backends:
      - {{url: "{demo.url}", max_in_flight: 1}}
classes:
  interactive: {{weight: 6, max_queue_age_seconds: 30}}
  batch: {{weight: 1, max_queue_age_seconds: 0.2}}
orgs:
  product: {{keys: ["sk-product"], classes: [interactive, batch]}}
  analytics: {{keys: ["sk-analytics"], classes: [batch]}}
""")
    g = GatewayProcess(p)
    try:
        yield g
    finally:
        g.stop()


def _ms(headers: Any) -> int:
    v = headers.get(HEADER)
    assert v is not None, f"no {HEADER} in {dict(headers)!r}"
    assert v.isdigit(), v  # whole milliseconds
    return int(v)


def _logged(gw: GatewayProcess, rid: str) -> dict[str, Any]:
    line: dict[str, Any] = wait_until(lambda: next((x for x in gw.access() if x["request_id"] == rid), None),
                                      f"the access-log line of {rid}")
    return line


def _missed(gw: GatewayProcess) -> dict[str, tuple[int, float]]:
    """Per class: ``/stats``' deadline misses and ``sfq_deadline_missed_total`` (every org)."""
    _, body = gw.get("/stats?pool=local")
    classes = json.loads(body)["pools"]["local"].get("classes", {})
    return {c: (int(classes.get(c, {}).get("deadline_missed", 0)),
                gw.metric("sfq_deadline_missed_total", **{"class": c})) for c in ("interactive", "batch")}


def _waiting(gw: GatewayProcess) -> int:
    _, body = gw.get("/stats?pool=local")
    return int(json.loads(body)["pools"]["local"]["waiting"])


class _Holder:
    """A long stream of the demo engine (2,000 tokens at 50 a second: 40 s) that holds the
    pool's one slot until the test closes it."""

    def __init__(self, gw: GatewayProcess) -> None:
        raw = make_client(gw, "sk-product").chat.completions.with_raw_response.create(
            model="demo", messages=CHAT, max_tokens=2000, stream=True)
        self.headers = raw.headers
        self.rid = raw.headers["x-request-id"]
        self.stream = raw.parse()
        next(iter(self.stream))  # running: its first event came

    def close(self) -> None:
        self.stream.close()  # the client goes: the gateway cancels it and frees the slot


def test_0_for_a_start_at_once_and_what_a_queued_request_waited(gw: GatewayProcess):
    holder = _Holder(gw)
    assert _ms(holder.headers) == 0  # the slot was free: it started as it was admitted (on the stream's start)

    def queued() -> tuple[Any, float]:
        t0 = time.monotonic()
        raw = make_client(gw, "sk-product").chat.completions.with_raw_response.create(
            model="demo", messages=CHAT, max_tokens=2)
        return raw, time.monotonic() - t0

    with ThreadPoolExecutor(1) as ex:
        job = ex.submit(queued)
        wait_until(lambda: _waiting(gw) == 1, "the second request to wait behind the stream")
        holder.close()
        raw, took = job.result(LIMIT)
    assert raw.parse().choices[0].message.content
    waited = _ms(raw.headers)
    assert 0 < waited <= took * 1000 + 1  # it waited for the slot, and not longer than it took in all
    line = _logged(gw, raw.headers["x-request-id"])
    assert line["outcome"] == "completed" and round(line["queue_wait"] * 1000) == waited
    assert line["wait"] == pytest.approx(line["queue_wait"])  # (one attempt: the same as the log's wait)
    assert _logged(gw, holder.rid)["queue_wait"] == 0


def test_a_refusal_says_how_long_it_waited_and_one_refused_before_the_queue_0(gw: GatewayProcess):
    before = _missed(gw)
    holder = _Holder(gw)
    try:
        # a deadline (X-SFQ-Timeout) and a class's queue age (batch: 0.2 s) run out in the queue
        for key, headers in (("sk-product", {"X-SFQ-Timeout": "0.2"}), ("sk-analytics", {})):
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as e:
                make_client(gw, key).chat.completions.create(model="demo", messages=CHAT, max_tokens=2,
                                                            extra_headers=headers)
            took = time.monotonic() - t0
            assert e.value.status_code == 504
            waited = _ms(e.value.response.headers)
            assert 0 < waited <= took * 1000 + 1
            line = _logged(gw, e.value.response.headers["x-request-id"])
            assert line["reason"] in ("deadline", "queue_timeout") and line["wait"] is None
            assert round(line["queue_wait"] * 1000) == waited
        # each is one deadline miss of its class, in /stats and /metrics
        after = _missed(gw)
        for c in ("interactive", "batch"):
            assert after[c] == (before[c][0] + 1, before[c][1] + 1), (c, before, after)
        # refused before the queue: a wrong key, a bad header, an unknown model
        for key, model, headers, status in (("sk-nobody", "demo", {}, 401),
                                            ("sk-product", "demo", {"X-SFQ-Timeout": "soon"}, 400),
                                            ("sk-product", "nope", {}, 404)):
            with pytest.raises(openai.APIStatusError) as e:
                make_client(gw, key).chat.completions.create(model=model, messages=CHAT, max_tokens=2,
                                                            extra_headers=headers)
            assert e.value.status_code == status and _ms(e.value.response.headers) == 0
            assert _logged(gw, e.value.response.headers["x-request-id"])["queue_wait"] == 0
    finally:
        holder.close()
    # a stream that waited: the header is on its start, before any event
    holder = _Holder(gw)
    with ThreadPoolExecutor(1) as ex:
        job = ex.submit(lambda: make_client(gw, "sk-product").completions.with_raw_response.create(
            model="demo", prompt="Hi", max_tokens=2, stream=True, extra_headers={"X-SFQ-Class": "interactive"}))
        wait_until(lambda: _waiting(gw) == 1, "the stream to wait behind the holder")
        holder.close()
        raw = job.result(LIMIT)
    waited = _ms(raw.headers)
    assert list(raw.parse())  # its events came after
    assert waited > 0 and round(_logged(gw, raw.headers["x-request-id"])["queue_wait"] * 1000) == waited

