"""Several real ``sfq serve`` processes sharing one queue through a real redis-server, in front
of one loopback upstream: global limits and org rates, the order across gateways, a gateway
killed with SIGKILL while it holds slots, Redis stopped and restarted mid-run (and down at
start), and a gateway whose policy file differs."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import pytest
from state_helpers import LIMIT, Gateway, RedisServer, Upstream, free_port, policy_yaml, wait_until


def _fire(jobs: list[tuple[Gateway, str, str]]) -> list[int]:
    """Send every ``(gateway, key, prompt)`` at once (a thread each); the statuses, in order."""
    out = [0] * len(jobs)

    def go(i: int) -> None:
        g, key, prompt = jobs[i]
        out[i] = g.post(key, prompt)[0]

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(LIMIT * 2)
    return out


def _lease_count(redis_url: str, prefix: str, key: str) -> int:
    import redis

    c = redis.Redis.from_url(redis_url, socket_timeout=2)
    try:
        now = c.time()
        return int(c.zcount(f"{prefix}lease:{key}", f"({now[0] + now[1] / 1e6}", "+inf"))
    finally:
        c.close()


def test_two_gateways_keep_one_pool_limit_and_one_org_rate(redis_server: RedisServer, upstream: Upstream,
                                                            tmp_path: Path, prefix: str, gateways: list[Gateway]):
    upstream.peak = 0
    upstream.delay = 0.03
    p = tmp_path / "p.yaml"
    p.write_text(policy_yaml(upstream.url, redis_server.url, pool_limit=4, prefix=prefix,
                             orgs_extra="  capped:\n    keys: [sk-capped]\n    classes: [batch]\n"
                                        "    requests_per_minute: 3\n"))
    g1, g2 = Gateway(p), Gateway(p)
    gateways += [g1, g2]
    jobs = [((g1, g2)[i % 2], ("sk-a", "sk-b")[i % 3 % 2], f"x{i}") for i in range(48)]
    assert _fire(jobs) == [200] * 48
    assert upstream.peak == 4, f"the upstream saw {upstream.peak} at once; the pool's limit is 4 for both gateways"
    # an org limited to 3 a minute gets 3, not 3 per gateway (a token refills every 20 s)
    statuses = [g.post("sk-capped", "capped")[0] for g in (g1, g2, g1, g2, g1, g2)]
    assert sorted(statuses) == [200, 200, 200, 429, 429, 429], statuses


def test_two_flows_on_two_gateways_get_their_weighted_shares(redis_server: RedisServer, upstream: Upstream,
                                                               tmp_path: Path, prefix: str, gateways: list[Gateway]):
    upstream.delay = 0.01
    p = tmp_path / "p.yaml"
    # team-a weight 3 on one gateway, team-b weight 1 on the other, one slot: 3 of every 4 go to team-a
    p.write_text(policy_yaml(upstream.url, redis_server.url, pool_limit=1, prefix=prefix)
                 .replace("  team-a:\n", "  team-a:\n    weight: 3\n"))
    g1, g2 = Gateway(p), Gateway(p)
    gateways += [g1, g2]
    start = len(upstream.order)
    n = 24
    jobs = [(g1, "sk-a", f"sk-a {i}") for i in range(n)] + [(g2, "sk-b", f"sk-b {i}") for i in range(n)]
    assert _fire(jobs) == [200] * (2 * n)
    seen = upstream.order[start:]
    window = seen[4:4 + 24]  # while both are backlogged (the first few went as they arrived)
    assert 18 - 4 <= window.count("sk-a") <= 18 + 4, seen


def test_a_killed_gateway_frees_its_slots_within_the_lease(redis_server: RedisServer, tmp_path: Path, prefix: str,
                                                           gateways: list[Gateway]):
    up = Upstream(delay=0.0).start()
    try:
        p = tmp_path / "p.yaml"
        lease = 1.5
        p.write_text(policy_yaml(up.url, redis_server.url, pool_limit=2, prefix=prefix, lease=lease))
        g1, g2 = Gateway(p), Gateway(p)
        gateways += [g1, g2]
        up.hold = True
        def doomed(i: int) -> None:
            with contextlib.suppress(OSError):  # its gateway dies under it
                g1.post("sk-a", f"held {i}", 5.0)

        held = [threading.Thread(target=doomed, args=(i,)) for i in range(2)]
        for t in held:
            t.start()
        wait_until(lambda: up.now == 2, "the killed gateway's two requests to reach the upstream")
        g1.kill()
        assert _lease_count(redis_server.url, prefix, "pool:main") == 2  # still counted: they may be running
        up.hold = False  # the next requests answer at once
        status, _ = g2.post("sk-b", "after")  # waits for the dead gateway's leases to expire
        assert status == 200
        # its own slot is let go just after its answer went out; the dead gateway's within the lease
        wait_until(lambda: _lease_count(redis_server.url, prefix, "pool:main") == 0, "every slot to be free",
                   limit=lease + 2.0)
        up.release()
        for t in held:
            t.join(LIMIT)
    finally:
        up.release()
        up.stop()


def test_on_loss_refuse_redis_down_answers_503_and_the_gateways_recover(upstream: Upstream, tmp_path: Path,
                                                                        prefix: str, gateways: list[Gateway]):
    r = RedisServer(free_port())
    p = tmp_path / "p.yaml"
    p.write_text(policy_yaml(upstream.url, r.url, pool_limit=2, prefix=prefix, on_loss="refuse"))
    try:
        # down at start: the gateway starts, says why, refuses; Redis comes: it recovers by itself
        g = Gateway(p)
        gateways.append(g)
        code, body = g.health()
        assert code == 503 and body["status"] == "state_unavailable" and "cannot be reached" in body["reason"]
        code, err = g.post("sk-a", "x")
        assert code == 503 and err["error"]["code"] == "state_unavailable"
        r.start()
        wait_until(lambda: g.health()[0] == 200, "the gateway to recover when Redis comes")
        assert g.post("sk-a", "x")[0] == 200
        # stopped mid-run: what runs finishes; new requests 503 with the reason; back when Redis is
        upstream.hold = True
        out: list[int] = []
        t = threading.Thread(target=lambda: out.append(g.post("sk-a", "held")[0]))
        before = upstream.now
        t.start()
        wait_until(lambda: upstream.now > before, "the request to reach the upstream")
        r.stop()
        wait_until(lambda: g.health()[0] == 503, "/health to say Redis is gone")
        code, err = g.post("sk-b", "y")
        assert code == 503 and "shared state" in err["error"]["message"]
        upstream.release()
        t.join(LIMIT)
        assert out == [200]
        r.start()  # empty: the next busy period starts level
        wait_until(lambda: g.health()[0] == 200, "the gateway to recover when Redis returns")
        assert g.post("sk-b", "y")[0] == 200
    finally:
        upstream.release()
        r.stop()


def test_a_gateway_with_another_policy_file_refuses_to_start(redis_server: RedisServer, upstream: Upstream,
                                                             tmp_path: Path, prefix: str, gateways: list[Gateway]):
    p1, p2 = tmp_path / "p1.yaml", tmp_path / "p2.yaml"
    p1.write_text(policy_yaml(upstream.url, redis_server.url, pool_limit=4, prefix=prefix))
    p2.write_text(policy_yaml(upstream.url, redis_server.url, pool_limit=5, prefix=prefix))
    gateways.append(Gateway(p1))
    with pytest.raises(RuntimeError, match="different policy"):
        Gateway(p2)


def test_a_flow_gets_its_share_whichever_gateways_its_requests_reach(
        redis_server: RedisServer, upstream: Upstream, tmp_path: Path, prefix: str, gateways: list[Gateway]):
    upstream.delay = 0.01
    p = tmp_path / "p.yaml"
    p.write_text(policy_yaml(upstream.url, redis_server.url, pool_limit=2, prefix=prefix))
    g1, g2 = Gateway(p), Gateway(p)
    gateways += [g1, g2]
    start = len(upstream.order)
    n = 24
    # team-a only reaches the first gateway; team-b reaches both (and shares the first with team-a)
    jobs = [(g1, "sk-a", f"sk-a {i}") for i in range(n)] + [((g1, g2)[i % 2], "sk-b", f"sk-b {i}") for i in range(n)]
    assert _fire(jobs) == [200] * (2 * n)
    window = upstream.order[start:][4:4 + 24]
    assert 12 - 4 <= window.count("sk-a") <= 12 + 4, upstream.order[start:]


def _metric(g: Gateway, name: str, *labels: str) -> float:
    """The sum of the gateway's ``name`` series whose labels include every one of ``labels``."""
    import urllib.request

    with urllib.request.urlopen(g.url + "/metrics", timeout=LIMIT) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(x in line for x in labels))


def _waiting(g: Gateway, org: str) -> float:
    """The gateway's own count of ``org``'s requests waiting (``sfq_queue_length``)."""
    return _metric(g, "sfq_queue_length", f'org="{org}"')


@pytest.mark.parametrize("n", [1, 2])
def test_queue_space_is_shared_fairly_through_real_gateways(redis_server: RedisServer, tmp_path: Path, prefix: str,
                                                            gateways: list[Gateway], n: int):
    """team-a fills its class's queue (one gateway; or, with two sharing Redis, team-a on one
    and team-b on the other): team-b, with nothing waiting, is not refused because of team-a's
    requests; team-a's newest waiting request gives its place up (429 ``queue_full``, with
    Retry-After), and a newcomer of team-a, which holds the most, is refused. Every request
    gets one answer, seen by the official openai client."""
    openai = pytest.importorskip("openai")
    up = Upstream(delay=0.0).start()
    try:
        p = tmp_path / "p.yaml"
        text = policy_yaml(up.url, redis_server.url if n == 2 else None, pool_limit=1, prefix=prefix)
        p.write_text(text.replace("batch: {weight: 1, max_queue_age_seconds: 60}",
                                  "batch: {weight: 1, max_queue_age_seconds: 60, max_queue_length: 3}"))
        gs = [Gateway(p) for _ in range(n)]
        gateways += gs
        ga, gb = gs[0], gs[-1]
        up.hold = True
        out: dict[str, Any] = {}

        def send(g: Gateway, key: str, name: str) -> None:
            c = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0, timeout=LIMIT * 2)
            try:
                c.completions.create(model="m", prompt=f"{key} {name}", max_tokens=1)
                out[name] = 200
            except openai.APIStatusError as exc:
                out[name] = (exc.status_code, (exc.body or {}).get("code"), exc.response.headers.get("retry-after"),
                             exc.message)

        threads = []

        def go(g: Gateway, key: str, name: str) -> None:
            t = threading.Thread(target=send, args=(g, key, name))
            t.start()
            threads.append(t)

        go(ga, "sk-a", "a0")
        wait_until(lambda: up.now == 1, "team-a's first request to run")
        for i in (1, 2, 3):  # team-a fills the queue (3 places), one at a time
            go(ga, "sk-a", f"a{i}")
            wait_until(lambda: _waiting(ga, "team-a") == i, f"team-a's request {i} to wait")
        send(ga, "sk-a", "a4")  # team-a holds the most: refused at once, nobody loses a place
        assert out["a4"][:2] == (429, "queue_full") and out["a4"][2] is not None, out["a4"]
        go(gb, "sk-b", "b0")  # team-b has nothing waiting: it gets a place, team-a's newest gives it up
        wait_until(lambda: "a3" in out, "team-a's newest waiting request to be answered")
        assert out["a3"][:2] == (429, "queue_full") and out["a3"][2] is not None, out["a3"]
        assert "went to another org" in out["a3"][3], out["a3"]
        up.release()
        for t in threads:
            t.join(LIMIT * 2)
        assert {k: out[k] for k in ("a0", "a1", "a2", "b0")} == dict.fromkeys(("a0", "a1", "a2", "b0"), 200), out
        assert up.served["sk-a"] == 3 and up.served["sk-b"] == 1  # the refused ones never reached it
        # the gateways count each request once, as the client and the upstream saw it
        count = {o: sum(_metric(g, "sfq_requests_total", 'org="team-a"', f'outcome="{o}"') for g in gs)
                 for o in ("completed", "refused")}
        assert count == {"completed": 3.0, "refused": 2.0}, count
    finally:
        up.release()
        up.stop()


def _most_in_a_window(times: list[float], window: float) -> int:
    """The most of ``times`` (seconds) that fall in one window of ``window`` seconds."""
    ts = sorted(times)
    j = most = 0
    for i, t in enumerate(ts):
        while ts[j] <= t - window:
            j += 1
        most = max(most, i - j + 1)
    return most


def test_an_org_over_its_rate_waits_for_its_tokens_over_both_gateways(
        redis_server: RedisServer, upstream: Upstream, tmp_path: Path, prefix: str, gateways: list[Gateway]):
    """``on_limit: wait`` over two gateways sharing Redis: a burst over the org's rate, half
    on each, with ``X-SFQ-Timeout`` long enough, all succeed; the org's one bucket (in Redis)
    takes each token ahead once, whichever gateway asks, so the upstream never sees more in any
    window than the bucket and its refills allow (one bucket per gateway would have let the
    whole burst through at once). One whose deadline comes before its token is refused with
    ``retry-after-ms`` within the refill. Counts, not durations (a slow machine only spreads
    the starts more)."""
    upstream.delay = 0.0
    rpm, over = 30, 4  # a bucket of 30, a token every 2 s; 4 over it
    p = tmp_path / "p.yaml"
    p.write_text(policy_yaml(upstream.url, redis_server.url, pool_limit=64, prefix=prefix,
                             orgs_extra=f"  waiter:\n    keys: [sk-waiter]\n    classes: [batch]\n"
                                        f"    requests_per_minute: {rpm}\n    on_limit: wait\n"))
    g1, g2 = Gateway(p), Gateway(p)
    gateways += [g1, g2]
    n = rpm + over
    out = [0] * n

    def go(i: int) -> None:
        out[i] = (g1, g2)[i % 2].post("sk-waiter", f"waiter {i}", timeout=LIMIT * 2,
                                      headers={"X-SFQ-Timeout": "60"})[0]

    ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(LIMIT * 3)
    assert out == [200] * n
    burst = [t for t, x in list(upstream.arrivals) if x.startswith("waiter ")]
    assert len(burst) == n
    assert _most_in_a_window(burst, 1.9) <= rpm + 1, sorted(b - min(burst) for b in burst)
    # the bucket is spent: with 0.5 s to wait at most, the request is refused (the next token is
    # up to 2 s away) or waits for a token that comes sooner; a refusal says when the token comes
    for i in range(rpm + 5):
        code, body = (g1, g2)[i % 2].post("sk-waiter", f"waiter late {i}", headers={"X-SFQ-Timeout": "0.5"})
        if code == 429:
            break
        assert code == 200
    assert code == 429 and body["error"]["code"] == "rate_limited", body
    assert "all gateways together" in body["error"]["message"]
