"""Spending budgets through a real ``sfq serve`` process, with the official ``openai`` client.

The pool's prices make a request of ``max_tokens`` N cost exactly N (input 0, output 1 per
token: 1,000,000 per 1M), and the fake upstream reports ``completion_tokens`` = ``max_tokens``.
Org ``a`` may spend 10 per UTC day. Twenty-five requests sent at once while the upstream holds
them: exactly ten are admitted (their reservations cover the budget), fifteen are answered 429
``budget_exhausted`` before any reaches the upstream, with ``Retry-After`` to the end of the
UTC day; the spend settles at 10 and never above it; ``sfq_spend_total`` says so. The spend is
kept in ``state.file``: a restarted gateway still refuses. ``sfq check-config`` shows the
budget. A team's budget (``orgs.acme.teams.research.budget``) refuses its team while its
sibling team goes on until the org's budget is spent; each refusal names its budget and its
``Retry-After`` is that budget's period end. Every wait is bounded; nothing is timed.
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


def _team_policy(upstream: Upstream, spend_file: Path) -> str:
    """Org acme may spend 8 per UTC month; its team research 5 per UTC day (within acme's);
    its team product has no budget of its own."""
    return f"""\
pools:
  main:
    models: [m]
    backends: [{{url: "{upstream.url}", max_in_flight: 4}}]
    prices: {{input: 0, output: 1000000}}
classes:
  batch: {{weight: 1}}
orgs:
  acme:
    classes: [batch]
    budget: {{amount: 8, per: month}}
    teams:
      research: {{keys: [sk-research], budget: {{amount: 5, per: day}}}}
      product: {{keys: [sk-product]}}
state: {{file: "{spend_file}"}}
"""


def _seconds_to_utc_month_end() -> float:
    now = datetime.now(timezone.utc)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    nxt = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return (nxt - now).total_seconds()


def test_a_team_budget_within_its_orgs_budget(upstream: Upstream, tmp_path: Path) -> None:
    """Research gets exactly five (its day's budget) and is refused naming its team, Retry-After
    to midnight UTC; its sibling product keeps being served until acme's month budget (8) is
    spent, and is then refused naming the org, Retry-After to the month's end. Research's spend
    counted toward acme's; ``sfq_spend_total`` stays per org; a restart keeps both."""
    spend_file = tmp_path / "spend.json"
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(_team_policy(upstream, spend_file))
    gw = GatewayProcess(cfg)
    try:
        research = [_send(gw, "sk-research", f"r{i}") for i in range(6)]
        assert [s for s, _, _ in research] == [200] * 5 + [429], research
        _, headers, body = research[-1]
        assert body["code"] == "budget_exhausted" and "team 'research' of org 'acme'" in body["message"], body
        assert "budget of 8" not in body["message"]
        assert abs(int(headers["retry-after"]) - _seconds_to_utc_midnight()) <= 120  # (a value, not a timing)
        product = [_send(gw, "sk-product", f"p{i}") for i in range(4)]
        assert [s for s, _, _ in product] == [200] * 3 + [429], product  # 5 + 3 = acme's 8
        _, headers, body = product[-1]
        assert body["code"] == "budget_exhausted" and "org 'acme' has spent its budget of 8" in body["message"]
        assert "team" not in body["message"]
        assert abs(int(headers["retry-after"]) - _seconds_to_utc_month_end()) <= 120
        status, headers, body = _send(gw, "sk-research", "both spent")
        assert status == 429 and "team 'research'" in body["message"] and "budget of 8" in body["message"]
        assert abs(int(headers["retry-after"]) - _seconds_to_utc_month_end()) <= 120  # the later of the two ends
        assert gw.metric("sfq_spend_total", org="acme", pool="main") == pytest.approx(8.0)
        status, text = gw.get("/metrics")
        spend = [line for line in text.decode().splitlines() if line.startswith("sfq_spend_total{")]
        assert status == 200 and spend and not any("team" in line for line in spend), spend
    finally:
        gw.stop()
    again = GatewayProcess(cfg)
    try:
        status, _, body = _send(again, "sk-research", "after the restart")
        assert status == 429 and "team 'research'" in body["message"], body
        status, _, body = _send(again, "sk-product", "after the restart")
        assert status == 429 and "org 'acme'" in body["message"], body
    finally:
        again.stop()
    out = subprocess.run([sys.executable, "-m", "sfq", "check-config", "--plain", str(cfg)], capture_output=True,
                         text=True, timeout=LIMIT)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.lstrip().startswith("acme.teams.research"))
    assert row.split()[:5] == ["acme.teams.research", "5", "per", "UTC", "day"]


def test_a_bad_team_budget_stops_the_gateway_naming_the_field(tmp_path: Path, upstream: Upstream) -> None:
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(_team_policy(upstream, tmp_path / "spend.json").replace("per: day", "per: week"))
    with pytest.raises(RuntimeError, match=r"orgs.acme.teams.research.budget.per: must be one of day, month"):
        GatewayProcess(cfg)
