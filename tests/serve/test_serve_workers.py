"""``sfq serve --workers N`` before any worker starts (no Redis needed): the flag is documented,
a policy without ``state.redis`` is refused (exit 1, naming the key), an address in use
exits 2, and the parent binds every address of a host on one port. The workers themselves,
on a real Redis: ``tests/state/test_state_workers.py``."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import LIMIT

from sfq.cli import build_parser
from sfq.serve.workers import bind, needs_redis

POLICY = """\
pools:
  main:
    models: [m]
    backends:
      - {url: "http://127.0.0.1:9", max_in_flight: 1}
classes:
  batch: {weight: 1}
orgs:
  team-a: {keys: ["sk-a"], classes: [batch]}
"""


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sfq", "serve", *args], capture_output=True, text=True,
                          timeout=LIMIT)


def test_help_documents_workers():
    sub = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = " ".join(sub.format_help().split())
    assert "--workers N" in text and "state.redis" in text
    p = _serve("--config", "x.yaml", "--workers", "0")
    assert p.returncode == 2 and "--workers" in p.stderr


@pytest.mark.parametrize("state", ["", 'state: {file: "spend.json"}\n'])
def test_workers_without_state_redis_exit_1_naming_the_key(tmp_path: Path, state: str):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(POLICY + state.replace("spend.json", str(tmp_path / "spend.json")))
    with socket.socket() as s:  # the port it would have bound stays free
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _serve("--config", str(cfg), "--workers", "2", "--port", str(port))
    assert p.returncode == 1
    assert "--workers 2 needs state.redis" in p.stderr and str(cfg) in p.stderr, p.stderr
    assert "workers" not in p.stdout
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert needs_redis(cfg, 2) is not None
    cfg.write_text(POLICY + 'state: {redis: "redis://127.0.0.1:9/0"}\n')
    assert needs_redis(cfg, 2) is None


def test_an_address_in_use_exits_2(tmp_path: Path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(POLICY + 'state: {redis: "redis://127.0.0.1:9/0"}\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        p = _serve("--config", str(cfg), "--workers", "2", "--port", str(s.getsockname()[1]))
    assert p.returncode == 2 and "address already in use" in p.stderr, p.stderr


def test_bind_gives_every_address_one_port():
    socks = bind("localhost", 0)
    try:
        ports = {s.getsockname()[1] for s in socks}
        assert len(ports) == 1 and 0 not in ports
        for s in socks:
            with socket.create_connection(s.getsockname()[:2], timeout=LIMIT):  # listening already
                pass
    finally:
        for s in socks:
            s.close()
