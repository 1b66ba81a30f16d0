"""Fixtures of the ``sfq serve`` tests: one fake upstream and one gateway process per module
(the tests that signal a gateway start their own), the official ``openai`` client."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import GatewayProcess, Upstream, make_client, policy_yaml

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream().start()
    try:
        yield up
    finally:
        up.release()
        up.stop()


@pytest.fixture(scope="module")
def refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def policy_file(upstream: Upstream, refused_url: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("serve") / "policy.yaml"
    p.write_text(policy_yaml(upstream.url, refused_url))
    return p


@pytest.fixture(scope="module")
def gateway(policy_file: Path) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(policy_file)
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture
def gate(upstream: Upstream) -> Iterator[Upstream]:
    """The upstream with ``hold`` requests held for this test, released at its end."""
    upstream.rearm()
    try:
        yield upstream
    finally:
        upstream.release()


@pytest.fixture
def client(gateway: GatewayProcess) -> "openai.OpenAI":
    return make_client(gateway)
