"""The README's gateway quick start, through a real ``sfq serve`` (``docs/demo-policy.yaml``)
in front of a real ``sfq demo-backend``, with the official ``openai`` client: analytics floods
the pool with streams, product asks 4 questions while the flood runs. Product's questions wait
a moment for the next free slots (each ``X-SFQ-Queue-Wait`` under one stream's length) and are
never kept waiting a whole second: ``/stats`` expects product what it got, and Jain's index is
1 (issue 42: it read product 20 % against 34 % "expected", Jain 0.89, where sfq had done what
the weights ask).

Nothing is timed: the figures are read after the load ended. The flood's streams are short
(24 tokens at 50 a second), so that a question waits at most about half a second for a slot.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import LIMIT, DemoProcess, GatewayProcess, make_client, wait_until

POLICY = Path(__file__).resolve().parents[2] / "docs" / "demo-policy.yaml"


@pytest.fixture
def demo_gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    demo = DemoProcess(slots=4, tokens_per_second=50.0)
    try:
        cfg = tmp_path / "policy.yaml"
        text = POLICY.read_text()
        assert 'url: "http://127.0.0.1:8001"' in text
        cfg.write_text(text.replace("http://127.0.0.1:8001", demo.url))
        gw = GatewayProcess(cfg)
        try:
            yield gw
        finally:
            gw.stop()
    finally:
        demo.stop()


def _pool(gw: GatewayProcess) -> dict[str, Any]:
    status, body = gw.get("/stats?pool=local")
    assert status == 200, body
    pool: dict[str, Any] = json.loads(body)["pools"]["local"]
    return pool


def test_a_tenant_that_waits_a_moment_is_expected_what_it_got(demo_gateway: GatewayProcess) -> None:
    gw = demo_gateway
    clients = {"analytics": make_client(gw, "sk-analytics-1"), "product": make_client(gw, "sk-product-1")}

    def ask(org: str, tokens: int) -> int:
        """One streamed answer; its X-SFQ-Queue-Wait (ms)."""
        raw = clients[org].chat.completions.with_raw_response.create(
            model="demo", max_tokens=tokens, stream=True, messages=[{"role": "user", "content": "Hi"}])
        assert list(raw.parse())
        return int(raw.headers["x-sfq-queue-wait"])

    with ThreadPoolExecutor(20) as ex:
        flood = [ex.submit(ask, "analytics", 24) for _ in range(16)]
        wait_until(lambda: (p := _pool(gw))["in_flight"] == 4 and p["waiting"] == 12, "the flood to fill the pool")
        questions = [ex.submit(ask, "product", 48) for _ in range(4)]
        waits = {"analytics": [f.result(LIMIT) for f in flood], "product": [f.result(LIMIT) for f in questions]}
    assert max(waits["analytics"]) > 0 and max(waits["product"]) > 0  # both waited for slots
    pool = _pool(gw)
    product, analytics = pool["orgs"]["product"], pool["orgs"]["analytics"]
    assert pool["classes"]["interactive"]["weight"] == 6.0 and product["classes"] == ["interactive"]
    assert product["weight"] == 1.0 and 0 < product["share"] < 6 / 7
    # product got less than its weight's 6/7 because it asked for less, and got all it asked:
    # it is expected what it got; so is analytics, the only org kept waiting
    assert product["expected_share"] == pytest.approx(product["share"], abs=1e-9)
    assert analytics["expected_share"] == pytest.approx(analytics["share"], abs=1e-9)
    assert pool["jain"] == pytest.approx(1.0, abs=1e-9)
    assert product["requests"]["completed"] == 4 and analytics["requests"]["completed"] == 16
