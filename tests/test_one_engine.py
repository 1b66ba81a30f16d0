"""One implementation of a request's charge: only the request engine (``sfq.engine``) drives
the SFQ core's charging.

Looking before popping (``peek()``), charge corrections (``adjust()``) and the busy period held
with the work (``work_started()``/``work_done()``) are the engine's rules; a module that calls
them on a core is a second copy of the engine, and copies drift apart. This test reads every
module of the package and fails on such a call anywhere else. The core's own twins
(``_scheduler_py.py`` and the compiled ``src/csfq``) define them. Baselines of the simulator
that use the core under the plain rule (``enqueue``/``dispatch`` only, ``sfq-seed``) are not
copies of the engine and are allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "sfq"

#: these tests read the package's source: skipped where only tests/ and docs/ are copied (the wheel's run)
pytestmark = pytest.mark.skipif(not (PACKAGE / "__init__.py").exists(), reason="needs the source tree")
CHARGING = {"adjust", "work_started", "work_done", "peek"}
#: where the rules live, and the core's twin that defines them
OWNERS = {"engine", "_scheduler_py.py"}
#: modules still driving the core themselves, to be ported onto the engine (each with why): none
KNOWN: set[str] = set()


def charging_calls(path: Path) -> list[str]:
    """``line: receiver.method(`` for every call of a charging method on something other than
    ``self`` or ``cls`` (a discipline calling its own ``peek`` is not a core call)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CHARGING:
            recv = node.func.value
            if isinstance(recv, ast.Name) and recv.id in ("self", "cls"):
                continue
            out.append(f"{node.lineno}: {ast.unparse(recv)}.{node.func.attr}(")
    return out


def offenders() -> dict[str, list[str]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.split("/")[0] in OWNERS:
            continue
        calls = charging_calls(path)
        if calls:
            found[rel] = calls
    return found


def test_only_the_engine_drives_the_cores_charging():
    found = offenders()
    extra = {k: v for k, v in found.items() if k not in KNOWN}
    assert not extra, f"modules driving the SFQ core's charging outside sfq.engine: {extra}"
    # a known exception that no longer needs it must leave the list
    assert set(found) >= KNOWN, f"no longer driving the core, remove from KNOWN: {sorted(KNOWN - set(found))}"


def test_the_scan_sees_a_copy(tmp_path):
    copy = tmp_path / "copy.py"
    copy.write_text("def go(sched, flow, pol):\n    d = sched.peek()\n    pol.sched.adjust(flow, 1.0)\n"
                    "    sched.work_started(flow)\n    self.peek(0)\n")
    assert charging_calls(copy) == ["2: sched.peek(", "3: pol.sched.adjust(", "4: sched.work_started("]
    # the simulator's sfq policy is the engine: it calls none of them
    assert charging_calls(PACKAGE / "sim" / "adapter.py") == []
    assert charging_calls(PACKAGE / "sim" / "policies.py") == []
