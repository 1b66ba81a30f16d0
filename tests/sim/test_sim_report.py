"""``sfq simulate``'s tables and plots as a reader sees them: the headline tables fit in 100
columns, waits still open at the end of the run are marked, the panels of a plot share axes."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

from rich.console import Console  # noqa: E402

from sfq.sim import plots  # noqa: E402
from sfq.sim.report import censored_wait_quantiles, markdown_table, rich_table, table_rows  # noqa: E402
from sfq.sim.scenarios import Options, run_scenario  # noqa: E402


@pytest.fixture(scope="module")
def teams():
    return run_scenario("teams", Options(), ["fifo", "prio", "sfq"])  # the default length: the widest numbers


@pytest.fixture(scope="module")
def ret():
    return run_scenario("return", Options(), ["fifo", "lcf", "sfq"])


def _width(table) -> int:
    buf = io.StringIO()
    Console(file=buf, width=300, force_terminal=False).print(table)
    return max(len(line.rstrip()) for line in buf.getvalue().splitlines())


def test_the_headline_tables_fit_in_100_columns(teams, ret):
    for res in (teams, ret):
        assert _width(rich_table(res)) <= 100, res.scenario


def test_teams_table_says_what_its_numbers_are(teams):
    _, headers, rows, _ = table_rows(teams)
    flat = [h.replace("\n", " ") for h in headers]
    assert flat == ["policy", "B interactive wait p50 / p99, steps", "C batch wait p50 / p99, steps",
                    "% of service A / B / C", "done of 400/620/120 A / B / C"]
    by = {r[0]: r for r in rows}
    # under FIFO team B never starts: its waits are open, marked as lower bounds
    assert by["fifo"][1].startswith("≥ ") and " / ≥ " in by["fifo"][1]
    # under sfq B's median wait is a measured wait
    assert not by["sfq"][1].startswith("≥")
    assert by["fifo"][4].startswith(str(teams.results[0]["teams"]["team-a"]["completed"]) + " / 0 / 0")


def test_censored_quantiles_match_the_waits_reported(teams):
    for r, (_, run) in zip(teams.results, teams.runs):
        for k, t in enumerate(r["teams"]):
            cells = censored_wait_quantiles(run, k)
            assert [v for v, _ in cells] == [r["teams"][t][q] for q in ("wait_p50", "wait_p95", "wait_p99")]
    fifo = dict(teams.runs)["fifo"]
    assert all(open_ for _, open_ in censored_wait_quantiles(fifo, 1))  # B never started under FIFO


def test_markdown_headers_are_one_line(ret):
    md = markdown_table(ret)
    header = md.splitlines()[2]
    assert "\n" not in header and "returning client's share of service" in header


def test_service_plot_panels_share_their_axes(teams, tmp_path, monkeypatch):
    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or path)
    plots.write_plots(teams, tmp_path)
    axes = [ax for ax in figs[0].axes if ax.get_visible()]
    assert len(axes) == 3
    assert all(axes[0].get_shared_y_axes().joined(axes[0], ax) for ax in axes[1:])
    assert len({ax.get_ylim() for ax in axes}) == 1
