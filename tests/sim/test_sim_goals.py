"""The goals table: medians over seeds, formatted for the README."""

from __future__ import annotations

import pytest

from sfq.sim import goals


def test_markdown_of_medians():
    labels = [v[0] for v in goals._variants()]

    def per(value, at=None, step=1.0):
        out = {}
        for k, x in enumerate(labels):
            entry = {"values": [value + k * step], "median": value + k * step}
            if at:
                entry["drift_at_median"] = at
            out[x] = entry
        return out

    doc = {"drift": per(1000.0), "return": per(0.4, step=0.01), "keep-one": per(0.45, step=0.01),
           "shallow": per(2000.0, {"10000": 1500.0, "40000": 2000.0})}
    md = goals.markdown(doc).splitlines()
    assert md[0] == "| scenario (metric) | " + " | ".join(labels) + " |"
    assert md[2].startswith("| drift (max_drift) | 1,000 | 1,001 |")
    assert md[3].startswith("| return (returning_share) | 40.0% | 41.0% |")  # shares as percentages
    assert "| shallow, drift to step 10,000 | 1,500 |" in "\n".join(md)
    assert md[-1].startswith("| keep-one (keeper_share) | 45.0% |")


def test_bad_seeds_are_named(capsys):
    with pytest.raises(SystemExit):
        goals.main(["--seeds", "a-b"])
    assert "--seeds must be LO-HI, got 'a-b'" in capsys.readouterr().err
