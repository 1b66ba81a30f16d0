"""The request engine compiled by mypyc, and its source as its twin (sfq/_compiled.py).

The whole suite runs on the compiled engine in CI's main leg and on the source in its
``SFQ_NO_EXTENSIONS=1`` leg. Here: that the compiled modules really run where they were built
(a silent fallback must fail CI), that ``SFQ_NO_EXTENSIONS=1`` and a stale build run the
source, and that the two decide alike on whole simulated workloads.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import sfq
from sfq import _compiled

NO_EXT = os.environ.get("SFQ_NO_EXTENSIONS", "") not in ("", "0")
REQUIRE = os.environ.get("SFQ_REQUIRE_EXTENSIONS", "") not in ("", "0")
SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def _run(code: str, *, path: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.pop("SFQ_NO_EXTENSIONS", None)
    e.update(env)
    if path is not None:
        e["PYTHONPATH"] = str(path)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True,
                          timeout=120, cwd=path or None)


_REPORT = """
    import sys, warnings
    warnings.simplefilter("always")
    import importlib, importlib.machinery
    import sfq, sfq._compiled as c
    files = [importlib.import_module(m).__file__ for m in c.MODULES]
    print(c.engine_status())
    print(" ".join("so" if f.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)) else "py" for f in files))
    print("sfq__mypyc" in sys.modules)
"""


def _compiled_here() -> bool:
    if NO_EXT:
        pytest.skip("SFQ_NO_EXTENSIONS=1: the engine runs from its source")
    status = _compiled.engine_status()
    if status != "compiled":
        if REQUIRE:
            pytest.fail(f"SFQ_REQUIRE_EXTENSIONS=1 but the engine runs from {status}")
        pytest.skip(f"the engine runs from {status}")
    return True


def test_the_engine_really_runs_compiled() -> None:
    """Fails in CI (SFQ_REQUIRE_EXTENSIONS=1) when the build silently left the engine as source."""
    _compiled_here()
    for name in _compiled.MODULES:
        mod = importlib.import_module(name)
        assert mod.__file__ is not None and mod.__file__.endswith(SUFFIXES), (name, mod.__file__)
    assert "sfq__mypyc" in sys.modules


#: bases mypyc knows without analysing their module (Generic and Protocol: typing's own forms)
_KNOWN_BASES = {"builtins", "typing"}


def test_compiled_classes_derive_only_from_classes_mypyc_sees() -> None:
    """mypyc analyses the compiled modules alone (``--follow-imports=skip``): a class there whose
    base lives in another module is compiled as if its base were ``Any``, and crashed the
    interpreter when tried (a dataclass deriving from the policy's ``Policy``; a subclass of
    ``asyncio.Future``). Such a class stays in a module that is not compiled. (A property
    of the source: checked on either engine.)"""
    compiled = set(_compiled.MODULES)
    wrong = []
    for name in _compiled.MODULES:
        mod = importlib.import_module(name)
        for attr, cls in vars(mod).items():
            if isinstance(cls, type) and cls.__module__ == name:
                wrong += [f"{name}.{attr} derives from {b.__module__}.{b.__qualname__}" for b in cls.__mro__[1:]
                          if b.__module__ not in compiled and b.__module__ not in _KNOWN_BASES]
    assert not wrong


_PERMIT_INPUTS = r'''
import asyncio, sfq
from sfq.backends import Backend

class Nobody(Backend):  # acquire() calls no backend: the embedder's client would
    async def complete(self, endpoint, body): raise AssertionError
    async def stream(self, endpoint, body): raise AssertionError; yield {}

BODY = {"model": "m", "prompt": "x", "max_tokens": 5}

async def main():
    async with sfq.Dispatcher([Nobody("b", max_in_flight=4)]) as d:
        for flow, body, kw in [("f", None, {"cost": "3"}), ("f", None, {"cost": True}), ("f", None, {"cost": -1.0}),
                               ("f", None, {"cost": None}), ("f", None, {"cost": 1.0, "timeout": "1"}),
                               ("f", None, {"cost": 1.0, "timeout": True}), ("f", [1, 2], {}), ("f", "text", {}),
                               (["unhashable"], BODY, {}), ("f", {**BODY, "max_tokens": "5"}, {})]:
            try:
                async with d.acquire(flow, body, **kw):
                    print("entered")
            except Exception as exc:
                print(type(exc).__name__, exc)
        for call in ["g.fail(1.5)", "g.fail(True)", "g.fail('500')", "g.fail(500, '1')", "g.fail(500, True)",
                     "g.delivered('3')", "g.delivered(True)", "g.delivered(None)",
                     "g.finish(None, output_text_chars='3')", "g.finish(None, output_text_chars=True)",
                     "g.finish(None, output_text_chars=-1)"]:
            async with d.acquire("f", BODY) as g:
                try:
                    print(call, eval(call))
                except Exception as exc:
                    print(call, type(exc).__name__, exc)
        f = d.stats()["flows"]["f"]
        print("completed", f["completed"], "in flight", f["in_flight"])  # every grant left its block: ended

asyncio.run(main())
'''


def test_bad_input_to_a_permit_gets_the_twins_messages() -> None:
    """mypyc checks (and converts) what a compiled function's annotations say before the
    function's own checks run: a compiled ``acquire``/``Grant`` path must still answer bad
    input with the twin's errors and messages, not mypyc's ("float object expected")."""
    _compiled_here()
    outs = []
    for no_ext in ("0", "1"):
        p = subprocess.run([sys.executable, "-c", _PERMIT_INPUTS], env={**os.environ, "SFQ_NO_EXTENSIONS": no_ext},
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout)
    assert outs[0] == outs[1]
    assert "object expected" not in outs[0] and outs[0].count("ValueError") >= 10, outs[0]
    assert outs[0].splitlines()[-1] == "completed 11 in flight 0"  # a refused finish() left its grant open


def test_the_env_var_runs_the_engine_from_source() -> None:
    p = _run(_REPORT, SFQ_NO_EXTENSIONS="1")
    assert p.returncode == 0, p.stderr
    status, kinds, shared = p.stdout.splitlines()
    assert status == "source: SFQ_NO_EXTENSIONS=1"
    assert set(kinds.split()) == {"py"}
    assert shared == "False"  # the compiled library is not even loaded
    assert "RuntimeWarning" not in p.stderr


def _copy_of_the_package(tmp_path: Path) -> Path:
    """The installed package (compiled modules, record and the shared library) in tmp_path."""
    _compiled_here()
    site = tmp_path / "site"
    site.mkdir()
    shutil.copytree(Path(sfq.__file__).parent, site / "sfq", ignore=shutil.ignore_patterns("__pycache__"))
    spec = importlib.util.find_spec("sfq__mypyc")
    assert spec is not None and spec.origin is not None
    shutil.copy(spec.origin, site)
    return site


def test_a_copy_runs_compiled_and_an_edited_source_runs_as_source(tmp_path: Path) -> None:
    """An edited .py (an editable install after a change) must not run its stale build: the
    whole engine then runs from source, and one RuntimeWarning names the file and the fix."""
    site = _copy_of_the_package(tmp_path)
    p = _run(_REPORT, path=site)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["compiled", " ".join(["so"] * len(_compiled.MODULES)), "True"]

    retry = site / "sfq" / "policy" / "retry.py"
    retry.write_text(retry.read_text() + "\n# an edit\n")
    p = _run(_REPORT, path=site)
    assert p.returncode == 0, p.stderr
    status, kinds, shared = p.stdout.splitlines()
    assert status == f"source: {retry} changed since it was compiled"
    assert set(kinds.split()) == {"py"}  # all of them: they share one library
    assert shared == "False"
    assert p.stderr.count("RuntimeWarning") == 1
    assert "retry.py has changed since it was compiled" in p.stderr and "SFQ_MYPYC=1 pip install -e ." in p.stderr


@pytest.mark.parametrize("damage", ["missing", "garbled", "other modules", "a module gone"])
def test_without_a_sound_build_record_the_engine_runs_from_source(tmp_path: Path, damage: str) -> None:
    site = _copy_of_the_package(tmp_path)
    record = site / "sfq" / _compiled.RECORD
    if damage == "missing":
        record.unlink()
    elif damage == "garbled":
        record.write_text("{not json")
    elif damage == "other modules":
        doc = json.loads(record.read_text())
        doc["modules"].pop(_compiled.MODULES[0])
        record.write_text(json.dumps(doc))
    else:
        for so in (site / "sfq" / "engine").glob("pool.*"):
            if so.suffix != ".py":
                so.unlink()
    p = _run(_REPORT, path=site)
    assert p.returncode == 0, p.stderr
    status, kinds, _ = p.stdout.splitlines()
    assert status.startswith("source: "), status
    assert set(kinds.split()) == {"py"}


@pytest.mark.parametrize("args", [
    ["teams"],
    ["return", "--charge", "served"],
    ["nested"],
])
def test_compiled_and_source_engines_decide_alike(args: list[str]) -> None:
    """Whole simulated workloads (the engine decides for the simulator): the compiled engine's
    figures are the source's, byte for byte."""
    _compiled_here()
    cmd = [sys.executable, "-m", "sfq", "simulate", *args, "--json", "--no-plots"]
    outs = []
    for no_ext in ("0", "1"):
        env = {**os.environ, "SFQ_NO_EXTENSIONS": no_ext, "MPLBACKEND": "Agg"}
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout)
    assert outs[0] == outs[1]
    assert json.loads(outs[0])  # a real report, not an empty line


# One program per seed, run by the engine in a child process: random arrivals of every flow
# (fixed costs, estimates, streams), polls, completions with and without usage, tokens
# delivered, upstream failures and their retries, cancellations and the clock's steps, under
# the three charge modes. The child prints every decision and figure; the two engines must
# print the same, byte for byte.
_PROGRAMS = r'''
import json, random, sys
from sfq.cost import CostEstimator
from sfq.engine import PolicyEngine, BACKOFF, RUNNING, WAITING
from sfq.errors import BackendHTTPError, BackendUnavailable, Refused
from sfq.policy import Flow, parse_policy

TEXT = sys.stdin.read()  # the policy of tests/policy/test_policy_invariants.py

def run(seed, mode):
    rng = random.Random(seed)
    policy = parse_policy(TEXT + "cost: {charge: %s}\n" % mode)
    flows = [Flow(*f) for f in policy.flows()]
    now = [0.0]
    e = PolicyEngine(policy, clock=lambda: now[0], rng=random.Random(seed))
    est = CostEstimator()
    log = []
    def pick(state):
        rs = sorted((r for r in e.live.values() if r.state == state), key=lambda r: r.id)
        return rs[rng.randrange(len(rs))] if rs else None
    for _ in range(120):
        x = rng.random()
        if x < 0.35:
            f = flows[rng.randrange(len(flows))]
            try:
                if rng.random() < 0.5:
                    r = e.submit(f, cost=rng.choice([1, 50, 99, 100, 101, 2000, 9000]),
                                 tokens=rng.choice([0, 10, 500, 25000]), need=rng.choice([0, 100, 3000, 6000]))
                else:
                    body = {"model": "m", "max_tokens": rng.choice([16, 256, 2048]),
                            "messages": [{"role": "user", "content": "x" * rng.choice([10, 400, 5000])}]}
                    stream = rng.random() < 0.5
                    r = e.submit(f, estimate=est.estimate(body), streaming=stream, start=rng.random() < 0.5)
                log.append(("s", r.id, r.state, r.backend))
            except Refused as exc:
                log.append(("refused", exc.reason, exc.retry_after))
        elif x < 0.55:
            log.append(("p", [(r.id, r.backend) for r in e.poll()], [(r.id, r.outcome, r.reason) for r in e.dropped]))
        elif x < 0.7:
            r = pick(RUNNING)
            if r is not None:
                if r.streaming and rng.random() < 0.5:
                    log.append(("d", r.id, e.delivered(r, rng.choice([1, 7.5, 300]))))
                else:
                    e.complete(r, {"prompt_tokens": rng.randrange(1, 3000), "completion_tokens": rng.randrange(0, 3000)}
                               if rng.random() < 0.7 else None)
                    log.append(("c", r.id, r.charged, r.charged_total))
        elif x < 0.8:
            r = pick(RUNNING)
            if r is not None:
                kind = rng.choice(["429", "503", "500", "refused"])
                err = (BackendUnavailable("cannot connect", never_sent=True) if kind == "refused"
                       else BackendHTTPError(kind, status=int(kind), retry_after=1.0 if kind == "429" else None))
                d = e.fail(r, err)
                log.append(("f", r.id, d.retry, d.delay, r.outcome))
        elif x < 0.86:
            r = pick(BACKOFF)
            if r is not None:
                e.requeue(r)
                log.append(("rq", r.id, r.state, r.outcome, r.reason))
        elif x < 0.9:
            r = pick(rng.choice([WAITING, RUNNING, BACKOFF]))
            if r is not None:
                e.cancel(r)
                log.append(("x", r.id, r.outcome))
        else:
            now[0] += rng.choice([0.0, 0.01, 0.5, 2.0, 7.0, 30.0, 61.0])
    for name in sorted(e.queues):
        q = e.queues[name]
        log.append(("v", name, q.sched.virtual_time, sorted((tuple(f), q.sched.meter(f)) for f in q.flows)))
    log.append(("stats", e.stats()))
    return log

print(json.dumps([run(seed, mode) for mode in ("seed", "settle", "served") for seed in range(int(sys.argv[1]))],
                 sort_keys=True, default=repr))
'''


def test_random_programs_decide_alike() -> None:
    """Seeded random programs through the compiled engine and through its source: the same
    starts, backends, drops, refusals, retries, charges, meters and statistics."""
    _compiled_here()
    path = Path(__file__).parent / "policy" / "test_policy_invariants.py"
    spec = importlib.util.spec_from_file_location("sfq_tests_policy_invariants", path)
    assert spec is not None and spec.loader is not None
    invariants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(invariants)
    outs = []
    for no_ext in ("0", "1"):
        env = {**os.environ, "SFQ_NO_EXTENSIONS": no_ext}
        p = subprocess.run([sys.executable, "-c", _PROGRAMS, "40"], env=env, capture_output=True, text=True,
                           input=invariants.POLICY_TEXT, timeout=300)
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout)
    programs = json.loads(outs[0])
    assert len(programs) == 120 and sum(len(p) for p in programs) > 120 * 80
    assert sum(1 for p in programs for step in p if step[0] == "p" and step[1]) > 500  # real starts happened
    assert outs[0] == outs[1]
