"""The old name of ``tests/support/workload.py`` (the loopback engines, the workload of orgs
with the official ``openai`` client, the measures of delivered service): a re-export, kept for
``test_serve_delivered.py`` and ``benchmarks/bench_delivered.py``."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:  # imported from outside pytest (the benchmarks put tests/serve on the path)
    sys.path.insert(0, _TESTS)

from support.workload import (  # noqa: E402,F401
    LIMIT,
    TOKEN,
    FakeEngine,
    Fleet,
    OrgLoad,
    RunResult,
    drift,
    jain,
    least_window_share,
    over_declared_orgs,
    plain_over_declared_orgs,
    policy_text,
    run_workload,
    service,
    shares,
    trained_low_orgs,
)
