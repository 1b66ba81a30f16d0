"""The resolved policy as tables (``sfq check-config``): flows with their weights as shares of
the pool, and every limit. Rendered with rich when it is installed, as plain aligned text
otherwise (the base install has no rich)."""

from __future__ import annotations

from typing import Any

from .config import Policy

__all__ = ["check_config", "policy_notes", "policy_tables", "render_plain", "render_rich", "startup_checks"]

Table = tuple[str, list[str], list[list[str]]]


def _n(v: float | int | None, unit: str = "") -> str:
    if v is None:
        return "-"
    s = f"{v:g}" if isinstance(v, float) else str(v)
    return s + unit


def policy_tables(policy: Policy) -> list[Table]:
    """``(title, headers, rows)`` for flows, pools, backends, classes, orgs, cost and retries."""
    flows: list[list[str]] = []
    for pool in policy.pools:
        for org, cls, _ in policy.flows(pool):
            c = policy.classes[cls]
            share = policy.share((org, cls, pool))
            flows.append([pool, org, cls, "strict" if c.strict else _n(policy.flow_weight(org, cls)),
                          "first (capped)" if share is None else f"{share:.1%}"])
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
    orgs = [[o.name, str(len(o.key_digests)), ", ".join(o.classes), o.default_class, _n(o.weight),
             _n(o.max_in_flight), _n(o.requests_per_minute)] for o in listed]
    t = policy.org_template
    if t is not None:
        orgs.append(["(org_template)", "-", ", ".join(t.classes), t.default_class, _n(t.weight),
                     _n(t.max_in_flight), _n(t.requests_per_minute)])
    r, cs = policy.retry, policy.cost
    other = [["cost", f"{cs.input_weight:g} x prompt + {cs.output_weight:g} x output tokens "
                      f"(default max_tokens {cs.default_max_tokens}, prior ratio {cs.prior_ratio:g})"],
             ["retry", f"max_attempts {r.max_attempts} (first try included), budget {r.budget_per_flow_percent:g}% "
                       f"of a flow's attempts per minute (one always allowed), {r.backoff} "
                       f"{r.base_seconds:g}..{r.max_seconds:g} s"]]
    if policy.state is not None:
        st = policy.state
        other.append(["state", f"redis {st.redis} prefix {st.prefix!r} lease {st.lease_seconds:g} s "
                               "(shared by sfq serve replicas; the in-process library keeps its state in memory)"])
    return [
        ("Flows (org, class, pool): weight = org x class; share = of the pool's weighted capacity when all are busy",
         ["pool", "org", "class", "weight", "share"], flows),
        ("Pools", ["pool", "models", "backends", "backend slots", "max_in_flight", "requests/min", "tokens/min"], pools),
        ("Backends", ["pool", "name", "url", "max_in_flight", "max_context"], backends),
        ("Classes", ["class", "kind", "weight", "max_in_flight", "max_queue_length", "max_queue_age",
                     "small requests first"], classes),
        ("Orgs", ["org", "keys", "classes", "default", "weight", "max_in_flight", "requests/min"], orgs),
        ("Cost and retries", ["section", "resolved"], other),
    ]


def policy_notes(policy: Policy) -> list[str]:
    """What an operator should know that the tables do not say: orgs ``sfq serve`` cannot
    authenticate, and what the template gives the orgs the file does not name."""
    notes = []
    keyless = [o.name for o in policy.orgs.values() if not o.key_digests]
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
    starts, and answers 503 ``state_unavailable`` until Redis answers)."""
    import os

    errors: list[str] = []
    for pool in policy.pools.values():
        for i, b in enumerate(pool.backends):
            if b.api_key_env is not None and not os.environ.get(b.api_key_env):
                errors.append(f"pools.{pool.name}.backends[{i}].api_key_env: the environment variable "
                              f"{b.api_key_env!r} is not set (or empty); sfq serve refuses to start")
    warnings: list[str] = []
    if policy.state is not None:
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


def check_config(path: str, *, plain: bool = False) -> int:
    """``sfq check-config FILE``: 0 and the tables on stdout when the file is valid; 1 and
    every error (``FILE: field.path: problem``, one per line) on stderr when it is not, or when
    ``sfq serve`` would refuse it at start-up (:func:`startup_checks`); 2 when it cannot be
    read. Warnings (an unreachable Redis) go to stderr and leave the status 0."""
    import sys

    from ..errors import PolicyError
    from .config import PolicyErrors, load_policy

    try:
        policy = load_policy(path)
    except PolicyErrors as exc:
        for e in exc.errors:
            sys.stderr.write(f"sfq check-config: {path}: {e}\n")
        sys.stderr.write(f"sfq check-config: {path}: {len(exc.errors)} errors\n")
        return 1
    except PolicyError as exc:
        sys.stderr.write(f"sfq check-config: {path}: {exc}\n")
        return 1
    except (OSError, UnicodeDecodeError) as exc:
        sys.stderr.write(f"sfq check-config: cannot read {path}: {exc}\n")
        return 2
    errors, warnings = startup_checks(policy)
    for w in warnings:
        sys.stderr.write(f"sfq check-config: {path}: warning: {w}\n")
    if errors:
        for line in errors:
            sys.stderr.write(f"sfq check-config: {path}: {line}\n")
        return 1
    tables = policy_tables(policy)
    console = None
    if not plain:
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
    sys.stdout.write(f"{path}: valid ({len(policy.pools)} pools, {len(policy.classes)} classes, "
                     f"{len(policy.orgs)} orgs{template}, {len(policy.flows())} flows)"
                     f"{'; ' + str(len(warnings)) + ' warning(s) above' if warnings else ''}\n")
    return 0
