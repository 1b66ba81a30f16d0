"""Fixtures of the policy tests."""

from __future__ import annotations

import pytest
from policy_helpers import EXAMPLE, Clock

from sfq.policy import Policy, parse_policy


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def example() -> Policy:
    return parse_policy(EXAMPLE)


@pytest.fixture
def core(make):
    """A scheduler factory of one twin that has the operations the policy needs."""
    if not all(hasattr(make(), op) for op in ("suspend", "resume", "peek", "adjust", "work_started")):
        pytest.skip("this twin has no suspend/resume/peek/adjust yet")
    return make


