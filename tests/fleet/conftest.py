"""Fixtures of the fleet tests: one real ``redis-server`` per module on a free loopback port,
started when a scenario that shares the state first asks for it. Those scenarios skip, saying
why, when no ``redis-server`` (or the ``redis`` package) is installed and ``SFQ_REQUIRE_REDIS``
is not set (``.ci/run`` installs it and sets it); the one-gateway scenarios in memory run
regardless."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from support.processes import REDIS, RedisServer

pytest.importorskip("openai")


def _redis_missing() -> str | None:
    if REDIS is None:
        return "no redis-server on PATH (Debian: apt-get install redis-server); .ci/run installs it"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis package (pip install 'sfq-scheduler[redis]') is not installed"
    return None


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    why = _redis_missing()
    if why is not None:
        if os.environ.get("SFQ_REQUIRE_REDIS"):
            raise RuntimeError(f"SFQ_REQUIRE_REDIS is set but {why}")
        pytest.skip(why)
    r = RedisServer().start()
    try:
        yield r
    finally:
        r.stop()
