"""Spending budgets through a real ``sfq serve`` process, with the official ``openai`` client.

The pool's prices make a request of ``max_tokens`` N cost exactly N (input 0, output 1 per
token: 1,000,000 per 1M), and the fake upstream reports ``completion_tokens`` = ``max_tokens``.
Org ``a`` may spend 10 per UTC day. Twenty-five requests sent at once while the upstream holds
them: exactly ten are admitted (their reservations cover the budget), fifteen are answered 429
``budget_exhausted`` before any reaches the upstream, with ``Retry-After`` to the end of the
UTC day; the spend settles at 10 and never above it; ``sfq_spend_total`` says so. The spend is
kept in ``state.file``: a restarted gateway still refuses. ``sfq check-config`` shows the
budget. Every wait is bounded; nothing is timed.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import LIMIT, GatewayProcess, Upstream, make_client, wait_until

openai = pytest.importorskip("openai")


def _policy(upstream: Upstream, spend_file: Path) -> str:
    return f"""\
pools:
  main:
    models: [m]
    backends: [{{url: "{upstream.url}", max_in_flight: 4}}]
    prices: {{input: 0, output: 1000000}}
classes:
  batch: {{weight: 1, max_queue_age_seconds: 60}}
orgs:
  a: {{keys: [sk-a], classes: [batch], budget: {{amount: 10, per: day}}}}
  b: {{keys: [sk-b], classes: [batch]}}
state: {{file: "{spend_file}"}}
"""


def _seconds_to_utc_midnight() -> float:
    now = datetime.now(timezone.utc)
    return (now.replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1) - now).total_seconds()


def _send(gw: GatewayProcess, key: str, prompt: str) -> tuple[int, dict[str, str], Any]:
    """One request with the official client: (status, headers, error body or None)."""
    c = make_client(gw, key)
    try:
        c.completions.create(model="m", prompt=prompt, max_tokens=1)
        return 200, {}, None
    except openai.APIStatusError as exc:
        return exc.status_code, dict(exc.response.headers), exc.body
    finally:
        c.close()


def test_parallel_requests_never_overspend_and_the_spend_survives_a_restart(
        gate: Upstream, tmp_path: Path) -> None:
    spend_file = tmp_path / "spend.json"
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(_policy(gate, spend_file))
    before = len(gate.requests)
    gw = GatewayProcess(cfg)
    try:
        with ThreadPoolExecutor(25) as pool:
            futs = [pool.submit(_send, gw, "sk-a", f"hold {i}") for i in range(25)]
            # the refusals come at once; the ten admitted wait for the upstream (held)
            wait_until(lambda: sum(f.done() for f in futs) >= 15, "the refusals")
            refused = [f.result() for f in futs if f.done()]
            assert len(refused) == 15 and all(s == 429 for s, _, _ in refused), refused
            assert len(gate.requests) - before <= 10  # none of the refused reached the upstream
            gate.release()
            results = [f.result(LIMIT) for f in futs]
        assert sorted(s for s, _, _ in results).count(200) == 10
        assert len(gate.requests) - before == 10
        status, headers, body = _send(gw, "sk-a", "one more")
        assert status == 429 and body["code"] == "budget_exhausted", body
        assert headers["x-should-retry"] == "false"
        assert abs(int(headers["retry-after"]) - _seconds_to_utc_midnight()) <= 120  # (a value, not a timing)
        assert _send(gw, "sk-b", "no budget")[0] == 200  # org b has no budget
        assert gw.metric("sfq_spend_total", org="a", pool="main") == pytest.approx(10.0)
        assert gw.metric("sfq_spend_total", org="b", pool="main") == pytest.approx(1.0)
    finally:
        gw.stop()
    again = GatewayProcess(cfg)
    try:
        status, _, body = _send(again, "sk-a", "after the restart")
        assert status == 429 and body["code"] == "budget_exhausted", body
    finally:
        again.stop()


def test_check_config_shows_each_budget(tmp_path: Path, upstream: Upstream) -> None:
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(_policy(upstream, tmp_path / "spend.json"))
    out = subprocess.run([sys.executable, "-m", "sfq", "check-config", "--plain", str(cfg)], capture_output=True,
                         text=True, timeout=LIMIT)
    assert out.returncode == 0, out.stderr
    assert "Budgets" in out.stdout and "per UTC day" in out.stdout
    row = next(line for line in out.stdout.splitlines() if "per UTC day" in line)
    assert row.split()[:2] == ["a", "10"]
    assert "Prices" in out.stdout and "1e+06" in out.stdout


def test_a_bad_budget_stops_the_gateway_naming_the_field(tmp_path: Path, upstream: Upstream) -> None:
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(_policy(upstream, tmp_path / "spend.json").replace("per: day", "per: fortnight"))
    with pytest.raises(RuntimeError, match=r"orgs.a.budget.per: must be one of day, month"):
        GatewayProcess(cfg)
