"""Each class's time-to-first-token objective and its attainment, and each org's predicted wait,
through a real ``sfq serve`` in front of a real ``sfq demo-backend`` (one slot), read with the
official ``openai`` client, ``/stats``, ``/metrics`` and ``sfq top --once``.

No assertion here measures how fast anything is: a request misses its objective because the
test held it in the queue longer than the objective (a slot held by a stream until the test lets
it go), or because its deadline ran out there; one within its objective has an objective of
10 minutes. The predicted wait is compared with itself (one request ahead, then three of the
same cost: three times as long), not with a clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from serve_helpers import LIMIT, DemoProcess, GatewayProcess, make_client, wait_until

CHAT = [{"role": "user", "content": "Hi"}]
HELD = 0.3  # seconds the test holds a request in the queue: more than interactive's objective


@pytest.fixture(scope="module")
def demo() -> Iterator[DemoProcess]:
    d = DemoProcess(slots=4, tokens_per_second=50.0)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def gw(demo: DemoProcess, tmp_path: Path) -> Iterator[GatewayProcess]:
    p = tmp_path / "policy.yaml"
    p.write_text(f"""\
pools:
  local:
    models: [demo]
    backends:
      - {{url: "{demo.url}", max_in_flight: 1}}
classes:
  interactive: {{weight: 6, ttft_objective_seconds: 0.2}}
  chat: {{weight: 6, ttft_objective_seconds: 600}}
  batch: {{weight: 1}}
orgs:
  product: {{keys: ["sk-product"], classes: [interactive, chat]}}
  analytics: {{keys: ["sk-analytics"], classes: [batch]}}
""")
    g = GatewayProcess(p)
    try:
        yield g
    finally:
        g.stop()


def _stats(gw: GatewayProcess) -> dict[str, Any]:
    status, body = gw.get("/stats?pool=local")
    assert status == 200
    pool: dict[str, Any] = json.loads(body)["pools"]["local"]
    return pool


class _Holder:
    """A long stream of the demo engine (2,000 tokens at 50 a second: 40 s) that holds the
    pool's one slot until the test closes it."""

    def __init__(self, gw: GatewayProcess, key: str = "sk-analytics") -> None:
        self.stream = make_client(gw, key).chat.completions.create(model="demo", messages=CHAT, max_tokens=2000,
                                                                   stream=True)
        next(iter(self.stream))  # running: its first event came

    def close(self) -> None:
        self.stream.close()  # the client goes: the gateway cancels it and frees the slot


def _ask(gw: GatewayProcess, cls: str, *, stream: bool = False, timeout: str | None = None) -> Any:
    headers = {"X-SFQ-Class": cls, **({"X-SFQ-Timeout": timeout} if timeout else {})}
    c = make_client(gw, "sk-product").chat.completions
    if stream:
        return list(c.create(model="demo", messages=CHAT, max_tokens=2, stream=True, extra_headers=headers))
    return c.create(model="demo", messages=CHAT, max_tokens=2, extra_headers=headers)


def test_attainment_counts_answers_within_the_objective_and_deadline_misses(gw: GatewayProcess) -> None:
    holder = _Holder(gw)
    with ThreadPoolExecutor(2) as ex:
        # a stream and a plain request wait behind the holder longer than interactive's objective
        late = [ex.submit(_ask, gw, "interactive", stream=True), ex.submit(_ask, gw, "interactive")]
        wait_until(lambda: _stats(gw)["classes"].get("interactive", {}).get("waiting") == 2,
                   "two interactive requests to wait behind the holder")
        time.sleep(HELD)  # (their first tokens come after this: not a timing check)
        # one whose deadline runs out in the queue: a miss, though it was never answered
        with pytest.raises(openai.APIStatusError) as e:
            _ask(gw, "interactive", timeout="0.05")
        assert e.value.status_code == 504
        holder.close()
        for job in late:
            assert job.result(LIMIT)
    for _ in range(3):  # within chat's objective (10 minutes)
        _ask(gw, "chat")
    _ask(gw, "chat", stream=True)
    # a refusal for another reason is not counted: a bad header
    with pytest.raises(openai.APIStatusError) as e:
        _ask(gw, "chat", timeout="soon")
    assert e.value.status_code == 400

    def counted() -> dict[str, Any] | None:
        c = _stats(gw)["classes"]
        return c if c.get("batch", {}).get("attainment_requests") == 1 else None  # (the holder's, once it ended)

    classes = wait_until(counted, "the holder's end to be counted")
    inter, chat, batch = classes["interactive"], classes["chat"], classes["batch"]
    assert inter["ttft_objective_seconds"] == 0.2
    assert (inter["attainment"], inter["attainment_requests"]) == (0.0, 3)  # two late answers, one deadline miss
    assert HELD <= inter["ttft_p50"] <= inter["ttft_p99"]  # (over the two answered)
    assert (chat["attainment"], chat["attainment_requests"]) == (1.0, 4)
    assert chat["ttft_p99"] is not None
    assert batch["ttft_objective_seconds"] is None and batch["attainment"] is None  # no objective: none, not 100 %
    # /metrics: the histogram of answered requests, with a bucket at the objective; the attainment gauge
    assert gw.metric("sfq_time_to_first_token_seconds_count", **{"class": "interactive"}) == 2
    assert gw.metric("sfq_time_to_first_token_seconds_bucket", **{"class": "interactive", "le": "0.2"}) == 0
    assert gw.metric("sfq_time_to_first_token_seconds_bucket", **{"class": "chat", "le": "600.0"}) == 4
    assert gw.metric("sfq_time_to_first_token_seconds_count", **{"class": "batch"}) == 1
    assert gw.metric("sfq_objective_attainment", **{"class": "interactive"}) == 0.0
    assert gw.metric("sfq_objective_attainment", **{"class": "chat"}) == 1.0
    _, text = gw.get("/metrics")
    assert b'sfq_objective_attainment{class="batch"' not in text
    # sfq top: the class rows
    out = subprocess.run([sys.executable, "-m", "sfq", "top", "--once", "--url", gw.url], capture_output=True,
                         text=True, timeout=LIMIT, check=True).stdout
    assert "…" not in out, out  # (120 columns when not a terminal: every column fits)
    row = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()[:1] in (
        ["interactive"], ["chat"], ["batch"])}
    assert row["interactive"][4:7] == ["200", "ms", "0.0%"], out
    assert row["chat"][4:7] == ["600.0", "s", "100.0%"], out
    assert row["batch"][4:6] == ["-", "-"], out


def test_predicted_wait_is_null_before_data_and_grows_with_the_work_ahead(gw: GatewayProcess) -> None:
    def predicted(org: str) -> dict[str, Any]:
        got: dict[str, Any] = _stats(gw)["orgs"][org]["predicted_wait_seconds"]
        return got

    _ask(gw, "chat")
    assert predicted("product") == {"chat": None}  # one attempt ended: too few to predict from
    for _ in range(7):
        _ask(gw, "chat")
    assert predicted("product") == {"chat": 0.0}  # 8 ended; the slot is free: it would start at once
    holder = _Holder(gw)
    try:
        assert predicted("analytics") == {"batch": 0.0}  # the slot is taken, nothing of its own ahead
        with ThreadPoolExecutor(3) as ex:
            jobs = [ex.submit(_ask, gw, "chat")]
            wait_until(lambda: _stats(gw)["waiting"] == 1, "a chat request to wait")
            one = predicted("product")["chat"]
            jobs += [ex.submit(_ask, gw, "chat") for _ in range(2)]
            wait_until(lambda: _stats(gw)["waiting"] == 3, "three chat requests to wait")
            three = predicted("product")["chat"]
            assert one > 0 and three == pytest.approx(3 * one)  # the same cost each, at the same rate
            holder.close()
            holder = None
            for job in jobs:
                job.result(LIMIT)
    finally:
        if holder is not None:
            holder.close()
