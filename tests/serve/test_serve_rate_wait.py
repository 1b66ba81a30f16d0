"""Rate limits that wait (issue 42, part 3) through a real ``sfq serve``, read with the official
``openai`` client: a burst over an org's ``requests_per_minute`` with ``X-SFQ-Timeout`` long
enough all succeed, the ones over the rate parked until their tokens refill (the upstream never
sees more than the bucket and its refills allow in any window) while another org's request
goes through at once; one whose deadline comes before its token is refused (429, with
``Retry-After`` and ``retry-after-ms``); ``on_limit: refuse`` is today's 429 at once.

No assertion measures time: the waits are checked as counts (arrivals at the upstream per
window, an upper bound that a slow machine only makes easier to meet) and as orders (another
org's request reaches the upstream before the last parked one). The refusal's figure is the
engine's (tests/policy/test_policy_rate_wait.py checks it against the real refill).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from serve_helpers import LIMIT, GatewayProcess, Upstream, make_client, wait_until

RPM = 30  # a bucket of 30, a token every 2 s
OVER = 3  # requests over the bucket in the burst


@pytest.fixture(scope="module")
def gw(upstream: Upstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    p: Path = tmp_path_factory.mktemp("rate_wait") / "policy.yaml"
    p.write_text(f"""\
pools:
  main:
    models: [m]
    backends:
      - {{url: "{upstream.url}", max_in_flight: 100, api_key_env: SFQ_TEST_UPSTREAM_KEY}}
classes:
  batch: {{weight: 1}}
orgs:
  waiter: {{keys: ["sk-waiter"], classes: [batch], requests_per_minute: {RPM}, on_limit: wait}}
  refuser: {{keys: ["sk-refuser"], classes: [batch], requests_per_minute: {RPM}}}
  other: {{keys: ["sk-other"], classes: [batch]}}
""")
    g = GatewayProcess(p)
    try:
        yield g
    finally:
        g.stop()


def _most_in_a_window(times: list[float], window: float) -> int:
    """The most of ``times`` (seconds) that fall in one window of ``window`` seconds."""
    ts = sorted(times)
    j = 0
    most = 0
    for i, t in enumerate(ts):
        while ts[j] <= t - window:
            j += 1
        most = max(most, i - j + 1)
    return most


def _rate_waiting(gw: GatewayProcess) -> int:
    """``/health``'s count of the pool's requests parked until their org's tokens refill."""
    _, body = gw.get("/health?pool=main")
    return int(json.loads(body)["pools"]["main"]["rate_waiting"])


def _ask(client: Any, text: str, timeout: float | None) -> tuple[int, dict[str, str]]:
    headers = {} if timeout is None else {"X-SFQ-Timeout": str(timeout)}
    try:
        raw = client.completions.with_raw_response.create(model="m", prompt=text, max_tokens=1,
                                                          extra_headers=headers)
        return raw.http_response.status_code, dict(raw.headers)
    except openai.APIStatusError as exc:
        return exc.status_code, dict(exc.response.headers)


def test_a_burst_over_the_rate_all_succeed_spaced_by_the_refill(gw: GatewayProcess, upstream: Upstream) -> None:
    waiter, other = make_client(gw, "sk-waiter"), make_client(gw, "sk-other")
    n = RPM + OVER
    with ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(_ask, waiter, f"burst-{i}", 60.0) for i in range(n)]
        wait_until(lambda: _rate_waiting(gw) >= 1, "a request of the burst to be parked for its token")
        # another org goes through at once: the parked requests hold no slot and no place in line
        status, _ = _ask(other, "other-while-parked", None)
        assert status == 200
        results = [f.result(LIMIT * 2) for f in futs]
    assert [s for s, _ in results] == [200] * n
    arrivals = [(t, x) for t, x in list(upstream.arrivals) if x.startswith(("burst-", "other-while-parked"))]
    burst = [t for t, x in arrivals if x.startswith("burst-")]
    assert len(burst) == n
    # the rate held at the upstream: in any 1.9 s (less than a refill), the bucket and one refill
    assert _most_in_a_window(burst, 1.9) <= RPM + 1, sorted(b - burst[0] for b in burst)
    order = [x for _, x in sorted(arrivals)]
    assert order.index("other-while-parked") < n, order  # before the last parked one, never behind it
    assert _rate_waiting(gw) == 0


def test_a_deadline_before_the_refill_is_refused_with_the_refill(gw: GatewayProcess) -> None:
    waiter = make_client(gw, "sk-waiter")
    # spend what is left of the bucket: with 0.5 s to wait at most, a request waits for a token
    # that refills sooner and is refused when it refills later
    for i in range(RPM + 5):
        status, h = _ask(waiter, f"spend-{i}", 0.5)
        if status == 429:
            break
        assert status == 200
    assert status == 429
    ms = int(h["retry-after-ms"])
    assert 500 <= ms <= 60_000 / RPM and h["retry-after"] == str(math.ceil(ms / 1000)), h
    assert h["x-should-retry"] == "true"


def test_on_limit_refuse_is_todays_429_at_once(gw: GatewayProcess) -> None:
    refuser = make_client(gw, "sk-refuser")
    statuses = []
    for i in range(RPM + 5):  # (a token may refill meanwhile)
        status, h = _ask(refuser, f"refuser-{i}", 600.0)  # it could wait 10 min, but its org refuses
        statuses.append(status)
        if status == 429:
            break
    assert statuses[:RPM] == [200] * RPM and statuses[-1] == 429, statuses
    assert 0 < int(h["retry-after-ms"]) <= 60_000 / RPM and int(h["retry-after"]) >= 1
