"""The resolved policy as tables (``sfq check-config``): flows with their weights as shares of
the pool, and every limit. Rendered with rich when it is installed, as plain aligned text
otherwise (the base install has no rich)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .config import OrgSpec, Policy

__all__ = ["check_config", "policy_notes", "policy_tables", "render_plain", "render_rich", "startup_checks"]

Table = tuple[str, list[str], list[list[str]]]


def _n(v: float | int | None, unit: str = "") -> str:
    if v is None:
        return "-"
    s = f"{v:g}" if isinstance(v, float) else str(v)
    return s + unit


def _pct(x: float) -> str:
    """A share as a percentage, with two significant digits when it is under 0.1 %."""
    return f"{x:.1%}" if x >= 0.001 else f"{x * 100:.2g}%"


#: rows beyond which ``check-config`` prints plain text even when rich is installed
RICH_ROWS = 2_000
#: flows of a pool shown by the summary at each end (the largest shares and the smallest)
SUMMARY_FLOWS = 5


def _flow_rows(policy: Policy, pool: str) -> list[list[str]]:
    """Every flow of ``pool`` with its weight and share, in file order, in one pass (the pool's
    total weight is summed once: a 10,000-org file is not 10,000 sums of 10,000)."""
    flows = policy.flows(pool)
    weight = {(o, c): policy.flow_weight(o, c) for o, c, _ in flows}
    total = sum(w for (o, c), w in weight.items() if not policy.classes[c].strict)
    rows = []
    for org, cls, _ in flows:
        strict = policy.classes[cls].strict
        w = weight[(org, cls)]
        rows.append([pool, org, cls, "strict" if strict else _n(w),
                     "first (capped)" if strict else _pct(w / total)])
    return rows


def _ends(rows: list[list[str]], policy: Policy) -> list[list[str]]:
    """The summary of a pool's flows: all of them when few, else the ``SUMMARY_FLOWS`` largest
    and smallest shares (strict flows first) with a row saying how many were left out."""
    if len(rows) <= 2 * SUMMARY_FLOWS + 1:
        return rows
    strict = [r for r in rows if r[4] == "first (capped)"]
    weighted = sorted((r for r in rows if r[4] != "first (capped)"),
                      key=lambda r: -policy.flow_weight(r[1], r[2]))
    cut = len(weighted) - 2 * SUMMARY_FLOWS
    if cut <= 0:
        return strict + weighted
    return (strict + weighted[:SUMMARY_FLOWS]
            + [[rows[0][0], f"... {cut} more flows (--flows lists every one)", "", "", ""]]
            + weighted[-SUMMARY_FLOWS:])


def _org_summary(policy: Policy) -> list[list[str]]:
    listed = list(policy.orgs.values())
    keyed = sum(1 for o in listed if _keys(o))
    weights = [o.weight for o in listed]
    rows = [["orgs named", f"{len(listed)} ({keyed} with keys, {len(listed) - keyed} without)"]]
    if weights:
        rows.append(["weights", f"{min(weights):g} .. {max(weights):g}"])
        rows.append(["own limits", f"max_in_flight: {sum(o.max_in_flight is not None for o in listed)}, "
                                   f"requests/min: {sum(o.requests_per_minute is not None for o in listed)}"])
    t = policy.org_template
    if t is not None:
        rows.append(["org_template", f"classes {', '.join(t.classes)}, weight {t.weight:g}"])
    return rows


def _keys(o: OrgSpec) -> int:
    """An org's keys, its teams' included."""
    return len(o.key_digests) + sum(len(t.key_digests) for t in o.teams.values())


def _team_rows(policy: Policy, every_flow: bool) -> list[list[str]]:
    """Nested shares: every team (``--flows``), else one summary row per nested org."""
    rows = []
    for o in policy.orgs.values():
        if not o.nested:
            continue
        users = f"equal, max_users {o.max_users}" if o.users else "-"
        if not every_flow or not o.teams:
            n = len(o.teams)
            rows.append([o.name, f"{n} team{'s' if n != 1 else ''}" if n else "(no teams)", "", "",
                         users if not o.teams else ("equal" if o.users else "-")])
            continue
        total = sum(t.weight for t in o.teams.values())
        for t in o.teams.values():
            rows.append([o.name, t.name, _n(t.weight), _pct(t.weight / total),
                         f"equal, max_users {t.max_users}" if o.users else "-"])
    return rows


def policy_tables(policy: Policy, *, every_flow: bool = False) -> list[Table]:
    """``(title, headers, rows)`` for flows, pools, backends, classes, orgs, cost and retries:
    every flow and org with ``every_flow``; else each pool's largest and smallest shares and a
    summary of the orgs (what stays readable, and fast, with 10,000 orgs)."""
    flows: list[list[str]] = []
    for pool in policy.pools:
        rows = _flow_rows(policy, pool)
        flows.extend(rows if every_flow else _ends(rows, policy))
    pools = [[p.name, ", ".join(p.models), str(len(p.backends)), str(sum(b.max_in_flight for b in p.backends)),
              _n(p.limits.max_in_flight), _n(p.limits.requests_per_minute), _n(p.limits.tokens_per_minute)]
             for p in policy.pools.values()]
    backends = [[p.name, b.name, b.url, str(b.max_in_flight), _n(b.max_context)]
                for p in policy.pools.values() for b in p.backends]
    classes = [[c.name, "strict" if c.strict else "weighted", "-" if c.strict else _n(c.weight), _n(c.max_in_flight),
                _n(c.max_queue_length), _n(c.max_queue_age_seconds, " s"),
                "off" if c.small_cost is None or c.strict else f"<= {c.small_cost:g}, {c.small_picks} in a row"]
               for c in policy.classes.values()]
    listed = list(policy.orgs.values())
    orgs = [[o.name, str(_keys(o)), ", ".join(o.classes), o.default_class, _n(o.weight),
             _n(o.max_in_flight), _n(o.requests_per_minute)] for o in listed]
    t = policy.org_template
    if t is not None:
        orgs.append(["(org_template)", "-", ", ".join(t.classes), t.default_class, _n(t.weight),
                     _n(t.max_in_flight), _n(t.requests_per_minute)])
    few = len(listed) <= 2 * SUMMARY_FLOWS + 1
    r, cs = policy.retry, policy.cost
    other = [["cost", f"{cs.input_weight:g} x prompt + {cs.output_weight:g} x output tokens "
                      f"(default max_tokens {cs.default_max_tokens}, prior ratio {cs.prior_ratio:g})"],
             ["retry", f"max_attempts {r.max_attempts} (first try included), budget {r.budget_per_flow_percent:g}% "
                       f"of a flow's attempts per minute (one always allowed), {r.backoff} "
                       f"{r.base_seconds:g}..{r.max_seconds:g} s"]]
    if policy.state is not None and policy.state.redis is None:
        other.append(["state", f"file {policy.state.file} (this gateway's spend, kept across restarts)"])
    elif policy.state is not None:
        st = policy.state
        other.append(["state", f"redis {st.redis} prefix {st.prefix!r} lease {st.lease_seconds:g} s "
                               "(shared by every sfq serve and PolicyDispatcher started with this file); "
                               + ("Redis lost: each gateway goes on alone within its slice of every limit"
                                  if st.on_loss == "local" else "Redis lost: 503 state_unavailable")])
    return [
        ("Flows (org, class, pool): weight = org x class; share = of the pool's weighted capacity when all are busy"
         + ("" if every_flow else "; the largest and smallest shares of each pool (--flows lists every one)"),
         ["pool", "org", "class", "weight", "share"], flows),
        ("Pools", ["pool", "models", "backends", "backend slots", "max_in_flight", "requests/min", "tokens/min"], pools),
        ("Backends", ["pool", "name", "url", "max_in_flight", "max_context"], backends),
        ("Classes", ["class", "kind", "weight", "max_in_flight", "max_queue_length", "max_queue_age",
                     "small requests first"], classes),
        ("Orgs", ["org", "keys", "classes", "default", "weight", "max_in_flight", "requests/min"], orgs)
        if every_flow or few else ("Orgs (--flows lists every one)", ["orgs", "summary"], _org_summary(policy)),
        ("Cost and retries", ["section", "resolved"], other),
        *_spend_tables(policy),
        *_deadline_tables(policy),
    ] + ([("Teams and users (nested shares): a team's share is of its org's share in each class"
           + ("" if every_flow else "; --flows lists every team"),
           ["org", "team", "weight", "share of org", "users"], _team_rows(policy, every_flow))]
         if policy.nested else [])


def _deadline_tables(policy: Policy) -> list[Table]:
    """The classes' deadlines and service levels (only when the file sets any)."""
    rows = [[c.name, _n(c.deadline_seconds, " s"), _n(c.ttft_objective_seconds, " s"),
             "yes" if c.refuse_unmeetable else "no"] for c in policy.classes.values()
            if c.deadline_seconds is not None or c.ttft_objective_seconds is not None or c.refuse_unmeetable]
    if not rows:
        return []
    return [("Deadlines and service levels (a class's default deadline; requests with a deadline go first in "
             "their flow, nearest first)", ["class", "deadline_seconds", "ttft_objective", "refuse_unmeetable"], rows)]


def _spend_tables(policy: Policy) -> list[Table]:
    """Prices per pool and budgets per org and team (only when the file sets any)."""
    out: list[Table] = []
    prices = [[p.name, f"{p.prices.input:g}", f"{p.prices.input if p.prices.cached_input is None else p.prices.cached_input:g}",
               f"{p.prices.output:g}"] for p in policy.pools.values() if p.prices is not None]
    if prices:
        out.append(("Prices (currency per 1M tokens)", ["pool", "input", "cached input", "output"], prices))
    budgets = []
    for o in policy.orgs.values():  # an org's budget, then its teams' (each within the org's)
        if o.budget is not None:
            budgets.append([o.name, f"{o.budget.amount:g}", f"per UTC {o.budget.per}"])
        budgets += [[f"{o.name}.teams.{t.name}", f"{t.budget.amount:g}", f"per UTC {t.budget.per}"
                     + (f" (and org {o.name}'s)" if o.budget is not None else "")]
                    for t in o.teams.values() if t.budget is not None]
    if budgets:
        if not prices:
            budgets = [[*b[:2], b[2] + " (no pool has prices: nothing is spent)"] for b in budgets]
        out.append(("Budgets (a request the remaining budget cannot cover is refused: 429 budget_exhausted)",
                    ["org or team", "amount", "period"], budgets))
    return out


def policy_notes(policy: Policy) -> list[str]:
    """What an operator should know that the tables do not say: orgs ``sfq serve`` cannot
    authenticate, and what the template gives the orgs the file does not name."""
    notes = []
    keyless = [o.name for o in policy.orgs.values() if not _keys(o)]
    if keyless:
        many = len(keyless) > 1
        notes.append(f"org{'s' if many else ''} {', '.join(keyless)} ha{'ve' if many else 's'} no keys: sfq serve "
                     f"cannot authenticate {'their' if many else 'its'} requests (an embedder names the org itself, "
                     "sfq.Flow(org, cls, pool))")
    if policy.org_template is not None:
        notes.append("org_template: an org the file does not name gets the template's classes, weight and limits "
                     "when an embedder names it (its own flows, not counted in the shares above; sfq serve "
                     "authenticates only the orgs listed with keys)")
    return notes


def render_plain(tables: list[Table]) -> str:
    out: list[str] = []
    for title, headers, rows in tables:
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
        out.append(title)
        out.append("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
        out.append("  ".join("-" * w for w in widths))
        for r in rows:
            out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        out.append("")
    return "\n".join(out)


def render_rich(tables: list[Table], console: Any) -> None:
    from rich.table import Table as RichTable

    for title, headers, rows in tables:
        t = RichTable(title=title, title_justify="left")
        for h in headers:
            t.add_column(h)
        for r in rows:
            t.add_row(*r)
        console.print(t)


def startup_checks(policy: Policy, *, redis_timeout: float = 1.0) -> tuple[list[str], list[str]]:
    """What ``sfq serve`` would find at start-up beyond the file itself: ``(errors, warnings)``,
    each a ``field.path: problem`` line. Errors: a backend's ``api_key_env`` that is unset or
    empty here (``sfq serve`` refuses to start). Warnings: a ``state`` Redis that does not answer
    a PING within ``redis_timeout`` seconds, or the ``redis`` package missing (``sfq serve``
    starts, and answers 503 ``state_unavailable`` until Redis answers: until it has seen Redis
    once, a gateway does not know how many share the limits)."""
    errors = _unset_keys((f"pools.{pool.name}.backends[{i}].api_key_env", b.api_key_env)
                         for pool in policy.pools.values() for i, b in enumerate(pool.backends))
    warnings: list[str] = []
    if policy.state is not None and policy.state.redis is not None:
        url = policy.state.redis
        try:
            import redis  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            warnings.append("state.redis: the redis package is not installed (pip install 'sfq-scheduler[redis]'); "
                            "sfq serve needs it for a state section")
        else:
            client = redis.Redis.from_url(url, socket_timeout=redis_timeout, socket_connect_timeout=redis_timeout)
            try:
                client.ping()
            except Exception as exc:  # any failure to answer is the warning's subject
                warnings.append(f"state.redis: {url} does not answer ({type(exc).__name__}: {exc}); sfq serve "
                                "would start and answer 503 state_unavailable until it does")
            finally:
                client.close()
    return errors, warnings


def _unset_keys(envs: Iterable[tuple[str, str | None]]) -> list[str]:
    """``field.path: problem`` for each ``(field path, environment variable)`` whose variable
    is unset or empty here (``None``: the backend has no key)."""
    import os

    return [f"{where}: the environment variable {env!r} is not set (or empty); sfq serve refuses to start"
            for where, env in envs if env is not None and not os.environ.get(env)]


def _raw_key_envs(text: str) -> list[tuple[str, str | None]]:
    """The backends' ``api_key_env`` of a policy file that does not validate, read from its
    plain YAML as far as it goes (nothing when that is not YAML either), so that ``check-config``
    names an unset variable along with the file's errors."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return []
    pools = data.get("pools") if isinstance(data, dict) else None
    out: list[tuple[str, str | None]] = []
    for name, pool in (pools.items() if isinstance(pools, dict) else ()):
        backends = pool.get("backends") if isinstance(pool, dict) else None
        for i, b in enumerate(backends if isinstance(backends, list) else ()):
            env = b.get("api_key_env") if isinstance(b, dict) else None
            if isinstance(env, str) and env:
                out.append((f"pools.{name}.backends[{i}].api_key_env", env))
    return out


def check_config(path: str, *, plain: bool = False, every_flow: bool = False) -> int:
    """``sfq check-config FILE``: 0 and the tables on stdout when the file is valid; 1 and
    every error (``FILE: field.path: problem``, one per line) on stderr when it is not, or when
    ``sfq serve`` would refuse it at start-up (:func:`startup_checks`; an unset ``api_key_env``
    is named along with the file's own errors), with a last line saying how many and, when a
    check needed a bad field, that more may follow once they are fixed; 2 when it cannot be
    read. A YAML syntax error names the file's line. Warnings (an unreachable Redis) go to
    stderr and leave the status 0. ``every_flow`` (``--flows``): every flow and org, not the
    summary."""
    import sys
    from pathlib import Path

    from ..errors import PolicyError
    from .config import PolicyErrors, parse_policy

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        sys.stderr.write(f"sfq check-config: cannot read {path}: {exc}\n")
        return 2
    try:
        policy = parse_policy(text, source=path)
    except PolicyError as exc:
        if not exc.path and str(exc).startswith(f"{path}, line "):  # a YAML syntax error, naming the file itself
            sys.stderr.write(f"sfq check-config: {exc}\n")
            return 1
        errors = [str(e) for e in (exc.errors if isinstance(exc, PolicyErrors) else [exc])]
        errors += _unset_keys(_raw_key_envs(text))
        for line in errors:
            sys.stderr.write(f"sfq check-config: {path}: {line}\n")
        unchecked = exc.unchecked if isinstance(exc, PolicyErrors) else []
        sys.stderr.write(f"sfq check-config: {path}: {len(errors)} error{'s' if len(errors) != 1 else ''}"
                         + ("; more may follow once these are fixed, from what could not be checked yet: "
                            + "; ".join(unchecked) if unchecked else "") + "\n")
        return 1
    errors, warnings = startup_checks(policy)
    for w in warnings:
        sys.stderr.write(f"sfq check-config: {path}: warning: {w}\n")
    if errors:
        for line in errors:
            sys.stderr.write(f"sfq check-config: {path}: {line}\n")
        return 1
    tables = policy_tables(policy, every_flow=every_flow)
    console = None
    # rich draws about 1,000 rows a second: a table of thousands of flows goes out as plain text
    if not plain and sum(len(rows) for _, _, rows in tables) <= RICH_ROWS:
        try:
            from rich.console import Console

            console = Console(width=None if sys.stdout.isatty() else 200, highlight=False)
        except ImportError:
            console = None
    if console is None:
        sys.stdout.write(render_plain(tables))
    else:
        render_rich(tables, console)
    for note in policy_notes(policy):
        sys.stdout.write(f"note: {note}\n")
    template = ", an org template" if policy.org_template is not None else ""
    teams = sum(len(o.teams) for o in policy.orgs.values())
    nested = (f", {teams} teams, users in {sum(o.users for o in policy.orgs.values())} orgs"
              if policy.nested else "")
    sys.stdout.write(f"{path}: valid ({len(policy.pools)} pools, {len(policy.classes)} classes, "
                     f"{len(policy.orgs)} orgs{template}, {len(policy.flows())} flows{nested})"
                     f"{'; ' + str(len(warnings)) + ' warning(s) above' if warnings else ''}\n")
    return 0
