"""Shared fixtures. Every core test runs against both twins through ``make``.

Tests never import the extension module directly: the compiled core is reached as
``sfq.Scheduler`` (which is the twin when ``SFQ_NO_EXTENSIONS=1``).
"""

from __future__ import annotations

import pytest

import sfq

TWINS = {"compiled": sfq.Scheduler, "reference": sfq.ReferenceScheduler}
if sfq.CORE != "compiled":  # SFQ_NO_EXTENSIONS=1: the "compiled" slot is the twin itself
    TWINS = {"reference": sfq.ReferenceScheduler}


@pytest.fixture(params=sorted(TWINS))
def make(request):
    """A factory for a fresh scheduler of one twin."""
    return TWINS[request.param]
