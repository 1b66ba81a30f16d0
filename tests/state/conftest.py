"""Fixtures of the shared-state tests: one real ``redis-server`` per module on a free loopback
port (skipped, saying why, only when no ``redis-server`` is installed and ``SFQ_REQUIRE_REDIS``
is not set; ``.ci/run`` installs it and sets it), a loopback upstream, a fresh key prefix per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from state_helpers import REDIS, Gateway, RedisServer, Upstream

pytest.importorskip("redis", reason="the redis package (pip install 'sfq-scheduler[redis]') is not installed")

if REDIS is None:
    if os.environ.get("SFQ_REQUIRE_REDIS"):
        raise RuntimeError("SFQ_REQUIRE_REDIS is set but no redis-server is installed (apt-get install redis-server)")
    pytest.skip("no redis-server on PATH (Debian: apt-get install redis-server); .ci/run installs it",
                allow_module_level=True)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    r = RedisServer().start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream().start()
    try:
        yield up
    finally:
        up.release()
        up.stop()


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


@pytest.fixture
def gateways() -> Iterator[list[Gateway]]:
    """The ``sfq serve`` processes a test starts (append them): stopped when it ends."""
    started: list[Gateway] = []
    try:
        yield started
    finally:
        for g in started:
            g.stop()
