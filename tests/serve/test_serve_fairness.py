"""The fair-share figures of a real ``sfq serve`` (``GET /stats``, ``sfq_share``,
``sfq_expected_share``, ``sfq_fairness_jain``), with the official ``openai`` client against
loopback upstreams (``support.workload``'s engine, ``serve_helpers``' upstream).

Nothing here is timed: the shares are of the work done, read after the load ran.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import GatewayProcess, Upstream, make_client, policy_yaml, wait_until
from support.workload import Fleet, OrgLoad, policy_text, run_workload, service, shares

openai = pytest.importorskip("openai")


def _stats(gw: GatewayProcess, query: str = "") -> dict[str, Any]:
    status, body = gw.get("/stats" + query)
    assert status == 200, body
    out: dict[str, Any] = json.loads(body)
    return out


def test_two_orgs_of_weight_1_and_2_flooding_get_a_third_and_two_thirds(tmp_path: Path) -> None:
    """Orgs A (weight 1) and B (weight 2) flood one pool (8 clients each, 4 slots). Read while
    both are backlogged, past the warm-up (a 4 s window ending 6 s into an 8 s load),
    ``/stats`` and ``/metrics`` say A was served about a third and B two thirds, that the
    weights promised exactly that, and Jain's index is about 1; the served cost they report is
    what the engine delivered."""
    orgs = [OrgLoad("A", "sk-A", clients=8, weight=1), OrgLoad("B", "sk-B", clients=8, weight=2)]
    fleet = Fleet((1.0,), slots=4, unit=0.002).start()
    try:
        cfg = tmp_path / "policy.yaml"
        cfg.write_text(policy_text([e.url for e in fleet.engines], orgs) + "metrics: {window_seconds: 4}\n")
        gw = GatewayProcess(cfg)
        try:
            async def read_during() -> tuple[dict[str, Any], str]:
                await asyncio.sleep(6.0)
                st = await asyncio.to_thread(_stats, gw)
                return st, (await asyncio.to_thread(gw.get, "/metrics"))[1].decode()

            async def both() -> tuple[Any, tuple[dict[str, Any], str]]:
                return await asyncio.gather(run_workload(gw.url, orgs, 8.0, fleet.log), read_during())

            res, (st, text) = asyncio.run(both())
            assert all(not e for e in res.errors.values()), res.errors
            after = _stats(gw)
            after_text = gw.get("/metrics")[1].decode()
        finally:
            gw.stop()
    finally:
        fleet.stop()
    assert st["window_seconds"] == 4 and set(st["pools"]) == {"main"}
    pool = st["pools"]["main"]
    a, b = pool["orgs"]["A"], pool["orgs"]["B"]
    assert set(pool["orgs"]) == {"A", "B"}  # no _other: nothing beyond max_org_series
    assert (a["weight"], b["weight"]) == (1.0, 2.0)
    assert abs(a["share"] - 1 / 3) < 0.05 and abs(b["share"] - 2 / 3) < 0.05, (a, b)
    assert abs(a["expected_share"] - 1 / 3) < 0.01 and abs(b["expected_share"] - 2 / 3) < 0.01, (a, b)
    assert pool["jain"] > 0.98 and pool["served_cost"] == pytest.approx(a["served_cost"] + b["served_cost"])
    assert a["waiting"] + b["waiting"] > 0 and pool["waiting"] == a["waiting"] + b["waiting"]
    assert a["oldest_wait_seconds"] is not None and a["wait_p99"] >= a["wait_p50"] > 0
    # the same figures as series
    series = _parse(text)
    assert series["sfq_share", (("org", "A"), ("pool", "main"))] == pytest.approx(a["share"], abs=0.03)
    assert series["sfq_expected_share", (("org", "B"), ("pool", "main"))] == pytest.approx(b["expected_share"],
                                                                                            abs=0.01)
    assert series["sfq_fairness_jain", (("pool", "main"),)] > 0.98
    assert series["sfq_org_weight", (("org", "B"),)] == 2.0
    # every request was counted: what each org completed, and the cost served since the start is
    # what the engine delivered (prompt + 2 x output, the policy's cost)
    delivered = service(res.log, ["A", "B"])
    for org in ("A", "B"):
        assert after["pools"]["main"]["orgs"][org]["requests"]["completed"] == res.ok[org]
        assert series_total(after_text, org) == pytest.approx(delivered[org], rel=0.01), (org, delivered)
    assert shares(delivered)["A"] < 0.45  # (the run as a whole was fair too)


def _parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def series_total(text: str, org: str) -> float:
    """``sfq_served_cost_total`` of ``org``, over its classes."""
    return sum(v for (name, labels), v in _parse(text).items()
               if name == "sfq_served_cost_total" and ("org", org) in labels)


def test_one_org_alone_is_promised_everything_and_idle_orgs_are_absent(tmp_path: Path, upstream: Upstream,
                                                                        refused_url: str) -> None:
    """Before any request no org has figures or series; one org alone is promised (and gets)
    the whole pool; ``?pool=`` narrows, an unknown pool is a 404."""
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(upstream.url, refused_url))
    gw = GatewayProcess(cfg)
    try:
        before = _stats(gw)
        assert before["window_seconds"] == 60.0  # the default
        assert before["pools"]["main"]["orgs"] == {} and before["pools"]["main"]["jain"] is None
        assert "sfq_share{" not in gw.get("/metrics")[1].decode()
        c = make_client(gw, "sk-b")
        for _ in range(3):
            c.completions.create(model="m", prompt="alone", max_tokens=4)
        st = _stats(gw, "?pool=main")
        status, missing = gw.get("/stats?pool=nope")
    finally:
        gw.stop()
    assert set(st["pools"]) == {"main"}  # ?pool= narrows
    b = st["pools"]["main"]["orgs"]["team-b"]
    assert set(st["pools"]["main"]["orgs"]) == {"team-b"}  # team-a and limited sent nothing: absent
    assert b["expected_share"] == pytest.approx(1.0) and b["share"] == pytest.approx(1.0)
    assert b["served_cost"] == pytest.approx(3 * (len("alone") + 2 * 4))  # usage x the policy's weights
    assert b["requests"]["completed"] == 3 and st["pools"]["main"]["jain"] == pytest.approx(1.0)
    assert status == 404 and b"unknown_pool" in missing


def _requests_total(gw: GatewayProcess) -> float:
    return gw.metric("sfq_requests_total")


def test_streams_whose_clients_hang_up_count_what_passed(tmp_path: Path, upstream: Upstream, refused_url: str) -> None:
    """team-a's clients hang up on two of three streams after 20 tokens, team-b's on all of
    theirs: ``sfq_served_cost_total`` and ``/stats`` say what the upstream delivered (counted
    there, token by token), and each access-log line's ``cost_charged`` is what the engine
    charged (charged as served: the prompt's minimum charge at dispatch, then each token as it
    passed)."""
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(upstream.url, refused_url) + "cost: {input_weight: 0, output_weight: 1, charge: served}\n")
    gw = GatewayProcess(cfg)
    try:
        texts = {"team-a": [], "team-b": []}  # type: dict[str, list[str]]
        for org, key, hang in (("team-a", "sk-a", False), ("team-a", "sk-a", True), ("team-a", "sk-a", True),
                               ("team-b", "sk-b", True), ("team-b", "sk-b", True)):
            text = f"part20-{org}-{len(texts[org])}" if hang else f"whole-{org}"
            texts[org].append(text)
            c = make_client(gw, key)
            with c.completions.create(model="m", prompt=text, max_tokens=30, stream=True,
                                      extra_headers={"X-SFQ-Class": "batch"}) as s:
                got = 0
                for ch in s:
                    got += sum(len(x.text) for x in ch.choices)
                    if hang and got == 20:
                        break  # the client hangs up
            assert got == (20 if hang else 30)
            if hang:
                wait_until(lambda: text in upstream.aborted, "the gateway to abort the upstream call")
            wait_until(lambda: len(gw.access()) == sum(map(len, texts.values())), "the access-log lines")
        wait_until(lambda: _stats(gw)["pools"]["main"]["in_flight"] == 0, "nothing running")
        delivered = {org: sum(upstream.tokens.get(t, 0) for t in ts) for org, ts in texts.items()}
        assert delivered == {"team-a": 70, "team-b": 40}
        served = {org: gw.metric("sfq_served_cost_total", org=org) for org in texts}
        st = _stats(gw)["pools"]["main"]["orgs"]
        lines = gw.access()
    finally:
        gw.stop()
    assert served == {"team-a": 70.0, "team-b": 40.0}  # output_weight 1: one cost unit a token
    assert {org: st[org]["served_cost"] for org in texts} == served
    assert st["team-b"]["requests"]["cancelled_during_execution"] == 2
    hung = [x for x in lines if x["outcome"] == "cancelled_during_execution"]
    assert len(hung) == 4 and all(x["status"] == 499 for x in hung)
    assert all(x["cost_charged"] == pytest.approx(1.0 + 20.0) for x in hung)  # min charge + 20 tokens as served
    whole = [x for x in lines if x["outcome"] == "completed"]
    assert len(whole) == 1 and whole[0]["cost_charged"] == pytest.approx(30.0)  # settled to its usage


def test_each_request_is_counted_once_with_the_status_its_client_got(tmp_path: Path, upstream: Upstream,
                                                                     refused_url: str) -> None:
    """An outage (pool ``down`` has no backend in rotation): three requests, three fast 503s,
    exactly three more in ``sfq_requests_total`` and three access-log lines saying 503. A body
    over the size cap that is still coming when refused: 413 in the metrics and the log alike
    (not 499 when its client then closes the connection)."""
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(upstream.url, refused_url) + "server: {max_body_bytes: 65536}\n")
    gw = GatewayProcess(cfg)
    try:
        c = make_client(gw, "sk-b")

        def down() -> bool:
            if gw.get("/health?pool=down")[0] == 503:
                return True
            with pytest.raises(openai.APIStatusError):
                c.completions.create(model="gone", prompt="probe", max_tokens=1)
            return False

        wait_until(down, "pool 'down' to leave the rotation")
        wait_until(lambda: len(gw.access()) == _requests_total(gw), "the probes' lines")
        before, lines_before = _requests_total(gw), len(gw.access())
        unavailable = gw.metric("sfq_refusals_total", org="team-b", reason="unavailable")
        for _ in range(3):
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(model="gone", prompt="in the outage", max_tokens=1)
            assert e.value.status_code == 503
        wait_until(lambda: len(gw.access()) >= lines_before + 3, "three access-log lines")
        outage = gw.access()[lines_before:]
        assert _requests_total(gw) - before == 3 and len(outage) == 3
        assert [(x["status"], x["outcome"]) for x in outage] == [(503, "refused")] * 3
        assert gw.metric("sfq_refusals_total", org="team-b", reason="unavailable") - unavailable == 3
        assert gw.metric("sfq_requests_total", outcome="joined") == 0
        # a body over the cap, refused while it is still coming
        before, lines_before = _requests_total(gw), len(gw.access())
        big = b'{"model": "m", "prompt": "' + b"p" * (4 << 20) + b'"}'
        with socket.create_connection(("127.0.0.1", gw.port), timeout=15.0) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-b\r\n"
                         b"Content-Type: application/json\r\nContent-Length: " + str(len(big)).encode() + b"\r\n\r\n")
            sock.sendall(big[:65536])  # part of it: the answer comes while the rest is still to come
            assert sock.recv(65536).startswith(b"HTTP/1.1 413")
        # ... and the client closed the connection without sending the rest
        wait_until(lambda: len(gw.access()) > lines_before, "the refusal's access-log line")
        (line,) = gw.access()[lines_before:]
        assert (line["status"], line["outcome"], line["reason"]) == (413, "refused", "request_too_large")
        assert _requests_total(gw) - before == 1
        assert gw.metric("sfq_refusals_total", org="team-b", reason="too_large") == 1
    finally:
        gw.stop()


def test_series_stay_bounded_with_10000_orgs(tmp_path: Path, upstream: Upstream) -> None:
    """10,000 orgs in the file and none active: no org has a series. Then 5 of them send, with
    ``max_org_series: 3``: exactly 3 org labels and ``_other``, the totals exact, and a second
    scrape shows the same labels (no flapping)."""
    orgs = "\n".join(f'  org{i}: {{keys: ["sk-{i}"], classes: [batch]}}' for i in range(10_000))
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(f"""\
pools:
  main:
    models: [m]
    backends: [{{url: "{upstream.url}", max_in_flight: 4}}]
classes:
  batch: {{weight: 1}}
orgs:
{orgs}
metrics: {{max_org_series: 3}}
""")
    gw = GatewayProcess(cfg)
    try:
        idle = gw.get("/metrics")[1].decode()
        assert 'org="' not in idle, [x for x in idle.splitlines() if 'org="' in x][:3]
        assert len(idle) < 20_000  # (nothing per org: the gateway's own series only)
        sent = {i: 1 + i for i in range(5)}  # org4 sends the most
        for i, n in sent.items():
            c = make_client(gw, f"sk-{i}")
            for _ in range(n):
                c.completions.create(model="m", prompt="counted", max_tokens=2)
        first, second = _parse(gw.get("/metrics")[1].decode()), _parse(gw.get("/metrics")[1].decode())
        st = _stats(gw)["pools"]["main"]["orgs"]
    finally:
        gw.stop()
    for reading in (first, second):
        labels = {dict(lab)["org"] for (name, lab) in reading if "org" in dict(lab)}
        assert labels == {"org4", "org3", "org2", "_other"}  # the three best served, the rest summed
        completed = {dict(lab)["org"]: v for (name, lab), v in reading.items()
                     if name == "sfq_requests_total" and dict(lab)["outcome"] == "completed"}
        assert completed == {"org4": 5, "org3": 4, "org2": 3, "_other": 1 + 2}  # exact
        assert sum(v for (name, _), v in reading.items() if name == "sfq_requests_total") == sum(sent.values())
    assert set(st) == {"org4", "org3", "org2", "_other"} and st["_other"]["requests"]["completed"] == 3
    assert sum(o["share"] for o in st.values()) == pytest.approx(1.0)
