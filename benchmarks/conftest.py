"""Shared set-up for the sfq benchmarks (pytest-benchmark).

Run them with ``python benchmarks/report.py`` (see ``benchmarks/README.md``); they are not part
of the default test run (``testpaths = ["tests"]`` and the files are named ``bench_*.py``).

Options (all optional):

``--sfq-sizes=100,1000``      numbers of flows T to run (default 100,1000,10000,100000)
``--sfq-impls=compiled,heapq`` implementations to run (default compiled,twin,heapq,minimal,floor;
                              minimal and floor run in the steady group only)
``--sfq-quick``               a smoke run: fewer pairs and rounds per benchmark (not for quoting)

The JSON that ``--benchmark-json`` writes gains an ``"sfq"`` key: the machine (CPU model, cores),
Python and numpy versions, which core ``sfq.Scheduler`` was, and the load average before and after.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # heapq_sfq, as a plain module
try:
    import sfq  # noqa: F401  (the installed package, if any)
except ImportError:  # a checkout that was not installed: use python/ (with its in-place build)
    sys.path.insert(0, str(HERE.parent / "python"))

collect_ignore = ["report.py", "memory.py", "memory_orgs.py", "heapq_sfq.py", "minimal_heapq.py", "floor_build.py", "profile_core.py"]

ALL_SIZES = (100, 1_000, 10_000, 100_000)
ALL_IMPLS = ("compiled", "twin", "heapq", "minimal", "floor")


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("sfq benchmarks")
    g.addoption("--sfq-sizes", default=",".join(map(str, ALL_SIZES)), help="comma-separated flow counts T")
    g.addoption("--sfq-impls", default=",".join(ALL_IMPLS), help="comma-separated: " + ",".join(ALL_IMPLS))
    g.addoption("--sfq-quick", action="store_true", help="smoke run: few pairs and rounds (numbers not for quoting)")


def pytest_configure(config: pytest.Config) -> None:
    config._sfq_started = time.time()  # type: ignore[attr-defined]
    config._sfq_load_before = _loadavg()  # type: ignore[attr-defined]
    # pytest-benchmark only collects test_*.py files by default; ours are bench_*.py
    config.addinivalue_line("python_files", "bench_*.py")


def _csv(value: str, cast=str) -> list:
    return [cast(x.strip().replace("_", "")) for x in value.split(",") if x.strip()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    cfg = metafunc.config
    if "T" in metafunc.fixturenames:
        sizes = _csv(cfg.getoption("--sfq-sizes"), int)
        metafunc.parametrize("T", sizes, ids=[f"T{t}" for t in sizes])
    if "impl" in metafunc.fixturenames:
        impls = _csv(cfg.getoption("--sfq-impls"))
        bad = [i for i in impls if i not in ALL_IMPLS]
        if bad:
            raise pytest.UsageError(f"--sfq-impls: unknown implementation(s) {bad}; known: {list(ALL_IMPLS)}")
        wanted = [i for i in ALL_IMPLS if i in impls]  # fixed column order
        only = getattr(metafunc.function, "sfq_impls", None)
        if only is not None:
            wanted = [i for i in wanted if i in only]
        metafunc.parametrize("impl", wanted)


@pytest.fixture(scope="session")
def cfloor():
    """The C-loop floor module, built on first use into benchmarks/build/ (git-ignored)."""
    from floor_build import load_cfloor

    return load_cfloor()


@pytest.fixture(scope="session")
def quick(pytestconfig: pytest.Config) -> bool:
    return bool(pytestconfig.getoption("--sfq-quick"))


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (falls back to platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import sfq

    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "sfq_version": sfq.__version__,
        "sfq_core": sfq.CORE,
    }


def pytest_benchmark_update_json(config: pytest.Config, benchmarks, output_json: dict) -> None:
    info = machine_info()
    info["loadavg_before"] = getattr(config, "_sfq_load_before", None)
    info["loadavg_after"] = _loadavg()
    info["wall_s"] = round(time.time() - getattr(config, "_sfq_started", time.time()), 1)
    info["options"] = {
        "sizes": config.getoption("--sfq-sizes"),
        "impls": config.getoption("--sfq-impls"),
        "quick": bool(config.getoption("--sfq-quick")),
    }
    output_json["sfq"] = info
