"""``sfq top``: a running gateway's fairness in a terminal, read from its ``GET /stats``.

One pool at a time: its orgs (largest share first) with their weight, share of the pool's
served cost against the share their weights promise, requests waiting and in flight, the
oldest wait and the p99 wait, over the gateway's window (``metrics.window_seconds``); above
them the pool's Jain index and queue; below them its classes, with their weight (a flow's
weight is its org's times its class's), requests waiting and in flight, deadline misses
(``sfq_deadline_missed_total``), its time-to-first-token objective (``ttft_objective_seconds``)
with its attainment over the window (``-`` for a class without one), the p99 time to first
token over the window, and requests by outcome. Keys: ``1``-``9`` pick a pool, Tab (or ``n``) the next
one, ``q`` quits. ``--once`` prints one frame and exits (scripts, tests).

A gateway that cannot be reached, or answers anything but ``/stats``' JSON, is an error
naming the URL (exit status 2) when it happens at start; later, while the view runs, the
frame says so and the view keeps polling (a gateway restarting comes back).
"""

from __future__ import annotations

import json
import math
import os
import select
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = ["StatsError", "fetch_stats", "render", "run"]

#: seconds a /stats request may take before the gateway counts as unreachable
TIMEOUT = 5.0


class StatsError(Exception):
    """``/stats`` could not be read; the message names the URL and why."""


def stats_url(url: str) -> str:
    """The ``/stats`` URL of a gateway given by its base URL (or by its ``/stats`` URL itself)."""
    url = url.rstrip("/")
    return url if url.endswith("/stats") else url + "/stats"


def fetch_stats(url: str, timeout: float = TIMEOUT) -> dict[str, Any]:
    """``GET /stats`` of the gateway at ``url``, parsed; :class:`StatsError` otherwise."""
    target = stats_url(url)
    try:
        with urllib.request.urlopen(urllib.request.Request(target, headers={"Accept": "application/json"}),
                                    timeout=timeout) as r:
            body = r.read(16 << 20)
    except urllib.error.HTTPError as exc:
        raise StatsError(f"{target} answered HTTP {exc.code} (is it sfq serve, with /stats?)") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        why = getattr(exc, "reason", None) or exc
        raise StatsError(f"cannot reach {target}: {why}") from None
    try:
        doc = json.loads(body)
    except ValueError:
        raise StatsError(f"{target} did not answer JSON (is it sfq serve?): {body[:60]!r}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("pools"), dict):
        raise StatsError(f"{target} answered JSON without a 'pools' object (is it sfq serve's /stats?)")
    return doc


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _pct(v: Any) -> str:
    x = _num(v)
    return "-" if x is None else f"{100 * x:.1f}%"


def _int(v: Any) -> str:
    x = _num(v)
    return "-" if x is None else f"{x:.0f}"


def _secs(v: Any) -> str:
    x = _num(v)
    if x is None:
        return "-"
    return f"{1000 * x:.0f} ms" if x < 1 else f"{x:.2f} s" if x < 10 else f"{x:.1f} s"


def pool_names(stats: Mapping[str, Any]) -> list[str]:
    return sorted(stats.get("pools") or {})


def render(stats: Mapping[str, Any], pool: str | None = None, *, url: str = "", error: str | None = None
           ) -> RenderableType:
    """One frame: ``pool`` (default: the first by name) of a ``/stats`` document."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    names = pool_names(stats)
    if pool not in names:
        pool = names[0] if names else None
    window = _num(stats.get("window_seconds"))
    when = _num(stats.get("time"))
    head = Text()
    head.append("sfq top", style="bold")
    if url:
        head.append(f"  {url}")
    if when is not None:
        head.append("  " + time.strftime("%H:%M:%S", time.localtime(when)))
    if window is not None:
        head.append(f"  window {window:g} s")
    parts: list[RenderableType] = [head]
    if error:
        parts.append(Text(error, style="bold red"))
    if pool is None:
        parts.append(Text("the gateway has no pools"))
        return Group(*parts)
    p = stats["pools"][pool] or {}
    jain = _num(p.get("jain"))
    line = Text()
    line.append(f"pool {pool}", style="bold")
    line.append("  Jain ")
    line.append("-" if jain is None else f"{jain:.3f}", style="bold red" if jain is not None and jain < 0.8 else "bold")
    line.append(f"  waiting {_int(p.get('waiting'))}  in flight {_int(p.get('in_flight'))}"
                f"  served {_int(p.get('served_cost'))} cost units in the window")
    parts.append(line)
    table = Table(expand=False, pad_edge=False, box=None, header_style="bold")
    for col in ("org", "weight", "share", "expected", "waiting", "in flight", "oldest wait", "p99 wait"):
        table.add_column(col, justify="left" if col == "org" else "right", no_wrap=True,
                         overflow="ellipsis", max_width=32 if col == "org" else None)
    orgs: Mapping[str, Any] = p.get("orgs") or {}
    for name in sorted(orgs, key=lambda n: (-(_num((orgs[n] or {}).get("share")) or 0.0), n)):
        o = orgs[name] or {}
        share, expected = _num(o.get("share")), _num(o.get("expected_share"))
        behind = share is not None and expected is not None and expected > 0 and share < 0.8 * expected
        weight = _num(o.get("weight"))  # (None for _other, the orgs summed beyond max_org_series)
        table.add_row(Text(name), "-" if weight is None else f"{weight:g}", Text(_pct(share), style="red" if behind else ""),
                      _pct(expected), _int(o.get("waiting")), _int(o.get("in_flight")),
                      _secs(o.get("oldest_wait_seconds")), _secs(o.get("wait_p99")))
    parts.append(table)
    classes: Mapping[str, Any] = p.get("classes") or {}
    if classes:
        ct = Table(expand=False, pad_edge=False, box=None, header_style="bold")
        for col in ("class", "weight", "waiting", "in flight", "deadline missed", "objective", "attainment",
                    "p99 TTFT", "completed", "failed", "refused"):
            ct.add_column(col, justify="left" if col == "class" else "right", no_wrap=True, overflow="ellipsis",
                          max_width=32 if col == "class" else None)
        for name in sorted(classes):
            c = classes[name] or {}
            r = c.get("requests") or {}
            w = _num(c.get("weight"))
            missed = _num(c.get("deadline_missed"))
            objective = _num(c.get("ttft_objective_seconds"))
            attained = _pct(c.get("attainment")) if objective is not None else "-"
            ct.add_row(Text(name), "strict" if c.get("strict") else "-" if w is None else f"{w:g}",
                       _int(c.get("waiting")), _int(c.get("in_flight")),
                       Text(_int(missed), style="red" if missed else ""), _secs(objective), attained,
                       _secs(c.get("ttft_p99")), _int(r.get("completed")), _int(r.get("failed")),
                       _int(r.get("refused")))
        parts.append(Text(""))
        parts.append(ct)
    keys = Text("pools: ", style="dim")
    for i, n in enumerate(names):
        keys.append(f"[{i + 1}] " if i < 9 else "", style="dim")
        keys.append(n + "  ", style="bold" if n == pool else "dim")
    keys.append("   1-9 or Tab: pool   q: quit", style="dim")
    parts.append(keys)
    return Group(*parts)


@contextmanager
def _keys() -> Iterator[bool]:
    """The terminal in cbreak mode while the view runs (single keypresses, no echo); yields
    whether keys can be read at all (stdin is a terminal)."""
    if not sys.stdin.isatty():
        yield False
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _read_key(timeout: float) -> str | None:
    ready, _, _ = select.select([sys.stdin], [], [], max(0.0, timeout))
    return os.read(sys.stdin.fileno(), 8).decode("utf-8", "replace") if ready else None


def run(url: str, *, interval: float = 2.0, once: bool = False, pool: str | None = None) -> int:
    """``sfq top``'s entry point: the exit status (0; 2 when ``/stats`` cannot be read at start,
    or ``--pool`` names no pool)."""
    from rich.console import Console

    try:
        stats = fetch_stats(url)
    except StatsError as exc:
        print(f"sfq top: error: {exc}", file=sys.stderr)
        return 2
    names = pool_names(stats)
    if pool is not None and pool not in names:
        print(f"sfq top: error: {stats_url(url)} has no pool {pool!r} (pools: {', '.join(names) or 'none'})",
              file=sys.stderr)
        return 2
    if once:
        Console(width=None if sys.stdout.isatty() else 120, highlight=False).print(render(stats, pool, url=url))
        return 0
    try:
        return _live(url, stats, pool, interval)
    except KeyboardInterrupt:
        return 0


def _live(url: str, stats: dict[str, Any], pool: str | None, interval: float) -> int:
    from rich.live import Live

    error: str | None = None
    with _keys() as interactive, Live(render(stats, pool, url=url), auto_refresh=False, screen=False) as live:
        next_poll = time.monotonic() + interval
        while True:
            left = next_poll - time.monotonic()
            key = None
            if interactive:
                key = _read_key(left)
            else:
                time.sleep(max(0.0, left))
            names = pool_names(stats)
            if key:
                if key[0] in "qQ":
                    return 0
                if key[0] in "\tn" and names:
                    shown = names.index(pool) if pool in names else 0  # (render shows the first for none)
                    pool = names[(shown + 1) % len(names)]
                elif key[0].isdigit() and 0 < int(key[0]) <= len(names):
                    pool = names[int(key[0]) - 1]
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + interval
                try:
                    stats, error = fetch_stats(url), None
                except StatsError as exc:
                    error = f"{exc} (showing the last figures; retrying every {interval:g} s)"
            live.update(render(stats, pool, url=url, error=error), refresh=True)
