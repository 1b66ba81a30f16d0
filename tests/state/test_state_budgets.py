"""One budget over several gateways: two real ``sfq serve`` processes sharing one real
redis-server. A request of ``max_tokens`` 1 costs exactly 1 (output priced 1,000,000 per 1M
tokens, input 0); org ``team-a`` may spend 10 per UTC day. Thirty requests sent at once,
half to each gateway, while the upstream holds them: the reservation in Redis is one atomic
Lua script, so exactly ten are admitted over both gateways together and twenty are refused
(429 ``budget_exhausted``) before reaching the upstream; the combined spend in Redis settles
at 10, never above. The spend lives in Redis: gateways started afterwards still refuse.
A gateway killed while it holds reservations gives them back within ``lease_seconds``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from state_helpers import LIMIT, Gateway, RedisServer, Upstream, wait_until


def _policy(upstream: Upstream, redis: RedisServer, prefix: str) -> str:
    return f"""\
pools:
  main:
    models: [m]
    backends: [{{url: "{upstream.url}", max_in_flight: 64}}]
    limits: {{max_in_flight: 4}}
    prices: {{input: 0, output: 1000000}}
classes:
  batch: {{weight: 1, max_queue_age_seconds: 60}}
orgs:
  team-a: {{keys: ["sk-a"], classes: [batch], budget: {{amount: 10, per: day}}}}
  team-b: {{keys: ["sk-b"], classes: [batch], budget: {{amount: 3, per: month}}}}
state: {{redis: "{redis.url}", prefix: "{prefix}", lease_seconds: 1}}
"""


def _spent(redis: RedisServer, prefix: str, org: str) -> float:
    import redis as redis_py

    c = redis_py.Redis.from_url(redis.url, socket_timeout=2)
    try:
        keys = [k for k in c.scan_iter(match=f"{prefix}spend:{org}:*") if k.count(b":") == 3]
        return sum(float(c.hget(k, "s") or 0) for k in keys)
    finally:
        c.close()


def _reserved(redis: RedisServer, prefix: str, org: str) -> int:
    import redis as redis_py

    c = redis_py.Redis.from_url(redis.url, socket_timeout=2)
    try:
        now = c.time()
        return sum(int(c.zcount(k, f"({now[0] + now[1] / 1e6}", "+inf"))
                   for k in c.scan_iter(match=f"{prefix}spend:{org}:*:res"))
    finally:
        c.close()


def test_two_gateways_never_spend_more_than_the_budget_together(
        redis_server: RedisServer, upstream: Upstream, tmp_path: Path, prefix: str, gateways: list[Gateway]) -> None:
    cfg = tmp_path / "p.yaml"
    cfg.write_text(_policy(upstream, redis_server, prefix))
    gateways += [Gateway(cfg, wait=False), Gateway(cfg, wait=False)]
    for g in gateways:
        g.listen()
    upstream.rearm()
    before = upstream.total
    statuses: list[int] = [0] * 30

    def go(i: int) -> None:
        statuses[i] = gateways[i % 2].post("sk-a", f"team-a {i}")[0]

    ts = [threading.Thread(target=go, args=(i,)) for i in range(30)]
    for t in ts:
        t.start()
    try:
        wait_until(lambda: statuses.count(429) >= 20, "twenty refusals")
        assert statuses.count(429) == 20
        assert upstream.total - before <= 10  # the refused never reached the upstream
    finally:
        upstream.release()
        for t in ts:
            t.join(LIMIT * 2)
    assert statuses.count(200) == 10 and statuses.count(429) == 20, statuses
    assert upstream.total - before == 10
    wait_until(lambda: _spent(redis_server, prefix, "team-a") >= 10, "the settlements to reach Redis")
    assert _spent(redis_server, prefix, "team-a") == pytest.approx(10.0)
    status, body = gateways[1].post("sk-a", "team-a after")
    assert status == 429 and body["error"]["code"] == "budget_exhausted", body
    for g in gateways:  # a restart: the spend is Redis's, not the gateways'
        g.stop()
    gateways.append(Gateway(cfg))
    status, body = gateways[-1].post("sk-a", "team-a restarted")
    assert status == 429 and body["error"]["code"] == "budget_exhausted", body


def test_a_killed_gateway_gives_its_reservations_back(
        redis_server: RedisServer, upstream: Upstream, tmp_path: Path, prefix: str, gateways: list[Gateway]) -> None:
    cfg = tmp_path / "p.yaml"
    cfg.write_text(_policy(upstream, redis_server, prefix))
    gateways += [Gateway(cfg), Gateway(cfg)]
    upstream.rearm()

    def doomed(i: int) -> None:  # its gateway is killed while it waits: no answer comes
        try:
            gateways[0].post("sk-b", f"team-b {i}")
        except OSError:
            pass

    held = [threading.Thread(target=doomed, args=(i,), daemon=True) for i in range(3)]
    for t in held:
        t.start()
    try:
        wait_until(lambda: _reserved(redis_server, prefix, "team-b") == 3, "three reservations")
        assert gateways[1].post("sk-b", "team-b over")[0] == 429  # the budget of 3 is reserved
        gateways[0].kill()  # it dies holding them: nothing settles, the leases run out
        wait_until(lambda: _reserved(redis_server, prefix, "team-b") == 0, "the reservations to expire")
    finally:
        upstream.release()
    status, body = gateways[1].post("sk-b", "team-b again")
    assert status == 200, body
    wait_until(lambda: _spent(redis_server, prefix, "team-b") >= 1, "the settlement")


def _team_policy(upstream: Upstream, redis: RedisServer, prefix: str) -> str:
    return f"""\
pools:
  main:
    models: [m]
    backends: [{{url: "{upstream.url}", max_in_flight: 64}}]
    prices: {{input: 0, output: 1000000}}
classes:
  batch: {{weight: 1, max_queue_age_seconds: 60}}
orgs:
  acme:
    classes: [batch]
    budget: {{amount: 10, per: day}}
    teams:
      research: {{keys: ["sk-research"], weight: 3, budget: {{amount: 4, per: day}}}}
      product: {{keys: ["sk-product"]}}
state: {{redis: "{redis.url}", prefix: "{prefix}", lease_seconds: 1}}
"""


def test_a_team_budget_and_its_orgs_hold_over_two_gateways_together(
        redis_server: RedisServer, upstream: Upstream, tmp_path: Path, prefix: str, gateways: list[Gateway]) -> None:
    """Nested shares and team budgets through a fleet: a team's request reserves in its team's
    budget and its org's, both or neither, atomically over both gateways. Research (4 a day)
    sends 12 at once: 4 admitted, 8 refused naming the team; then product (no budget of its
    own) sends 12: the org's 10 has 6 left, so 6 are admitted and 6 refused naming the org."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text(_team_policy(upstream, redis_server, prefix))
    gateways += [Gateway(cfg, wait=False), Gateway(cfg, wait=False)]
    for g in gateways:
        g.listen()
    upstream.rearm()
    before = upstream.total
    for key, admitted, who in (("sk-research", 4, "team 'research' of org 'acme'"), ("sk-product", 6, "org 'acme'")):
        statuses: list[int] = [0] * 12
        bodies: list[dict[str, object]] = [{}] * 12

        def go(i: int, key: str = key) -> None:
            statuses[i], bodies[i] = gateways[i % 2].post(key, f"{key} {i}")

        ts = [threading.Thread(target=go, args=(i,)) for i in range(12)]
        for t in ts:
            t.start()
        try:
            wait_until(lambda: statuses.count(429) >= 12 - admitted, f"{12 - admitted} refusals of {key}")
        finally:
            upstream.release()
            for t in ts:
                t.join(LIMIT * 2)
            upstream.rearm()
        assert statuses.count(200) == admitted and statuses.count(429) == 12 - admitted, (key, statuses)
        said = {str(b["error"]["message"]) for b in bodies if "error" in b}  # type: ignore[index]
        assert said and all(who in m and "has spent its budget" in m for m in said), said
    assert upstream.total - before == 10  # the refused never reached the upstream
    wait_until(lambda: _spent(redis_server, prefix, "acme") >= 10, "the settlements to reach Redis")
    assert _spent(redis_server, prefix, "acme") == pytest.approx(10.0)
    assert _spent(redis_server, prefix, "acme\tresearch") == pytest.approx(4.0)
    upstream.release()
