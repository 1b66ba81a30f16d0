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
