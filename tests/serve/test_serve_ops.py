"""Operations on a real ``sfq serve`` process: SIGHUP reloads the policy file (a bad file is
refused and the old one stays), SIGTERM drains (waiting requests 503, running ones finish
within the grace period, or are aborted after it), a bad file at start."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from serve_helpers import LIMIT, GatewayProcess, Upstream, make_client, policy_yaml, wait_until

NEW_ORG = """\
  team-c:
    keys: ["sk-new"]
    classes: [batch]
"""


def test_sighup_reloads_without_losing_a_queued_request(gate: Upstream, refused_url: str, tmp_path: Path):
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(gate.url, refused_url))
    gw = GatewayProcess(cfg)
    try:
        a, b = make_client(gw, "sk-a"), make_client(gw, "sk-b")
        with pytest.raises(openai.AuthenticationError):
            make_client(gw, "sk-new").completions.create(model="m", prompt="x", max_tokens=1)
        with ThreadPoolExecutor(2) as ex:
            running = ex.submit(a.completions.create, model="m", prompt="hold-r", max_tokens=1)
            wait_until(lambda: "hold-r" in gate.holding, "the first request to run")
            queued = ex.submit(b.completions.create, model="m", prompt="queued-r", max_tokens=1)
            wait_until(lambda: gw.metric("sfq_queue_length", org="team-b") == 1, "the second request to wait")
            # new key, new weight, a new org
            cfg.write_text(policy_yaml(gate.url, refused_url, extra_org=NEW_ORG, interactive_weight=9))
            gw.signal(signal.SIGHUP)
            wait_until(lambda: gw.log_has("reloaded"), "the reload")
            assert gw.metric("sfq_queue_length", org="team-b") == 1  # still waiting, in the new policy
            gate.release()
            assert running.result().choices[0].text == "x" and queued.result().choices[0].text == "x"
        new = make_client(gw, "sk-new")
        assert new.completions.create(model="m", prompt="y", max_tokens=1).choices[0].text == "x"
        # the series go on across the reload
        assert gw.metric("sfq_requests_total", org="team-b", outcome="completed") == 1
        # a bad file is refused, naming the field; the policy in force stays
        cfg.write_text(policy_yaml(gate.url, refused_url, extra_org=NEW_ORG, interactive_weight=-1))
        gw.signal(signal.SIGHUP)
        wait_until(lambda: gw.log_has("reload refused"), "the refusal")
        assert gw.log_has("classes.interactive.weight")
        assert new.completions.create(model="m", prompt="z", max_tokens=1).choices[0].text == "x"
        # a change that needs a restart (the backends) is refused too
        cfg.write_text(policy_yaml(gate.url, refused_url.replace("127.0.0.1", "localhost")))
        gw.signal(signal.SIGHUP)
        wait_until(lambda: gw.log_has("cannot change backends"), "the second refusal")
        assert a.completions.create(model="m", prompt="still", max_tokens=1).choices[0].text == "x"
        assert gw.stop() == 0
    finally:
        gw.stop()


def _connect_refused(gw: GatewayProcess) -> bool:
    try:
        socket.create_connection(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])), timeout=1).close()
    except OSError:
        return True
    return False


def test_sigterm_drains(gate: Upstream, refused_url: str, tmp_path: Path):
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(gate.url, refused_url))
    gw = GatewayProcess(cfg, grace=LIMIT)
    try:
        a, b = make_client(gw, "sk-a"), make_client(gw, "sk-b")
        with ThreadPoolExecutor(2) as ex:
            running = ex.submit(lambda: list(a.completions.create(model="m", prompt="hold-t", max_tokens=3,
                                                                   stream=True)))
            wait_until(lambda: "hold-t" in gate.holding, "the first request to run")
            queued = ex.submit(b.completions.create, model="m", prompt="queued-t", max_tokens=1)
            wait_until(lambda: gw.metric("sfq_queue_length", org="team-b") == 1, "the second request to wait")
            gw.signal(signal.SIGTERM)
            with pytest.raises(openai.InternalServerError) as e503:
                queued.result(LIMIT)
            assert e503.value.status_code == 503 and e503.value.code == "shutting_down"
            wait_until(lambda: _connect_refused(gw), "the gateway to stop accepting connections")
            assert gw.proc.poll() is None  # still finishing the running one
            gate.release()
            assert "".join(ch.choices[0].text for ch in running.result(LIMIT)) == "xxx"
        assert gw.proc.wait(LIMIT) == 0
        assert "queued-t" not in gate.texts()
        outcomes = {x["org"]: x["outcome"] for x in gw.access()}
        assert outcomes == {"team-a": "completed", "team-b": "refused"}
    finally:
        gw.stop()


def test_sigterm_aborts_what_outlives_the_grace(gate: Upstream, refused_url: str, tmp_path: Path):
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(gate.url, refused_url))
    gw = GatewayProcess(cfg, grace=0.2)
    try:
        a = make_client(gw, "sk-a")
        with ThreadPoolExecutor(1) as ex:
            running = ex.submit(a.completions.create, model="m", prompt="hold-g", max_tokens=1)
            wait_until(lambda: "hold-g" in gate.holding, "the request to run")
            gw.signal(signal.SIGTERM)
            with pytest.raises(openai.APIStatusError) as err:
                running.result(LIMIT)
            assert err.value.status_code in (502, 503)
            wait_until(lambda: "hold-g" in gate.aborted, "the upstream to see the call aborted")
        assert gw.proc.wait(LIMIT) == 0
    finally:
        gw.stop()


def test_a_bad_file_at_start_names_the_field(tmp_path: Path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(policy_yaml("http://127.0.0.1:9", "http://127.0.0.1:10", interactive_weight=-1))
    p = subprocess.run([sys.executable, "-m", "sfq", "serve", "--config", str(cfg), "--port", "0"],
                       capture_output=True, text=True, timeout=LIMIT)
    assert p.returncode == 1 and "classes.interactive.weight" in p.stderr
    env_cfg = tmp_path / "env.yaml"  # a backend key the environment does not have
    env_cfg.write_text(policy_yaml("http://127.0.0.1:9", "http://127.0.0.1:10"))
    p = subprocess.run([sys.executable, "-m", "sfq", "serve", "--config", str(env_cfg), "--port", "0"],
                       capture_output=True, text=True, timeout=LIMIT,
                       env={k: v for k, v in __import__("os").environ.items() if k != "SFQ_TEST_UPSTREAM_KEY"})
    assert p.returncode == 1 and "SFQ_TEST_UPSTREAM_KEY" in p.stderr
