"""``sfq check-config`` on files of 10, 1,000 and 10,000 orgs (one key each, two classes): the
whole command as an operator runs it (a fresh process: start-up, reading and validating the
file, hashing the keys, the tables) and its default summary, and the same with ``--flows``
(every flow listed, as plain text). Issue 31's target: at most 3 s for 10,000 orgs.

Run: ``PYTHONPATH=python python -m pytest benchmarks/bench_check_config.py --benchmark-only``
(``--sfq-quick``: 10 and 100 orgs, one round).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SIZES = (10, 1_000, 10_000)


def _policy(n: int) -> str:
    lines = ["pools:", "  gpu:", "    models: [m]", "    backends:", "      - {url: 'http://127.0.0.1:8001'}",
             "classes:", "  interactive: {weight: 4}", "  batch: {weight: 1}", "orgs:"]
    lines += [f"  org{i}: {{keys: ['sk-org-{i}-a-long-enough-key'], classes: [interactive, batch], "
              f"weight: {1 + i % 5}}}" for i in range(n)]
    return "\n".join(lines) + "\n"


@pytest.mark.benchmark(group="check-config")
@pytest.mark.parametrize("flows", [False, True], ids=["summary", "flows"])
@pytest.mark.parametrize("orgs", SIZES)
def test_check_config(benchmark: Any, tmp_path: Path, quick: bool, orgs: int, flows: bool) -> None:
    if quick and orgs > 1_000:
        orgs = 100
    path = tmp_path / f"orgs{orgs}.yaml"
    path.write_text(_policy(orgs))
    cmd = [sys.executable, "-m", "sfq", "check-config", str(path), *(["--flows"] if flows else [])]
    env = {**os.environ, "COLUMNS": "200"}

    def run() -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"{orgs} orgs" in done.stdout

    benchmark.extra_info["orgs"] = orgs
    benchmark.pedantic(run, rounds=1 if quick else 3, iterations=1, warmup_rounds=0)
