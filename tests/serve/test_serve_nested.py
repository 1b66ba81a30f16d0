"""Nested shares through a real ``sfq serve`` (issue 30): orgs, their teams, the users inside a
team (``X-SFQ-User``), counted at the upstream; the official ``openai`` client.

Orgs X and Y of weight 1; X's teams t1 and t2 of weight 1; t1 has ten users, t2 one, Y one;
everyone floods a pool of one slot. Y gets 50 %, each team of X 25 % and each user of t1
2.5 %, whatever the number of users in t1 (a flat per-user split would give t1 10/12).
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import GatewayProcess, Upstream, make_client, wait_until

openai = pytest.importorskip("openai")

T1_USERS = [f"u{i}" for i in range(10)]
WARMUP = 60  # upstream arrivals left out: until every client has its requests waiting
COUNTED = 400


def nested_policy(upstream_url: str, max_users: int = 1000) -> str:
    return f"""\
pools:
  main:
    models: [m]
    backends:
      - {{url: "{upstream_url}", max_in_flight: 1}}
classes:
  batch: {{weight: 1}}
orgs:
  X:
    classes: [batch]
    users: equal
    max_users: {max_users}
    teams:
      t1: {{weight: 1, keys: ["sk-x-t1"]}}
      t2: {{weight: 1, keys: ["sk-x-t2"]}}
  Y:
    keys: ["sk-y"]
    classes: [batch]
"""


@pytest.fixture(scope="module")
def upstream() -> Any:
    up = Upstream().start()
    up.release()
    try:
        yield up
    finally:
        up.stop()


@pytest.fixture(scope="module")
def gateway(upstream: Upstream, tmp_path_factory: pytest.TempPathFactory) -> Any:
    p: Path = tmp_path_factory.mktemp("nested") / "policy.yaml"
    p.write_text(nested_policy(upstream.url, max_users=11))
    gw = GatewayProcess(p)
    try:
        yield gw
    finally:
        gw.stop()


def _flood(gw: GatewayProcess, key: str, user: str | None, who: str, stop: threading.Event,
           errors: list[BaseException]) -> None:
    client = make_client(gw, key)
    headers = {"X-SFQ-User": user} if user is not None else {}
    n = 0
    try:
        while not stop.is_set():
            n += 1
            client.completions.create(model="m", prompt=f"{who:<10} {n:05d}", max_tokens=1, extra_headers=headers)
    except BaseException as exc:  # noqa: BLE001 (reported by the test)
        if not stop.is_set():
            errors.append(exc)


def test_nested_shares_counted_at_the_upstream(gateway: GatewayProcess, upstream: Upstream) -> None:
    clients = [("sk-x-t1", u, f"X/t1/{u}") for u in T1_USERS] + [("sk-x-t2", "solo", "X/t2/solo"),
                                                                  ("sk-y", None, "Y")]
    stop = threading.Event()
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_flood, args=(gateway, key, user, who, stop, errors), daemon=True)
               for key, user, who in clients for _ in range(3)]  # three at a time: always one waiting
    start = len(upstream.requests)
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(upstream.requests) - start >= WARMUP + COUNTED or errors, "the upstream count",
                   limit=120.0)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    texts = upstream.texts()[start + WARMUP:start + WARMUP + COUNTED]
    got = Counter(t.split()[0] for t in texts)
    share = {k: 100.0 * v / COUNTED for k, v in got.items()}
    assert abs(share.get("Y", 0.0) - 50.0) <= 5.0, share
    t1 = sum(v for k, v in share.items() if k.startswith("X/t1/"))
    assert abs(t1 - 25.0) <= 5.0, share
    assert abs(share.get("X/t2/solo", 0.0) - 25.0) <= 5.0, share
    for u in T1_USERS:
        assert abs(share.get(f"X/t1/{u}", 0.0) - 2.5) <= 5.0, share
    # and the ten users split their team's part evenly among themselves, not by luck of arrival
    per_user = [got.get(f"X/t1/{u}", 0) for u in T1_USERS]
    assert max(per_user) - min(per_user) <= 3, per_user


def test_bad_user_header_is_a_400_naming_it(gateway: GatewayProcess) -> None:
    client = make_client(gateway, "sk-x-t1")
    for bad in ("x" * 129, "ana\tbob"):
        with pytest.raises(openai.BadRequestError) as ei:
            client.completions.create(model="m", prompt="bad user", max_tokens=1, extra_headers={"X-SFQ-User": bad})
        err = ei.value.body
        assert isinstance(err, dict) and err.get("param") == "X-SFQ-User", err
        assert "X-SFQ-User" in str(err.get("message")), err
    # 128 bytes exactly is fine
    client.completions.create(model="m", prompt="ok user", max_tokens=1, extra_headers={"X-SFQ-User": "y" * 128})


def test_too_many_live_users_is_a_429_with_its_reason(gateway: GatewayProcess, upstream: Upstream) -> None:
    """t1 may have 11 live users (the file's max_users): with 11 of them holding a request, a
    twelfth is refused with 429 ``too_many_users``; a user already live is not."""
    upstream.rearm()  # "hold" requests wait at the upstream until released
    held: list[threading.Thread] = []
    try:
        for i in range(11):
            c = make_client(gateway, "sk-x-t1")
            th = threading.Thread(target=lambda c=c, i=i: c.completions.create(
                model="m", prompt=f"hold {i}", max_tokens=1, extra_headers={"X-SFQ-User": f"live{i}"}), daemon=True)
            th.start()
            held.append(th)
        wait_until(lambda: gateway.metric("sfq_queue_length", org="X") + gateway.metric("sfq_in_flight", org="X")
                   >= 11, "eleven requests of X accepted")
        client = make_client(gateway, "sk-x-t1")
        with pytest.raises(openai.RateLimitError) as ei:
            client.completions.create(model="m", prompt="twelfth", max_tokens=1,
                                      extra_headers={"X-SFQ-User": "newcomer"})
        assert ei.value.body.get("code") == "too_many_users", ei.value.body
        assert gateway.metric("sfq_refusals_total", org="X", reason="too_many_users") >= 1
    finally:
        upstream.release()
        for th in held:
            th.join(30)
    # once they are done, a new user is let in
    make_client(gateway, "sk-x-t1").completions.create(model="m", prompt="after", max_tokens=1,
                                                       extra_headers={"X-SFQ-User": "newcomer"})


def test_a_stream_of_a_team_user_goes_through(gateway: GatewayProcess, upstream: Upstream) -> None:
    """A streamed request of a user of a team: admitted in its nested flow, relayed whole."""
    client = make_client(gateway, "sk-x-t2")
    before = gateway.metric("sfq_requests_total", org="X", outcome="completed")
    chunks = list(client.completions.create(model="m", prompt="stream of a team user", max_tokens=3, stream=True,
                                            extra_headers={"X-SFQ-User": "streamer"}))
    assert chunks and any(c.choices for c in chunks)
    assert gateway.metric("sfq_requests_total", org="X", outcome="completed") == before + 1
    assert "stream of a team user" in upstream.texts()
