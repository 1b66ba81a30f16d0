"""``sfq check-config`` reports every error of a file, each naming its field, and what ``sfq
serve`` would refuse at start-up (an unset ``api_key_env``); an unreachable Redis is a warning."""

from __future__ import annotations

import socket

import pytest
from policy_helpers import EXAMPLE

from sfq.cli import main
from sfq.errors import PolicyError
from sfq.policy.config import PolicyErrors, parse_policy

BASE = """
pools:
  gpu:
    models: [m]
    backends:
      - {url: "http://127.0.0.1:8001", max_in_flight: 4}
classes:
  interactive: {weight: 6}
  batch: {weight: 1}
orgs:
  a: {keys: ["k-a"], classes: [interactive]}
  b: {keys: ["k-b"], classes: [batch]}
"""

MANY = """
pools:
  gpu:
    models: [m]
    backends:
      - {url: "ftp://x", max_in_flight: 4}
  cpu:
    models: [m]
    backends:
      - {url: "http://127.0.0.1:8002", max_in_flight: 0}
classes:
  interactive: {weight: -6}
  batch: {weight: 1, max_queue_lenght: 5}
orgs:
  a: {keys: ["k-a"], classes: [interactive, nope]}
  b: {keys: ["k-b"], classes: [batch]}
  c: {keys: ["k-b"], classes: [batch]}
retry: {max_attempts: 0}
bogus: 1
"""

EXPECTED = [
    ("bogus", "unknown key"),
    ("classes.interactive.weight", "must be a number > 0, got -6"),
    ("classes.batch.max_queue_lenght", "unknown key"),
    ("pools.gpu.backends[0].url", "must be an http:// or https:// URL"),
    ("pools.cpu.backends[0].max_in_flight", "must be an integer >= 1, got 0"),
    ("orgs.a.classes[1]", "unknown class 'nope'"),
    ("orgs.c.keys[0]", "already the key of org 'b'"),
    ("retry.max_attempts", "must be an integer >= 1, got 0"),
]


def test_every_bad_field_is_named_in_one_error():
    with pytest.raises(PolicyErrors) as info:
        parse_policy(MANY)
    err = info.value
    assert isinstance(err, PolicyError) and isinstance(err, ValueError)
    assert [e.path for e in err.errors] == [path for path, _ in EXPECTED], str(err)
    for (path, phrase), e in zip(EXPECTED, err.errors):
        assert e.path == path and phrase in e.problem, str(e)
    # the first error is the exception's own path, and the message lists them all
    assert err.path == "bogus" and str(err).splitlines() == [str(e) for e in err.errors]


def test_an_invalid_class_is_not_reported_again_by_the_orgs_that_use_it():
    with pytest.raises(PolicyError) as info:
        parse_policy(BASE.replace("interactive: {weight: 6}", "interactive: {weight: 0}"))
    assert not isinstance(info.value, PolicyErrors)  # one error is raised as itself
    assert info.value.path == "classes.interactive.weight"


def test_a_model_served_twice_and_the_next_pool_error_are_both_named():
    text = BASE.replace("\nclasses:\n", """
  gpu2:
    models: [m]
    backends:
      - {url: "http://127.0.0.1:8003", max_in_flight: 2}
      - {url: "http://127.0.0.1:8003", max_in_flight: 2}
classes:
""")
    with pytest.raises(PolicyErrors) as info:
        parse_policy(text)
    assert [e.path for e in info.value.errors] == ["pools.gpu2.models[0]", "pools.gpu2.backends[1]"]


def test_check_config_prints_every_error(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text(MANY)
    assert main(["check-config", str(p), "--plain"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[2] for line in err[:-1]] == [path for path, _ in EXPECTED]
    assert all(line.startswith(f"sfq check-config: {p}: ") for line in err)
    assert err[-1].endswith(f"{len(EXPECTED)} errors")


def test_an_unset_backend_key_is_an_error_as_at_start_up(tmp_path, capsys, monkeypatch):
    p = tmp_path / "policy.yaml"
    p.write_text(BASE.replace('max_in_flight: 4}', 'max_in_flight: 4, api_key_env: SFQ_TEST_CHECK_KEY}'))
    monkeypatch.delenv("SFQ_TEST_CHECK_KEY", raising=False)
    assert main(["check-config", str(p), "--plain"]) == 1
    err = capsys.readouterr().err
    assert "pools.gpu.backends[0].api_key_env: the environment variable 'SFQ_TEST_CHECK_KEY' is not set" in err
    monkeypatch.setenv("SFQ_TEST_CHECK_KEY", "sk-upstream")
    assert main(["check-config", str(p), "--plain"]) == 0
    assert "valid (1 pools" in capsys.readouterr().out


def test_an_unreachable_redis_is_a_warning(tmp_path, capsys):
    pytest.importorskip("redis")
    with socket.socket() as s:  # a loopback port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = tmp_path / "policy.yaml"
    p.write_text(EXAMPLE + f'\nstate: {{redis: "redis://127.0.0.1:{port}/0"}}\n')
    assert main(["check-config", str(p), "--plain"]) == 0
    captured = capsys.readouterr()
    assert f"warning: state.redis: redis://127.0.0.1:{port}/0 does not answer" in captured.err
    assert "1 warning(s) above" in captured.out


def _tenants(n: int) -> str:
    lines = ["pools:", "  gpu:", "    models: [m]", "    backends:", "      - {url: 'http://127.0.0.1:8001'}",
             "classes:", "  interactive: {weight: 4}", "  batch: {weight: 1}", "orgs:"]
    lines += [f"  org{i}: {{keys: ['sk-{i}'], classes: [interactive, batch], weight: {1 + i % 5}}}" for i in range(n)]
    return "\n".join(lines) + "\n"


def test_many_orgs_get_a_summary_and_flows_lists_every_one(tmp_path, capsys):
    """A file of 3,000 orgs: the default output stays a page (each pool's largest and smallest
    shares, the orgs summed up), and its shares are the pool's (weight / total weight); with
    ``--flows`` every flow and org is listed (plain text: rich would take seconds)."""
    p = tmp_path / "tenants.yaml"
    p.write_text(_tenants(3000))
    assert main(["check-config", str(p)]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 80 and "5990 more flows (--flows lists every one)" in out
    assert "orgs named" in out and "3000 (3000 with keys, 0 without)" in out and "1 .. 5" in out
    total = sum((1 + i % 5) * (4 + 1) for i in range(3000))
    assert f"{20 / total * 100:.2g}%" in out  # org4's interactive flow: the largest share
    assert "valid (1 pools, 2 classes, 3000 orgs, 6000 flows)" in out
    assert main(["check-config", str(p), "--flows"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("gpu ") and line.split()[2] in ("interactive", "batch")]
    assert len(rows) == 6000 and sum(line.split()[1] == "org2999" for line in rows) == 2
    assert sum(line.split()[0].startswith("org") and line.split()[1] == "1" for line in out.splitlines()
               if len(line.split()) > 2) == 3000  # the orgs table, whole (its "keys" column: 1)
