"""``sfq check-config``: the resolved policy as tables; a bad file names the field."""

from __future__ import annotations

import pytest
from policy_helpers import EXAMPLE

from sfq.cli import main


def test_valid_file_prints_flows_shares_and_limits(tmp_path, capsys) -> None:
    p = tmp_path / "policy.yaml"
    p.write_text(EXAMPLE)
    assert main(["check-config", str(p), "--plain"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    row = next(line.split() for line in lines if line.startswith("local-gpu") and "product" in line
               and "interactive" in line)
    assert row[-2:] == ["6", "46.2%"]  # 6 of 1 + 6 + 6
    assert any(line.split()[:2] == ["local-gpu", "analytics"] and line.split()[-1] == "7.7%" for line in lines)
    assert "first (capped)" in out  # the strict class
    assert "180000" in out and "900" in out and "24" in out  # pool limits
    assert "max_attempts 3" in out and "budget 10%" in out
    assert "valid (1 pools, 3 classes, 2 orgs, 4 flows)" in out
    assert "sk-analytics-1" not in out  # keys are never printed


def test_rich_tables(tmp_path, capsys) -> None:
    pytest.importorskip("rich")
    p = tmp_path / "policy.yaml"
    p.write_text(EXAMPLE)
    assert main(["check-config", str(p)]) == 0
    out = capsys.readouterr().out
    assert "46.2%" in out and "Flows" in out


def test_bad_file_names_the_field(tmp_path, capsys) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(EXAMPLE.replace("batch:       {weight: 1", "batch:       {weight: -1"))
    assert main(["check-config", str(p)]) == 1
    err = capsys.readouterr().err
    assert f"{p}: classes.batch.weight: must be a number > 0, got -1" in err


def test_missing_file(tmp_path, capsys) -> None:
    assert main(["check-config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_keyless_orgs_and_the_template_are_noted(tmp_path, capsys) -> None:
    p = tmp_path / "policy.yaml"
    p.write_text(EXAMPLE.replace('    keys: ["sk-product-1"]\n', "") + "org_template: {classes: [batch], weight: 2}\n")
    assert main(["check-config", str(p), "--plain"]) == 0
    out = capsys.readouterr().out
    assert "note: org product has no keys: sfq serve cannot authenticate its requests" in out
    assert "note: org_template:" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("(org_template)"))
    assert row[:3] == ["(org_template)", "-", "batch"]
    assert "valid (1 pools, 3 classes, 2 orgs, an org template, 4 flows)" in out
