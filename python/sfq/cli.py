"""The ``sfq`` command.

``sfq simulate [SCENARIO]`` runs the fleet simulator (:mod:`sfq.sim`) and prints a table
per scenario, writes PNG plots, or with ``--json`` prints exactly one JSON document on
stdout. Without a scenario it runs the headline pair, ``teams`` and ``return``.
Same arguments, same output, byte for byte: the simulation runs on virtual time from
its seed; only the progress bar (stderr, terminals only) looks at the wall clock.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

__all__ = ["main", "build_parser"]

_SCENARIOS = ("drift", "return", "kv-sweep", "rpm-sweep", "teams", "shallow", "keep-one", "many", "trace", "nested",
              "deadlines")
_POLICIES = ("fifo", "prio", "rr", "drr", "wfq", "sfq", "sfq-seed", "lcf", "vtc", "vtc-h")
_CHARGES = ("seed", "settle", "served")


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        return v

    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v >= 0) or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    v = _nonneg_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def _weight(text: str) -> tuple[str, float]:
    name, sep, w = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected FLOW=WEIGHT, got {text!r}")
    return name, _positive_float(w)


def _headroom(text: str) -> tuple[int, ...]:
    ks = tuple(_positive_int(k.strip()) for k in text.split(",") if k.strip())
    if not ks:
        raise argparse.ArgumentTypeError(f"expected K[,K] (slots kept, ints >= 1), got {text!r}")
    return ks


def _policies(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    out: list[str] = []
    for v in values:
        for name in v.split(","):
            name = name.strip()
            if not name:
                continue
            if name not in _POLICIES:
                raise argparse.ArgumentTypeError(f"unknown policy {name!r}; choose from {', '.join(_POLICIES)}")
            out.append(name)
    return out or None


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from . import _cli_help as words

    parser = argparse.ArgumentParser(
        prog="sfq",
        description="Start-time Fair Queueing for shared LLM-serving fleets: whose request goes next.",
        epilog="Run 'sfq COMMAND --help' for a command's options. The library: import sfq (docs/API.md).",
    )
    parser.add_argument("--version", action="version", version=f"sfq {__version__} (sfq-scheduler)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sim = sub.add_parser(
        "simulate",
        help="compare scheduling policies on a simulated fleet",
        description=words.description(),
        epilog=words.epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim.add_argument("scenario", nargs="?", choices=_SCENARIOS, metavar="SCENARIO",
                     help=f"one of {', '.join(_SCENARIOS)}, described below (default: teams, then return)")
    sim.add_argument("--policy", "-p", action="append", metavar="NAME[,NAME]",
                     help="policies to run, repeatable or comma-separated (default: those that apply to the "
                          f"scenario): {', '.join(_POLICIES)}")
    sim.add_argument("--seed", type=_nonneg_int, default=0, help="workload seed (default 0)")
    sim.add_argument("--steps", type=_positive_int, help="run length in steps (return: length of the first phase)")
    sim.add_argument("--kv", type=_positive_int, dest="kv_budget", metavar="M", help="KV budget per server, tokens")
    sim.add_argument("--servers", type=_positive_int, help="servers in the fleet")
    sim.add_argument("--slots", type=_positive_int, help="max running requests per server")
    sim.add_argument("--quantum", type=_positive_float, default=1024.0, help="DRR quantum, weighted tokens (1024)")
    sim.add_argument("--beta", type=_nonneg_float, default=0.01, help="vtc-h: decode charge per context token (0.01)")
    sim.add_argument("--w-p", type=_nonneg_float, default=1.0, dest="w_p", help="service weight of a prompt token (1)")
    sim.add_argument("--w-q", type=_nonneg_float, default=2.0, dest="w_q", help="service weight of an output token (2)")
    sim.add_argument("--charge", choices=_CHARGES, default=None,
                     help="how policy sfq charges: seed (estimate at dispatch), settle (corrected to the actual "
                          "cost at completion), served (prompt at dispatch, output as generated; the default)")
    sim.add_argument("--prior", type=_positive_float, default=0.5,
                     help="estimator's output/max_tokens ratio before any completion (0.5)")
    sim.add_argument("--headroom", type=_headroom, metavar="K[,K]",
                     help="deadlines: the pool's limits.headroom of each sfq-edf-headroom-K row (default 3,5)")
    sim.add_argument("--trace", metavar="FILE", help="JSONL trace for the trace scenario")
    sim.add_argument("--weight", type=_weight, action="append", metavar="FLOW=W", help="trace: a flow's weight")
    sim.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    sim.add_argument("--markdown", action="store_true", help="print the tables as GitHub markdown")
    sim.add_argument("--out", default="out/simulate", metavar="DIR", help="where the PNG plots go (out/simulate)")
    sim.add_argument("--no-plots", action="store_true", help="do not write plots")
    sim.add_argument("--write-trace", metavar="FILE", help="write the scenario's workload as a JSONL trace and exit")
    sim.add_argument("--config", metavar="FILE",
                     help="teams: run this policy file (docs/policy.md) in the simulator, next to fifo, prio and sfq "
                          "(or the --policy list)")
    cc = sub.add_parser(
        "check-config", help="validate a policy file and print the resolved policy",
        description="Validate a policy file (YAML, docs/policy.md) and print the resolved policy: the flows "
                    "with their weights as shares of the pool, and every limit. Exit status 1 when the file "
                    "is invalid (the message names the bad field), 2 when it cannot be read.")
    cc.add_argument("file", metavar="FILE", help="the policy file")
    cc.add_argument("--plain", action="store_true", help="plain text tables (the default when rich is not installed)")
    cc.add_argument("--flows", action="store_true",
                    help="list every flow and org (default: each pool's largest and smallest shares, and a summary "
                         "of the orgs, when there are many)")
    sv = sub.add_parser(
        "serve", help="run the fair OpenAI-compatible gateway in front of the policy file's backends",
        description="Serve POST /v1/chat/completions and /v1/completions (streaming too), GET /v1/models, "
                    "/health, /metrics and /dashboard, with the policy file's fair queue between the clients and the "
                    "backends (docs/gateway.md). SIGTERM: graceful shutdown; SIGHUP: "
                    "reload the file. Access log: one JSON line per request on stdout. With --workers N, "
                    "N processes serve the port and share the policy's Redis (state.redis).")
    sv.add_argument("--config", required=True, metavar="FILE", help="the policy file (docs/policy.md)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    sv.add_argument("--port", type=_nonneg_int, default=8080, help="port to listen on (8080; 0 = any free port)")
    sv.add_argument("--grace", type=_nonneg_float, default=30.0,
                    help="seconds running requests get to finish at shutdown (30)")
    sv.add_argument("--access-log", default="-", metavar="FILE",
                    help="where the access log goes: - (stdout, the default), a file, or off")
    sv.add_argument("--no-dashboard", action="store_false", dest="dashboard",
                    help="do not serve GET /dashboard (the page that polls /stats; 404 then)")
    sv.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                    help="gateway processes serving the one port (1). N > 1 needs the policy's state.redis: the "
                         "workers share every limit, budget and the fair order there, as several gateways do; "
                         "a parent process binds the port, passes SIGTERM and SIGHUP on to every worker and "
                         "replaces one that dies")
    top = sub.add_parser(
        "top", help="watch a running gateway's fairness in the terminal (its GET /stats)",
        description="A live view of a running sfq serve, read from its GET /stats: per pool, each org's share "
                    "of the served cost against the share its weight promises, requests waiting and in flight, "
                    "the oldest and the p99 wait, and the pool's Jain index (docs/gateway.md, 'Seeing "
                    "fairness'). Keys: 1-9 or Tab pick a pool, q quits. Exit status 2 when the gateway cannot "
                    "be reached or does not answer /stats' JSON.")
    top.add_argument("--url", default="http://127.0.0.1:8080", help="the gateway (http://127.0.0.1:8080)")
    top.add_argument("--interval", type=_positive_float, default=2.0, help="seconds between polls (2)")
    top.add_argument("--pool", metavar="NAME", help="the pool shown first (default: the first by name)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    db = sub.add_parser(
        "demo-backend", help="a DEMO inference engine (not a model) to try sfq serve without a GPU",
        description="An OpenAI-compatible server that makes up text (it is not a model): one model name, "
                    "a few slots that generate at once, tokens streamed at a steady pace, usage reported. "
                    "For trying sfq serve on a laptop (docs/gateway.md). SIGTERM or Ctrl-C stops it.")
    db.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    db.add_argument("--port", type=_nonneg_int, default=8001, help="port to listen on (8001; 0 = any free port)")
    db.add_argument("--model", default="demo", help="the model name it serves (demo)")
    db.add_argument("--slots", type=_positive_int, default=4, help="requests generating at once; more wait (4)")
    db.add_argument("--tokens-per-second", type=_positive_float, default=50.0, dest="tokens_per_second",
                    help="tokens per second of each request (50)")
    db.add_argument("--max-tokens", type=_positive_int, default=128, dest="max_tokens",
                    help="tokens generated when a request sets no max_tokens (128)")
    return parser


def _simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._optional import MissingExtra, require

    if args.config is not None:  # a policy file in the teams scenario (plain tables, no rich needed)
        from .sim.teams_config import main_teams_config

        return main_teams_config(args, parser)

    try:  # checked before the run, not after it
        require("rich.console", "sim", "sfq simulate")
        if not args.no_plots and not args.write_trace:
            require("matplotlib.figure", "sim", "sfq simulate's plots (or pass --no-plots)")
    except MissingExtra as exc:
        print(f"sfq simulate: error: {exc}", file=sys.stderr)
        return 2
    from rich.console import Console

    from .sim.progress import RichProgress
    from .sim.scenarios import HEADLINE, Options, run_scenario, workload_for

    err = Console(stderr=True)
    out = Console(width=None if sys.stdout.isatty() else 100, highlight=False)
    try:
        policies = _policies(args.policy)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.prior > 1:
        parser.error(f"--prior must be in (0, 1], got {args.prior!r}")
    if args.scenario == "trace" and not args.trace:
        parser.error("the trace scenario needs --trace FILE.jsonl")
    if args.trace and args.scenario != "trace":
        parser.error("--trace goes with the trace scenario: sfq simulate trace --trace FILE.jsonl")
    if args.headroom and args.scenario != "deadlines":
        parser.error("--headroom applies to the deadlines scenario (sfq simulate deadlines --headroom K[,K])")
    if args.weight and not args.trace:
        parser.error("--weight applies to trace replay (sfq simulate trace --trace FILE --weight FLOW=W)")
    opts = Options(
        seed=args.seed,
        steps=args.steps,
        kv_budget=args.kv_budget,
        servers=args.servers,
        slots=args.slots,
        quantum=args.quantum,
        beta=args.beta,
        w_p=args.w_p,
        w_q=args.w_q,
        prior=args.prior,
        trace=args.trace,
        weights=dict(args.weight or []),
        charge=args.charge,
        headroom=args.headroom,
    )
    names = [args.scenario] if args.scenario else list(HEADLINE)

    if args.write_trace:
        from .sim.model import save_trace

        if len(names) != 1:
            parser.error("--write-trace needs a scenario")
        try:
            save_trace(workload_for(names[0], opts), args.write_trace)
        except (OSError, ValueError) as exc:
            err.print(f"sfq simulate: error: {exc}", markup=False, highlight=False, soft_wrap=True)
            return 2
        return 0

    results = []
    try:
        with RichProgress(err) as progress:
            for n in names:
                results.append(run_scenario(n, opts, policies, progress))
    except (OSError, ValueError) as exc:
        err.print(f"sfq simulate: error: {exc}", markup=False, highlight=False, soft_wrap=True)  # (a path unbroken)
        return 2

    plots: list[str] = []
    if not args.no_plots:
        from .sim.plots import write_plots

        try:
            for r in results:
                plots += [str(p) for p in write_plots(r, args.out)]
        except OSError as exc:
            err.print(f"sfq simulate: error: cannot write plots to {args.out!r}: {exc}", markup=False, soft_wrap=True)
            return 2

    if args.json:
        if len(results) == 1:
            doc = results[0].document()
        else:
            docs = [r.document() for r in results]
            doc = {
                "scenario": "headline",
                "params": {d["scenario"]: d["params"] for d in docs},
                "results": [row for d in docs for row in d["results"]],
            }
        sys.stdout.write(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        return 0

    from .sim.report import markdown_table, rich_table

    for r in results:
        if args.markdown:
            out.print(markdown_table(r), markup=False, highlight=False, soft_wrap=True)
            out.print()
        else:
            out.print(rich_table(r))
    if plots:
        out.print("plots: " + "  ".join(plots), markup=False, highlight=False, soft_wrap=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sfq`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.command is None:  # plain `sfq`: say what there is, successfully
        parser.print_help()
        return 0
    if args.command == "simulate":
        return _simulate(args, parser)
    if args.command == "check-config":
        from .policy.report import check_config

        return check_config(args.file, plain=args.plain, every_flow=args.flows)
    if args.command == "demo-backend":
        from .demo import DemoConfig, run as run_demo

        return run_demo(DemoConfig(model=args.model, slots=args.slots, tokens_per_second=args.tokens_per_second,
                                   default_max_tokens=args.max_tokens), host=args.host, port=args.port)
    if args.command == "top":
        from ._optional import MissingExtra, require

        try:
            require("rich.live", "top", "sfq top")
        except MissingExtra as exc:
            print(f"sfq top: error: {exc}", file=sys.stderr)
            return 2
        from .serve.top import run as run_top

        return run_top(args.url, interval=args.interval, once=args.once, pool=args.pool)
    if args.command == "serve":
        from .serve import run

        return run(args.config, host=args.host, port=args.port, grace=args.grace, access_log=args.access_log,
                   dashboard=args.dashboard, workers=args.workers)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse rejects it first
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
