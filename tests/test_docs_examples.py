"""Every example of the shipped docs runs (or, where running it takes minutes or never ends, is
checked against the command it names); the README's gateway quick start runs as written and
shows the fairness it promises; tables marked as a command's output are that output.
Examples that talk to a server (docs/library.md's, docs/API.md's, docs/policy.md's...) run
against a real ``sfq demo-backend`` started with its defaults, so one that names a model the
demo engine does not serve fails. How blocks are found, run and checked:
``tests/docs_examples.py``."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from docs_examples import (
    DEMO_MODEL,
    ENGINE_PORT,
    ROOT,
    Block,
    Sandbox,
    _demo_default,
    all_blocks,
    blocks,
    commands,
    from_tables,
    is_policy,
    needs,
    policy_before,
    run_by,
    words,
)

import sfq
from sfq.cli import build_parser

SOURCE_TREE = all((ROOT / p).exists() for p in ("python/sfq", "README.md", "docs", "benchmarks", ".ci/run"))
pytestmark = pytest.mark.skipif(not SOURCE_TREE, reason="needs the source tree (the docs and what they run)")

BLOCKS = all_blocks() if SOURCE_TREE else []
LANGS = {"python", "yaml", "sh", "bash", "json", "jsonl", "promql", "text", ""}


def _extras() -> set[str]:
    """The extras pyproject.toml declares (read without tomllib, which Python 3.10 lacks)."""
    text = (ROOT / "pyproject.toml").read_text() if (ROOT / "pyproject.toml").is_file() else ""
    section = text.split("[project.optional-dependencies]", 1)[-1].split("\n[", 1)[0] if text else ""
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*=\s*\[", section, re.M))


EXTRAS = _extras()


def _ids(kind: set[str], quickstart: bool = False) -> list[Block]:
    return [b for b in BLOCKS if b.lang in kind and (("quickstart" in b.marks) == quickstart)]


def _ok(res: subprocess.CompletedProcess[str], what: str) -> str:
    assert res.returncode == 0 and "Traceback" not in res.stdout, f"{what} failed:\n{res.stdout[-4000:]}"
    return res.stdout


def test_every_fenced_block_is_a_known_kind():
    unknown = [f"{b.id} ({b.lang})" for b in BLOCKS if b.lang not in LANGS]
    assert not unknown, "label them python, yaml, sh, json, jsonl, promql or text: " + ", ".join(unknown)
    assert len(_ids({"python"})) >= 4 and len(_ids({"sh", "bash"})) >= 6  # the docs have examples


# ------------------------------------------------------------------ python
def _run_python(block: Block, text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``text`` (the block's, or a changed copy) as a script in a sandbox, with the demo
    engine (at its defaults) and the gateway it names answering on loopback."""
    sb = Sandbox(tmp_path, policy_before(block))
    (tmp_path / "example.py").write_text(sb.ports_in(text), encoding="utf-8")
    engine, gateway = needs(text)
    return sb.run("python example.py", servers=engine, gateway=gateway, timeout=120)


@pytest.mark.parametrize("block", _ids({"python"}), ids=lambda b: b.id)
def test_python_example_runs(block: Block, tmp_path: Path):
    if run_by(block):
        pytest.skip(f"a server: run as written by {run_by(block)}")
    _ok(_run_python(block, block.text, tmp_path), block.id)


def test_every_block_run_by_a_test_is_run_by_it():
    """A ``run-by`` block names a test file that exists and reads the blocks marked for it."""
    marked = {run_by(b): b.id for b in BLOCKS if run_by(b)}
    assert marked, "docs/API.md's FastAPI app and docs/library.md's example proxy are run by their tests"
    for test, block in marked.items():
        path = ROOT / test
        assert path.is_file(), f"{block}: no {test}"
        assert f'marked_run_by("{test}")' in path.read_text(encoding="utf-8"), f"{test} does not run {block}"


# the model names an example sends or a policy maps ("model": "x", model="x", models: [x, y])
_MODEL_LITERAL = re.compile(r"""["']model["']\s*:\s*["']([^"']*)["']|\bmodel\s*=\s*["']([^"']*)["']""")
_SERVED = re.compile(r"(127\.0\.0\.1|localhost):(8001|8080)\b")


def _models_named(b: Block) -> set[str]:
    """The models an example that reaches the demo engine (directly, or through the gateway on
    8080) asks for; for a policy block, the models of its pools that have a backend on 8001."""
    import yaml

    if b.lang == "yaml":
        if not is_policy(b.text):
            return set()
        return {str(m) for pool in yaml.safe_load(b.text)["pools"].values()
                if any(re.search(r"(127\.0\.0\.1|localhost):8001\b", str(x.get("url", ""))) for x in pool["backends"])
                for m in pool["models"]}
    if not _SERVED.search(b.text):
        return set()
    found = {a or c for a, c in _MODEL_LITERAL.findall(b.text)}
    for m in re.finditer(r"^\s*(?:\w[\w-]*:\s*\{\s*)?models:\s*\[([^\]]*)\]", b.text, re.M):
        found |= {x.strip().strip("'\"") for x in m.group(1).split(",") if x.strip()}
    return found


def test_every_example_asks_the_demo_engine_for_its_own_model():
    """The demo engine, started as the docs start it, serves one model: every example that
    reaches it (and every policy file of the docs with a backend where it listens) names that
    one, so each runs as written on a reader's machine (the runs above would fail too, with
    the engine's 404; this names the block and the model at once)."""
    assert _demo_default("port") == str(ENGINE_PORT), "the docs' demo engine listens on its default port"
    wrong = {f"{b.id}: {sorted(_models_named(b) - {DEMO_MODEL})}" for b in BLOCKS
             if b.lang in {"python", "sh", "bash", "yaml"} and _models_named(b) - {DEMO_MODEL}}
    import yaml

    for f in sorted((ROOT / "docs").glob("*.yaml")):
        doc = yaml.safe_load(f.read_text(encoding="utf-8"))
        for pool in doc["pools"].values():
            # a pool served by the demo engine alone (policy-teams.yaml, the simulator's, has two servers)
            alone = [re.search(r"127\.0\.0\.1:8001\b", x["url"]) is not None for x in pool["backends"]] == [True]
            if alone and pool["models"] != [DEMO_MODEL]:
                wrong.add(f"{f.relative_to(ROOT)}: {pool['models']}")
    assert not wrong, f"`sfq demo-backend` serves only {DEMO_MODEL!r}; these examples name others:\n" + "\n".join(
        sorted(wrong))


def test_an_example_naming_another_model_fails_against_the_demo_engine(tmp_path: Path):
    """The runs use a real demo engine at its defaults: the conveniences' example of
    docs/library.md, asking for a model it does not serve, fails with the engine's 404."""
    block = next(b for b in BLOCKS if b.doc.name == "library.md" and b.lang == "python" and ".submit(" in b.text)
    assert f'"model": "{DEMO_MODEL}"' in block.text
    res = _run_python(block, block.text.replace(f'"model": "{DEMO_MODEL}"', '"model": "llama-3-8b"'), tmp_path)
    assert res.returncode != 0 and "Traceback" in res.stdout, res.stdout[-3000:]
    assert f"serves model {DEMO_MODEL!r} only, got 'llama-3-8b'" in res.stdout, res.stdout[-3000:]


# ------------------------------------------------------------------ policies
@pytest.mark.parametrize("block", _ids({"yaml"}), ids=lambda b: b.id)
def test_policy_example_is_valid(block: Block):
    if is_policy(block.text):
        sfq.parse_policy(block.text)
        return
    # a section of the policy above it in the same document
    import yaml

    base = yaml.safe_load(policy_before(block))
    section = yaml.safe_load(block.text)
    assert isinstance(section, dict) and not set(section) & set(base), block.id
    from sfq.policy import policy_from_mapping

    policy_from_mapping({**base, **section})


# ------------------------------------------------------------------ shell
def _help_of(target: list[str]) -> str:
    res = subprocess.run([sys.executable, *target, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=Sandbox.plain_env())
    assert res.returncode == 0, f"{' '.join(target)} --help failed:\n{res.stdout}{res.stderr}"
    return res.stdout


def check_command(cmd: str, block: Block) -> list[str]:
    """Check one command line; return the parts to run in the sandbox."""
    to_run: list[str] = []
    for part in re.split(r"\s+&&\s+", cmd):
        w = words(part)
        if not w:
            continue
        if w[:2] == ["pip", "install"]:
            for extras in re.findall(r"\[([\w,-]+)\]", part):
                unknown = set(extras.split(",")) - EXTRAS
                assert not unknown, f"{block.id}: no such extra {sorted(unknown)} in pyproject.toml"
        elif w[:2] == ["pip", "wheel"]:
            assert "." in w, part
        elif w[0] == "sfq":
            if w[1] == "check-config":
                to_run.append(part)
            else:  # never ends (serve, demo-backend) or takes its time (simulate): its own parser checks it
                if w[-1] == "&":
                    assert "quickstart" in block.marks or run_by(block), \
                        f"{block.id}: a background server outside the quick start and the blocks a test runs"
                    w = w[:-1]
                try:
                    build_parser().parse_args(w[1:])
                except SystemExit as exc:
                    raise AssertionError(f"{block.id}: sfq rejects {part!r}") from exc
        elif w[0] == "curl":
            to_run.append(part)
        elif w[0] == "python":
            target = w[1:3] if w[1] == "-m" else w[1:2]
            if target[0].endswith(".py"):
                assert (ROOT / target[0]).is_file(), f"{block.id}: no {target[0]}"
            if target == ["-m", "pytest"] and len(w) == 3:
                continue  # the README's test command (checked against .ci/run)
            if w[-1] == "&":
                assert run_by(block), f"{block.id}: a background server outside the blocks a test runs"
            text = _help_of(target + [x for x in w[len(target) + 1:] if not x.startswith("-")][:1]
                            if target == ["-m", "pytest"] else target)
            for opt in (x.split("=")[0] for x in w[len(target) + 1:] if x.startswith("--")):
                assert opt in text, f"{block.id}: {' '.join(target)} has no option {opt}"
        elif w[0] == "kill":
            assert "quickstart" in block.marks or run_by(block), part
        else:
            raise AssertionError(f"{block.id}: no rule for {part!r}; tests/test_docs_examples.py must know how "
                                 "to run or check it")
    return to_run


@pytest.mark.parametrize("block", _ids({"sh", "bash"}), ids=lambda b: b.id)
def test_shell_example(block: Block, tmp_path: Path):
    sb = Sandbox(tmp_path, policy_before(block))
    script = []
    for cmd in commands(block.text):
        for part in check_command(cmd, block):
            script.append(f"{sb.ports_in(part)} || {{ echo {shlex.quote('FAILED: ' + part)}; exit 1; }}")
    if not script or run_by(block):
        return  # (a block a test runs: that test runs it as written)
    out = _ok(sb.run("\n".join(script), servers=any("curl" in s for s in script), timeout=120), block.id)
    expect = [m.split(":", 1)[1].strip() for m in block.marks if m.startswith("expect:")]
    codes = re.findall(r'"error":\s*\{[^{}]*?"code":\s*"([^"]*)"', out)
    if expect:  # it shows a refusal: there is one, and every error it prints is one
        assert codes and set(codes) == set(expect) and out.count('"error":') == len(codes), \
            f"{block.id}: expected only {expect} errors:\n{out[-3000:]}"
    else:
        assert '"error":' not in out, f"{block.id}: an example answered an error:\n{out[-3000:]}"


def test_the_readme_test_command_is_what_ci_runs():
    test_cmd = next(c for b in blocks(ROOT / "README.md") if b.lang in ("sh", "bash")
                    for c in commands(b.text) if "python -m pytest" in c)
    assert test_cmd.split("#")[0].strip() in (ROOT / ".ci" / "run").read_text(), \
        "the README's test command and .ci/run's must be the same"


# ------------------------------------------------------------------ the rest
@pytest.mark.parametrize("block", _ids({"json"}), ids=lambda b: b.id)
def test_json_example_parses(block: Block):
    import json

    json.loads(block.text)


@pytest.mark.parametrize("block", _ids({"jsonl"}), ids=lambda b: b.id)
def test_trace_example_reads(block: Block):
    from sfq.sim.model import read_trace_lines

    wl = read_trace_lines(block.text.splitlines())
    assert len(wl.flows) >= 1


@pytest.mark.parametrize("block", _ids({"promql"}), ids=lambda b: b.id)
def test_promql_names_series_the_policy_exports(block: Block):
    source = (ROOT / "python" / "sfq" / "policy" / "metrics.py").read_text()
    for name in set(re.findall(r"\b(sfq_\w+?)(?:_bucket|_count|_sum)?\b", block.text)):
        assert f'"{name}"' in source or f"'{name}'" in source, f"{block.id}: no series {name}"


_OUTPUTS: dict[str, str] = {}


@pytest.mark.parametrize("doc, line, cmd, rows", [(d, line, cmd, rows) for d in
                                                   ([ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
                                                    if SOURCE_TREE else [])
                                                   for line, cmd, rows in from_tables(d)],
                         ids=lambda x: x.name if isinstance(x, Path) else str(x)[:40])
def test_tables_are_the_commands_output(doc: Path, line: int, cmd: str, rows: list[str]):
    if cmd not in _OUTPUTS:
        w = words(cmd)
        assert w[:2] == ["sfq", "simulate"], f"{doc.name}:{line}: only sfq simulate's output is checked"
        res = subprocess.run([sys.executable, "-m", "sfq", *w[1:]], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env=Sandbox.plain_env())
        assert res.returncode == 0, res.stderr
        _OUTPUTS[cmd] = res.stdout
    out = _OUTPUTS[cmd].splitlines()
    missing = [r for r in rows if r not in out]
    assert not missing, f"{doc.name}:{line}: not in `{cmd}`'s output (rerun it and paste):\n" + "\n".join(missing)


# ------------------------------------------------------------------ the quick start
def test_the_gateway_quick_start_runs_as_written_and_is_fair(tmp_path: Path):
    """The README's quick start, block after block, as written (ports as written too, in a
    network namespace of the test's own; the install line is this environment's own)."""
    qs = [b for b in blocks(ROOT / "README.md") if "quickstart" in b.marks]
    assert [b.lang for b in qs] == ["sh", "python", "sh"]
    sb = Sandbox(tmp_path)
    script = []
    for k, b in enumerate(qs):
        if b.lang == "python":
            (tmp_path / f"quickstart_{k}.py").write_text(sb.ports_in(b.text), encoding="utf-8")
            script.append(f"python quickstart_{k}.py")
        else:
            script += [sb.ports_in(c) for c in commands(b.text) if words(c)[:2] != ["pip", "install"]]
    out = _ok(sb.run("\n".join(script), timeout=180), "the quick start")
    ranges = {m.group(1): (int(m.group(2)), float(m.group(3)), float(m.group(4))) for m in re.finditer(
        r"^(analytics|product): (\d+) requests, first token after ([\d.]+) to ([\d.]+) s$", out, re.M)}
    assert ranges.keys() == {"analytics", "product"}, out
    assert ranges["analytics"][0] == 16 and ranges["product"][0] == 4
    # product's questions start at the next free slots; analytics' last ones wait behind the rest
    assert ranges["product"][2] < ranges["analytics"][2] / 2, out
    org_of = {"batch": "analytics", "interactive": "product"}  # (each org sends one class)
    waits = {org_of[m.group(1)]: float(m.group(2)) for m in re.finditer(
        r'^sfq_queue_wait_seconds_sum\{class="(\w+)",pool="local"\} ([\d.e+-]+)$', out, re.M)}
    assert waits["product"] / 4 < waits["analytics"] / 16, out  # the mean wait before start, per org
    assert '"status": "ok"' in out or '"status":"ok"' in out, out  # /health answered before the calls
