"""The ``sfq`` command's face: --version, python -m sfq, plain ``sfq``, and help that
explains every scenario, policy and trace field it accepts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import sfq
from sfq import _cli_help as words
from sfq.cli import _POLICIES, _SCENARIOS, build_parser, main


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"sfq {sfq.__version__} (sfq-scheduler)"


def test_python_dash_m_sfq_is_the_command():
    out = subprocess.run([sys.executable, "-m", "sfq", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"sfq {sfq.__version__} (sfq-scheduler)"
    out = subprocess.run([sys.executable, "-m", "sfq"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "simulate" in out.stdout


def test_plain_sfq_prints_help_and_succeeds(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: sfq") and "simulate" in out and "--version" in out


def test_help_imports_nothing_heavy():
    code = "import sys; from sfq.cli import main\ntry:\n    main(['simulate', '--help'])\nexcept SystemExit:\n    pass\n"
    code += "print('loaded:', *(m for m in ('numpy', 'rich', 'matplotlib', 'aiohttp', 'sfq.sim') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SFQ_NO_EXTENSIONS": "1"})  # the twin: the compiled core's numpy aside
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "loaded:"


def test_every_scenario_and_policy_is_named_once_and_explained():
    from sfq.sim.policies import POLICIES
    from sfq.sim.scenarios import SCENARIOS

    assert list(_SCENARIOS) == list(SCENARIOS) == list(words.SCENARIOS)
    assert list(_POLICIES) == list(POLICIES) == list(words.POLICIES)
    for table in (words.SCENARIOS, words.POLICIES, words.TRACE_FIELDS, words.OUTPUT):
        for name, text in table.items():
            assert len(text.split()) >= 7, f"{name!r} is not explained: {text!r}"


def test_simulate_help_is_complete_and_cites_what_ships(capsys):
    from sfq.sim import model

    parser = build_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["simulate", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for name in (*_SCENARIOS, *_POLICIES):
        assert f"\n  {name} " in text, name
    # every field the trace reader accepts is documented
    fields = set(model._TRACE_FIELDS) | set(model._CLOSED_FIELDS) | {"max_tokens", "flows"}
    for f in fields:
        assert f in text, f
    assert "seed 00" not in text.lower()
    assert max(len(line) for line in text.splitlines()) <= 80
    for doc in ("docs/simulator.md", "docs/design.md"):
        assert doc in text
