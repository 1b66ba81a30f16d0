"""JSONL trace replay and the ``sfq simulate`` command, through ``main([...])``."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from sfq.cli import main
from sfq.sim.engine import Fleet, simulate
from sfq.sim.metrics import flow_summary, max_drift
from sfq.sim.model import load_trace, read_trace_lines, save_trace
from sfq.sim.scenarios import Options, workload_for


def test_trace_round_trip_replays_the_same_run(tmp_path):
    wl = workload_for("return", Options(seed=3, steps=800))
    path = tmp_path / "t.jsonl"
    save_trace(wl, path)
    back = load_trace(path)
    for col in ("arrival", "flow", "prompt", "output", "max_tokens"):
        assert np.array_equal(getattr(wl, col), getattr(back, col)), col
    assert back.flow_names == wl.flow_names
    a = simulate(wl, "vtc", Fleet(1, 8192), horizon=1500)
    b = simulate(back, "vtc", Fleet(1, 8192), horizon=1500)
    assert a.admit.tolist() == b.admit.tolist()
    assert max_drift(a) == max_drift(b)
    assert flow_summary(a) == flow_summary(b)


def test_trace_format_details():
    text = "\n".join([
        '# comment',
        '{"arrival": 2.5, "flow": "bob", "prompt_tokens": 10, "output_tokens": 4}',
        '',
        '{"arrival": 0, "flow": 7, "prompt_tokens": 20, "output_tokens": 5, "max_tokens": 8}',
    ])
    wl = read_trace_lines(io.StringIO(text), {"bob": 2.0})
    assert wl.flow_names == ["bob", "7"]  # in order of first appearance
    assert [f.weight for f in wl.flows] == [2.0, 1.0]
    assert wl.arrival.tolist() == [0, 3]  # sorted; 2.5 rounds up to the first step at or after
    assert wl.max_tokens.tolist() == [8, 4]  # max_tokens defaults to output_tokens


@pytest.mark.parametrize(
    "line, err",
    [
        ("{not json", r"<trace>:1: not valid JSON"),
        ('{"arrival": 0, "flow": "a", "prompt_tokens": 3}', r"<trace>:1: missing field 'output_tokens'"),
        ('{"arrival": -1, "flow": "a", "prompt_tokens": 3, "output_tokens": 1}', r"arrival must be .* got -1"),
        ('{"arrival": 0, "flow": "a", "prompt_tokens": 0, "output_tokens": 1}', r"prompt_tokens must be an int >= 1, got 0"),
        ('{"arrival": 0, "flow": "a", "prompt_tokens": 3, "output_tokens": 5, "max_tokens": 4}',
         r"max_tokens 4 is smaller than output_tokens 5"),
        ('[1, 2]', r"expected a JSON object"),
    ],
)
def test_bad_trace_lines_are_named(line, err):
    with pytest.raises(ValueError, match=err):
        read_trace_lines([line])


def test_weights_for_unknown_flows_are_refused():
    with pytest.raises(ValueError, match=r"weights given for flows not in <trace>: \['zed'\]"):
        read_trace_lines(['{"arrival": 0, "flow": "a", "prompt_tokens": 3, "output_tokens": 1}'], {"zed": 2.0})


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_is_one_document_and_byte_identical(capsys):
    args = ("simulate", "return", "--steps", "1200", "--json", "--no-plots", "-p", "fifo,vtc", "-p", "sfq")
    code, out1, _ = run_cli(capsys, *args)
    assert code == 0
    code, out2, _ = run_cli(capsys, *args)
    assert out1 == out2
    doc = json.loads(out1)
    assert doc["scenario"] == "return"
    assert [r["policy"] for r in doc["results"]] == ["fifo", "vtc", "sfq"]
    assert doc["params"]["phase1_steps"] == 1200


def test_cli_headline_runs_teams_and_return(capsys):
    code, out, _ = run_cli(capsys, "simulate", "--json", "--no-plots", "--steps", "1500", "-p", "prio,sfq")
    assert code == 0
    doc = json.loads(out)
    assert doc["scenario"] == "headline"
    assert list(doc["params"]) == ["teams", "return"]
    assert [(r["scenario"], r["policy"]) for r in doc["results"]] == [
        ("teams", "prio"), ("teams", "sfq"), ("return", "prio"), ("return", "sfq")]


def test_cli_tables_and_plots(capsys, tmp_path):
    out_dir = tmp_path / "plots"
    code, out, _ = run_cli(capsys, "simulate", "teams", "--steps", "2000", "-p", "fifo,sfq", "--out", str(out_dir))
    assert code == 0
    assert "teams: 400 batch jobs from A at step 0" in out and "sfq" in out
    pngs = sorted(p.name for p in out_dir.iterdir())
    assert pngs == ["teams-service.png", "teams-waits.png"]
    first = (out_dir / "teams-service.png").read_bytes()
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    run_cli(capsys, "simulate", "teams", "--steps", "2000", "-p", "fifo,sfq", "--out", str(out_dir))
    assert (out_dir / "teams-service.png").read_bytes() == first  # same run, same bytes


def test_cli_markdown(capsys):
    code, out, _ = run_cli(capsys, "simulate", "drift", "--steps", "1000", "-p", "vtc", "--markdown", "--no-plots")
    assert code == 0
    assert "| policy | max drift (W) |" in out and "| vtc |" in out


def test_cli_trace_replay(capsys, tmp_path):
    trace = tmp_path / "w.jsonl"
    assert main(["simulate", "drift", "--steps", "800", "--write-trace", str(trace)]) == 0
    assert trace.read_text().count("\n") > 10
    code, out, _ = run_cli(capsys, "simulate", "trace", "--trace", str(trace), "--json", "--no-plots",
                           "-p", "fifo,sfq", "--weight", "client-0=2")
    assert code == 0
    doc = json.loads(out)
    assert doc["params"]["flows"]["client-0"]["weight"] == 2.0
    for row in doc["results"]:
        assert sum(f["completed"] for f in row["flows"].values()) == doc["params"]["requests"]


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["simulate", "nope"], "invalid choice: 'nope'"),
        (["simulate", "-p", "bogus"], "unknown policy 'bogus'"),
        (["simulate", "--seed", "-1"], "expected an integer >= 0, got '-1'"),
        (["simulate", "--kv", "0"], "expected an integer >= 1, got '0'"),
        (["simulate", "trace"], "needs --trace"),
        (["simulate", "--weight", "a"], "expected FLOW=WEIGHT"),
    ],
)
def test_cli_bad_arguments(capsys, argv, msg):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert msg in capsys.readouterr().err


def test_cli_missing_trace_file(capsys, tmp_path):
    code, _, err = run_cli(capsys, "simulate", "trace", "--trace", str(tmp_path / "none.jsonl"), "--no-plots")
    assert code == 2
    assert "none.jsonl" in err


def test_cli_no_command_prints_help(capsys):
    assert main([]) == 0  # plain `sfq`: help, and success
    assert "simulate" in capsys.readouterr().out


def test_trace_header_declares_flows_in_order():
    text = [
        '{"flows": [{"name": "b", "weight": 6, "class": "interactive", "priority": 0}, {"name": "a", "priority": 1}]}',
        '{"arrival": 0, "flow": "a", "prompt_tokens": 3, "output_tokens": 1}',
        '{"arrival": 1, "flow": "c", "prompt_tokens": 3, "output_tokens": 1}',
    ]
    wl = read_trace_lines(text, {"a": 3.0})
    assert [(f.name, f.weight, f.klass, f.priority) for f in wl.flows] == [
        ("b", 6.0, "interactive", 0), ("a", 3.0, "default", 1), ("c", 1.0, "default", 0)]
    with pytest.raises(ValueError, match="<trace>:2: the flows header must come first"):
        read_trace_lines([text[1], text[0]])
    with pytest.raises(ValueError, match="weight of flow 'b'"):
        read_trace_lines(['{"flows": [{"name": "b", "weight": -1}]}'])


def test_closed_loop_trace_lines_parse_replay_and_round_trip(tmp_path):
    text = [
        '{"arrival": 0, "flow": "a", "prompt_tokens": 30, "output_tokens": 5}',
        '{"flow": "a", "keep_waiting": 1}',
        '{"flow": "b", "keep_waiting": 2, "prompt_tokens": [100, 200], "output_tokens": [5, 9], "max_tokens": 16,'
        ' "start": 10, "end": 400}',
    ]
    wl = read_trace_lines(text, seed=3)
    assert wl.flow_names == ["a", "b"] and len(wl) == 1
    a, b = wl.closed
    assert (a.flow, a.keep, a.prompt, a.output, a.cap, a.start, a.end, a.seed) == (0, 1, (64, 512), (32, 384), 384,
                                                                                 0, None, 3)
    assert (b.flow, b.keep, b.prompt, b.output, b.cap, b.start, b.end) == (1, 2, (100, 200), (5, 9), 16, 10, 400)
    path = tmp_path / "c.jsonl"
    save_trace(wl, path)
    back = load_trace(path, seed=3)
    assert back.closed == wl.closed
    res = simulate(back, "sfq", Fleet(1, 8192), horizon=600)
    mb = res.flow == 1
    assert res.arrival[mb].min() == 10 and res.arrival[mb].max() < 400
    assert (res.prompt[mb] >= 100).all() and (res.prompt[mb] <= 200).all() and (res.output[mb] <= 9).all()


@pytest.mark.parametrize(
    "line, err",
    [
        ('{"keep_waiting": 1}', r"<trace>:1: missing field 'flow'"),
        ('{"flow": "a", "keep_waiting": 0}', r"<trace>:1: keep_waiting must be an int >= 1, got 0"),
        ('{"flow": "a", "keep_waiting": true}', r"keep_waiting must be an int >= 1, got True"),
        ('{"flow": "a", "keep_waiting": 1, "prompt_tokens": 5}', r"prompt_tokens of a keep_waiting line must be \[lo, hi\]"),
        ('{"flow": "a", "keep_waiting": 1, "output_tokens": [9, 3]}', r"output_tokens .* got \[9, 3\]"),
        ('{"flow": "a", "keep_waiting": 1, "output_tokens": [1, 30], "max_tokens": 20}',
         r"max_tokens 20 is smaller than the largest output_tokens 30"),
        ('{"flow": "a", "keep_waiting": 1, "start": 5, "end": 5}', r"end 5 must be after start 5"),
        ('{"flow": "a", "keep_waiting": 1, "start": -1}', r"start must be an int >= 0, got -1"),
        ('{"flow": "a", "keep_waiting": 1, "arrival": 3}', r"unknown field 'arrival' in a keep_waiting line"),
    ],
)
def test_bad_closed_loop_lines_are_named(line, err):
    with pytest.raises(ValueError, match=err):
        read_trace_lines([line])


def test_a_flow_has_one_closed_loop_line():
    with pytest.raises(ValueError, match=r"<trace>:2: flow 'a' already has a keep_waiting line \(<trace>:1\)"):
        read_trace_lines(['{"flow": "a", "keep_waiting": 1}', '{"flow": "a", "keep_waiting": 2}'])


def test_cli_closed_loop_trace_replays_the_scenario(capsys, tmp_path):
    trace = tmp_path / "shallow.jsonl"
    assert main(["simulate", "shallow", "--steps", "3000", "--seed", "2", "--write-trace", str(trace)]) == 0
    assert trace.read_text().count('"keep_waiting": 1') == 2
    args = ("--json", "--no-plots", "-p", "sfq,vtc", "--seed", "2", "--steps", "3000")
    code, out, _ = run_cli(capsys, "simulate", "shallow", *args)
    assert code == 0
    code, out2, _ = run_cli(capsys, "simulate", "trace", "--trace", str(trace), *args)
    assert code == 0
    scen, rep = json.loads(out), json.loads(out2)
    assert rep["params"]["closed_loop"] == {"client-0": 1, "client-1": 1}
    assert [r["max_drift"] for r in rep["results"]] == [r["max_drift"] for r in scen["results"]]
    assert [r["charge"] for r in rep["results"]] == ["served", None]
    # a closed-loop client without an end needs a horizon
    open_ended = tmp_path / "open.jsonl"
    open_ended.write_text('{"flow": "a", "keep_waiting": 1}\n')
    code, _, err = run_cli(capsys, "simulate", "trace", "--trace", str(open_ended), "--no-plots")
    assert code == 2 and "give a horizon (--steps N)" in " ".join(err.split())  # rich wraps lines


def test_cli_charge_mode(capsys):
    rows = {}
    for charge in ("seed", "settle", "served"):
        code, out, _ = run_cli(capsys, "simulate", "drift", "--steps", "1500", "-p", "sfq", "--charge", charge,
                               "--json", "--no-plots")
        assert code == 0
        rows[charge] = json.loads(out)["results"][0]
        assert rows[charge]["charge"] == charge
    assert len({r["max_drift"] for r in rows.values()}) > 1  # the modes order differently
    with pytest.raises(SystemExit):
        main(["simulate", "drift", "--charge", "later"])
    assert "invalid choice: 'later'" in capsys.readouterr().err
