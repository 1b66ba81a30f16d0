"""``sfq check-config`` reports every error of a file, each naming its field, and what ``sfq
serve`` would refuse at start-up (an unset ``api_key_env``); an unreachable Redis is a warning."""

from __future__ import annotations

import re
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
    ("pools.cpu.models[0]", "model 'm' is already served by pool 'gpu'"),  # (both pools bad: still checked)
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


# several bad fields in each entry, a repeated key, a model served by two bad pools, a key of a
# bad org used again, an unset api_key_env: every one is named in the first run
SEVERAL = """
pools:
  gpu:
    models: [m, 5]
    backends:
      - {url: "ftp://x", max_in_flight: 0, api_key_env: SFQ_TEST_SEVERAL_KEY}
  cpu:
    models: [m]
    backends: [{url: "http://127.0.0.1:8002", max_in_flight: 0}]
classes:
  interactive: {weight: -6, max_queue_length: 0}
  batch: {weight: 1}
orgs:
  a: {keys: ["k-a"], classes: [interactive], weight: 0, max_in_flight: -1}
  b: {keys: ["k-a"], classes: [batch], weight: 2}
  b: {keys: ["k-x"], classes: [batch]}
retry: {max_attempts: 0, backoff: linear}
"""

SEVERAL_EXPECTED = [
    "orgs.b: appears twice (line 16)",
    "classes.interactive.weight: must be a number > 0, got -6",
    "classes.interactive.max_queue_length: must be an integer >= 1, got 0",
    "pools.gpu.models[1]: must be a non-empty string, got 5",
    "pools.gpu.backends[0].url: must be an http:// or https:// URL, got 'ftp://x'",
    "pools.gpu.backends[0].max_in_flight: must be an integer >= 1, got 0",
    "pools.cpu.backends[0].max_in_flight: must be an integer >= 1, got 0",
    "pools.cpu.models[0]: model 'm' is already served by pool 'gpu' (a model has one pool)",
    "orgs.a.weight: must be a number > 0, got 0",
    "orgs.a.max_in_flight: must be an integer >= 1, got -1",
    "orgs.b.keys[0]: this key is already the key of org 'a'",
    "retry.max_attempts: must be an integer >= 1, got 0",
    "retry.backoff: must be one of exponential_with_jitter, exponential, constant, got 'linear'",
    "pools.gpu.backends[0].api_key_env: the environment variable 'SFQ_TEST_SEVERAL_KEY' is not set (or empty); "
    "sfq serve refuses to start",
]


def test_check_config_names_every_error_of_a_file_in_one_run(tmp_path, capsys, monkeypatch):
    """Two and three errors in one entry, a repeated key, checks across bad entries, sfq serve's
    own start-up check: all in the first run, and nothing left for a second one."""
    monkeypatch.delenv("SFQ_TEST_SEVERAL_KEY", raising=False)
    p = tmp_path / "several.yaml"
    p.write_text(SEVERAL)
    assert main(["check-config", str(p), "--plain"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"sfq check-config: {p}: {e}" for e in SEVERAL_EXPECTED] + [
        f"sfq check-config: {p}: {len(SEVERAL_EXPECTED)} errors"]
    # each fixed in turn: no error appears that the first run did not name
    fixed = (SEVERAL.replace("[m, 5]", "[m, m5]").replace('"ftp://x", max_in_flight: 0', '"http://127.0.0.1:8001"')
             .replace("models: [m]\n    backends: [{url: \"http://127.0.0.1:8002\", max_in_flight: 0}]",
                      "models: [m2]\n    backends: [{url: \"http://127.0.0.1:8002\"}]")
             .replace("weight: -6, max_queue_length: 0", "weight: 6").replace(", weight: 0, max_in_flight: -1", "")
             .replace('  b: {keys: ["k-a"], classes: [batch], weight: 2}\n', "")
             .replace("max_attempts: 0, backoff: linear", "max_attempts: 2"))
    p.write_text(fixed)
    monkeypatch.setenv("SFQ_TEST_SEVERAL_KEY", "sk-upstream")
    assert main(["check-config", str(p), "--plain"]) == 0, capsys.readouterr().err
    assert "valid (2 pools, 2 classes, 2 orgs" in capsys.readouterr().out


def test_a_check_that_needs_a_bad_field_says_more_may_follow(tmp_path, capsys):
    """max_seconds is checked against base_seconds: with base_seconds bad it cannot be, and the
    last line says so; once base_seconds is fixed, that check's error appears."""
    p = tmp_path / "retry.yaml"
    p.write_text(BASE + "retry: {base_seconds: -1, max_seconds: 2}\n")
    assert main(["check-config", str(p), "--plain"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"sfq check-config: {p}: retry.base_seconds: must be a number > 0, got -1",
                   f"sfq check-config: {p}: 1 error; more may follow once these are fixed, from what could not "
                   "be checked yet: retry.max_seconds: against base_seconds (at least as long)"]
    p.write_text(BASE + "retry: {base_seconds: 5, max_seconds: 2}\n")
    assert main(["check-config", str(p), "--plain"]) == 1
    assert "retry.max_seconds: must be >= base_seconds (5), got 2" in capsys.readouterr().err
    with pytest.raises(PolicyErrors) as info:  # the library's exception says the same
        parse_policy(BASE + "retry: {base_seconds: -1, max_seconds: 2}\n")
    assert info.value.unchecked == ["retry.max_seconds: against base_seconds (at least as long)"]


def test_a_yaml_syntax_error_names_the_file_and_its_line(tmp_path, capsys):
    p = tmp_path / "broken.yaml"
    p.write_text(BASE.replace("models: [m]", "models: [m"))
    assert main(["check-config", str(p), "--plain"]) == 1
    err = capsys.readouterr().err
    # (the column is the parser's: libyaml's and PyYAML's differ)
    assert re.match(rf"^sfq check-config: {re.escape(str(p))}, line 5, column \d+: not valid YAML: ", err), err
    assert "(while parsing a flow sequence at line 4, column 13)" in err
    assert "<unicode string>" not in err and len(err.splitlines()) == 1
    with pytest.raises(PolicyError) as info:
        parse_policy("pools: [unclosed", source="x.yaml")
    assert re.match(r"^x\.yaml, line \d+, column \d+: not valid YAML: .*\(while parsing a flow sequence at line 1, "
                    r"column 8\)$", str(info.value)), str(info.value)


def test_the_state_row_says_who_shares_it(tmp_path, capsys):
    """A PolicyDispatcher started with a file's state.redis shares it too (API.md): the row does
    not say the library keeps its state in memory."""
    p = tmp_path / "policy.yaml"
    p.write_text(BASE + 'state: {redis: "redis://127.0.0.1:1/0"}\n')
    main(["check-config", str(p), "--plain"])
    out = capsys.readouterr().out
    assert "shared by every sfq serve and PolicyDispatcher started with this file" in out
    assert "in memory" not in out


def test_a_bad_on_limit_is_named_with_its_value_wherever_it_is_written(tmp_path, capsys):
    text = BASE.replace("batch: {weight: 1}", "batch: {weight: 1, on_limit: queue}").replace(
        'classes: [interactive]}', 'classes: [interactive], requests_per_minute: 60, on_limit: Wait}') + (
        "org_template: {classes: [batch], on_limit: true}\n")
    p = tmp_path / "policy.yaml"
    p.write_text(text)
    assert main(["check-config", str(p), "--plain"]) == 1
    err = capsys.readouterr().err
    for line in ("classes.batch.on_limit: must be one of wait, refuse, got 'queue'",
                 "orgs.a.on_limit: must be one of wait, refuse, got 'Wait'",
                 "org_template.on_limit: must be one of wait, refuse, got True"):
        assert line in err, err
    p.write_text(text.replace("on_limit: queue", "on_limit: wait").replace("on_limit: Wait", "on_limit: refuse")
                 .replace("on_limit: true", "on_limit: wait"))
    assert main(["check-config", str(p), "--plain"]) == 0
