"""Spend: what requests cost in currency, against the orgs' and teams' budgets.

A pool's ``prices`` (currency per 1M tokens: ``input``, ``cached_input``, ``output``) turn a
request's usage into spend; an org's ``budget`` (``{amount, per: day | month}``, UTC periods)
caps what it may spend per period, and so does a team's (``orgs.NAME.teams.TEAM.budget``),
within its org's: a team's spend counts toward both. The engine
(:class:`sfq.engine.PolicyEngine`) applies the rule, this module holds its pieces:

* :class:`SpendBook`: the rule. At admission a request of an org with a budget, for a pool
  with prices, *reserves* its largest likely spend: its prompt at the input price plus its
  output cap (``max_tokens``, declared or the policy's default) at the output price. A
  reservation the remaining budget (amount - spent - reserved) cannot cover is refused:
  ``Refused("budget_exhausted")``, 429, ``Retry-After`` to the end of the period. A request
  of a team with a budget reserves in both its team's budget and its org's (when the org has
  one), or in neither: the refusal names the budget (or both) that cannot cover it, and its
  ``Retry-After`` is the end of that budget's period (the later end when both refuse: the
  request fits only when both have room). When the request ends, the reservation is replaced
  by what it really cost (its usage, at the prices; cached prompt tokens at
  ``cached_input``), in the period it was reserved in, in each budget it was reserved in.
* :class:`MemoryLedger`: one gateway's spend per org and period, optionally kept in a file
  (``state: {file: PATH}``): written atomically (a temporary file, then a rename) at most
  once a second and on close, loaded at start; it holds the current period of orgs with a
  budget only, so its size is bounded by the policy file. Gateways sharing Redis keep the
  ledger there instead (``sfq.state.RedisState``: one Lua script reserves in the org's budget
  and its team's, both or neither, atomically over every gateway).
* :class:`SpendCollector`: ``sfq_spend_total{org,pool}``, currency settled by this gateway
  since it started (a counter). Series exist only for pools with prices and for the orgs
  the file names (any other org, made from ``org_template``, is summed under ``_other``), and
  only once something was spent: bounded by the policy file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ..errors import Refused
from .config import BudgetSpec, Policy, PriceSpec

if TYPE_CHECKING:
    from .classify import Flow


class Estimate(Protocol):
    """What a reservation reads of a request's estimate (``sfq.cost.Estimate``)."""

    prompt_tokens: float
    max_tokens: int

__all__ = ["Hold", "MemoryLedger", "SpendBook", "SpendCollector", "period_of"]

log = logging.getLogger("sfq.spend")
#: the org label of spend by orgs the policy file does not name
OTHER = "_other"
#: seconds between two writes of a ledger's file (and a write on close)
SAVE_EVERY = 1.0
_STATE_VERSION = 1
#: the ledger's account of an org's own budget, ``(org, "")``, or of one of its teams',
#: ``(org, team)`` (team names are never empty)
Account = tuple[str, str]


def period_of(per: str, wall: float) -> tuple[str, float]:
    """``(key, end)`` of the UTC period (``day`` or ``month``) holding the wall-clock time
    ``wall`` (seconds since the epoch): ``("2026-12-03", end)`` or ``("2026-12", end)``, ``end``
    the epoch seconds of the next period's start."""
    dt = datetime.fromtimestamp(wall, timezone.utc)
    if per == "day":
        start = dt.replace(hour=0, minute=0, second=0, microsecond=0)
        return start.strftime("%Y-%m-%d"), (start + timedelta(days=1)).timestamp()
    if per == "month":
        start = dt.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        nxt = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
        return start.strftime("%Y-%m"), nxt.timestamp()
    raise ValueError(f"unknown budget period {per!r} (day, month)")


class Hold:
    """A request's reservation: ``key`` (the org budget's period), ``amount`` (currency),
    ``member`` (its name in a shared ledger), ``spent`` (currency its attempts used so far);
    ``team`` and ``team_key``: the team whose budget holds it too, and that budget's period
    (``None`` and ``""``: no team budget)."""

    __slots__ = ("org", "pool", "key", "amount", "member", "spent", "budgeted", "settled", "team", "team_key")

    def __init__(self, org: str, pool: str, key: str, amount: float, member: str = "", budgeted: bool = True) -> None:
        self.org = org
        self.pool = pool
        self.key = key
        self.amount = amount
        self.member = member
        self.spent = 0.0
        self.budgeted = budgeted  # False: the org's budget does not hold it (the org has none)
        self.settled = False
        self.team: str | None = None
        self.team_key = ""

    def __repr__(self) -> str:
        team = "" if self.team is None else f" team {self.team} {self.team_key}"
        return f"Hold({self.org}/{self.pool} {self.key}{team} reserved={self.amount:g} spent={self.spent:g})"


class MemoryLedger:
    """Spend and reservations per (org, period) and per (org, team, period) in this process;
    with ``path``, the spend is loaded from that file at start and written to it (see the
    module's docstring). ``team``: a team's budget (``None``: the org's own)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = None if path is None else Path(path)
        self.clock = clock
        self._spent: dict[tuple[str, str, str], float] = {}  # (org, team or "", period) -> spent
        self._held: dict[tuple[str, str, str], float] = {}
        self._dirty = False
        self._saved_at = -math.inf
        if self.path is not None and self.path.exists():
            self._load(self.path)

    def spent(self, org: str, key: str, team: str | None = None) -> float:
        """What ``org`` (or its ``team``) spent in period ``key`` (settled requests)."""
        return self._spent.get((org, team or "", key), 0.0)

    def held(self, org: str, key: str, team: str | None = None) -> float:
        """What ``org``'s (or its ``team``'s) running requests have reserved in period ``key``."""
        return self._held.get((org, team or "", key), 0.0)

    def reserve(self, org: str, key: str, amount: float, limit: float) -> bool:
        """Reserve ``amount`` in ``org``'s budget if spent + reserved + amount stays within
        ``limit`` (a reservation of 0, a permit without a body, needs some budget left)."""
        return not self.reserve_all([((org, ""), key, limit)], amount)

    def reserve_all(self, budgets: Sequence[tuple[Account, str, float]], amount: float) -> list[int]:
        """Reserve ``amount`` in every budget ``(account, period key, limit)`` or in none: the
        indices of those that cannot cover it (empty: reserved in all)."""
        keys = [(acct[0], acct[1], key) for acct, key, _ in budgets]
        refused = []
        for i, (k, (_, _, limit)) in enumerate(zip(keys, budgets)):
            used = self._spent.get(k, 0.0) + self._held.get(k, 0.0)
            if used + amount > limit or (amount <= 0 and used >= limit):
                refused.append(i)
        if not refused:
            for k in keys:
                self._held[k] = self._held.get(k, 0.0) + amount
        return refused

    def settle(self, org: str, key: str, amount: float, actual: float, team: str | None = None) -> None:
        """Replace a reservation of ``amount`` in ``org``'s (or its ``team``'s) budget by the
        ``actual`` spend."""
        k = (org, team or "", key)
        left = self._held.get(k, 0.0) - amount
        if left > 1e-9:
            self._held[k] = left
        else:
            self._held.pop(k, None)
        if actual > 0:
            self._spent[k] = self._spent.get(k, 0.0) + actual
            self._dirty = True
            if self.path is not None and self.clock() - self._saved_at >= SAVE_EVERY:
                self.flush()

    def keep_only(self, keys: Mapping[str, str] | Mapping[Account, str]) -> None:
        """Forget every period but ``keys[account]`` (the current one) of the accounts in
        ``keys``: an org's name (its own budget) or ``(org, team)``; an account not in ``keys``
        keeps what it has until its own period is read."""
        cur = {(a, "") if isinstance(a, str) else a: key for a, key in keys.items()}
        for k in [k for k in self._spent if cur.get((k[0], k[1]), k[2]) != k[2]]:
            del self._spent[k]
            self._dirty = True

    def flush(self) -> None:
        """Write the file now when something changed (atomically; an error is logged)."""
        if self.path is None or not self._dirty:
            return
        self._saved_at = self.clock()
        rows = sorted(self._spent.items())
        data = json.dumps({"version": _STATE_VERSION,
                           "spent": [[o, k, v] for (o, t, k), v in rows if not t],
                           "teams": [[o, t, k, v] for (o, t, k), v in rows if t]})
        try:
            fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    fh.write(data)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError:
            log.exception("sfq: writing the spend file %s failed; the spend stays in memory", self.path)
            return
        self._dirty = False

    def _load(self, path: Path) -> None:
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"state.file: cannot read the spend file {str(path)!r}: {exc}") from None
        ok = isinstance(state, dict) and state.get("version") == _STATE_VERSION
        rows = state.get("spent") if ok else None
        teams = state.get("teams", []) if ok else None  # (absent from files written before team budgets)
        if not isinstance(rows, list) or not isinstance(teams, list):
            raise ValueError(f"state.file: {str(path)!r} is not an sfq spend file of version {_STATE_VERSION}")
        for row, names in [(r, 2) for r in rows] + [(r, 3) for r in teams]:
            ok = (isinstance(row, list) and len(row) == names + 1 and all(isinstance(x, str) for x in row[:names])
                  and isinstance(row[-1], (int, float)) and not isinstance(row[-1], bool)
                  and math.isfinite(row[-1]) and row[-1] >= 0 and (names == 2 or bool(row[1])))
            if not ok:
                raise ValueError(f"state.file: bad entry in the spend file {str(path)!r}: {row!r}")
            o, t, k = (row[0], "", row[1]) if names == 2 else (row[0], row[1], row[2])
            self._spent[(o, t, k)] = float(row[-1])


class SpendBook:
    """The spend rule of one policy (see the module's docstring). ``wall_clock``: epoch
    seconds (the periods are UTC days and months); ``ledger``: where budgets' spend is kept
    (default: in memory, or the policy's ``state.file``)."""

    def __init__(self, policy: Policy, *, wall_clock: Callable[[], float] = time.time,
                 ledger: MemoryLedger | None = None) -> None:
        self.policy = policy
        self.wall_clock = wall_clock
        if ledger is None:
            st = policy.state
            ledger = MemoryLedger(st.file if st is not None and st.redis is None else None)
        self.ledger = ledger
        #: settlements go here instead of the memory ledger (a shared ledger: ``sfq.state``)
        self.on_settle: Callable[[Hold, float], None] | None = None
        #: (org label, pool) -> currency settled by this process
        self.totals: dict[tuple[str, str], float] = {}
        #: per account (an org's budget, a team's): the period key seen last (a new period drops
        #: the old one from the ledger)
        self._period: dict[Account, str] = {}
        self._labels: frozenset[str] = frozenset()  # the orgs with their own spend series
        self._labels_of: Policy | None = None  # the policy they were chosen from

    # ------------------------------------------------------------ the rule
    def prices(self, pool: str) -> PriceSpec | None:
        p = self.policy.pools.get(pool)
        return None if p is None else p.prices

    def budget(self, org: str) -> BudgetSpec | None:
        o = self.policy.orgs.get(org)  # (template orgs have no budget)
        return None if o is None else o.budget

    def team_budget(self, org: str, team: str | None) -> BudgetSpec | None:
        """The budget of ``org``'s ``team`` (``None``: no team, or a team without one)."""
        o = self.policy.orgs.get(org)
        t = None if o is None or team is None else o.teams.get(team)
        return None if t is None else t.budget

    def _period_of(self, account: Account, per: str, now: float) -> tuple[str, float]:
        """The period of ``account``'s budget at ``now``; a new one forgets the last."""
        key, end = period_of(per, now)
        if self._period.get(account) != key:
            self._period[account] = key
            if isinstance(self.ledger, MemoryLedger):
                self.ledger.keep_only(self._period)
        return key, end

    def reservation(self, estimate: Estimate | None, prices: PriceSpec) -> float:
        """Currency a request reserves: its prompt at the input price, its output cap at the
        output price (0 for a permit without a body: it is settled from its usage)."""
        if estimate is None:
            return 0.0
        return prices.cost(estimate.prompt_tokens, 0.0, float(estimate.max_tokens))

    def quote(self, flow: Flow, estimate: Estimate | None,
              now: float | None = None) -> tuple[Hold, float, float] | None:
        """``(hold, limit, period end)`` of the org's budget for a request of ``flow`` at the
        wall-clock time ``now`` (default: the book's clock), or ``None`` when its pool has no
        prices. ``hold.budgeted`` is false (and ``limit`` infinite) when its org has no budget:
        the spend is only counted. (Its team's budget is :meth:`admit`'s.)"""
        prices = self.prices(flow.pool)
        if prices is None:
            return None
        b = self.budget(flow.org)
        if b is None:  # (its amount is what a team's budget would reserve)
            return Hold(flow.org, flow.pool, "", self.reservation(estimate, prices), budgeted=False), math.inf, math.inf
        key, end = self._period_of((flow.org, ""), b.per, self.wall_clock() if now is None else now)
        return Hold(flow.org, flow.pool, key, self.reservation(estimate, prices)), b.amount, end

    def said_org(self, hold: Hold, limit: float, end: float) -> tuple[str, float, str, str, float]:
        """How a refusal names the org's budget of ``hold`` (:meth:`refused`)."""
        b = self.budget(hold.org)
        return (f"org {hold.org!r}", limit, b.per if b is not None else "period", hold.key, end)

    def team_quote(self, flow: Flow, hold: Hold,
                   now: float) -> tuple[float, tuple[str, float, str, str, float]] | None:
        """The budget of ``flow``'s team, when it has one: its amount and how a refusal names it;
        ``hold`` is marked as held in it too (``team``, ``team_key``: the period at ``now``)."""
        tb = self.team_budget(flow.org, flow.team)
        if tb is None or flow.team is None:
            return None
        tkey, tend = self._period_of((flow.org, flow.team), tb.per, now)
        hold.team, hold.team_key = flow.team, tkey
        return tb.amount, (f"team {flow.team!r} of org {flow.org!r}", tb.amount, tb.per, tkey, tend)

    def refused(self, hold: Hold, spent: Sequence[tuple[str, float, str, str, float]]) -> Refused:
        """The refusal of ``hold`` by the budgets named in ``spent`` (:meth:`said_org`,
        :meth:`team_quote`)."""
        return self._refused(hold, spent)

    def refusal(self, hold: Hold, limit: float, end: float) -> Refused:
        """The refusal of a request whose reservation the org's budget cannot cover."""
        b = self.budget(hold.org)
        return self._refused(hold, [(f"org {hold.org!r}", limit, b.per if b is not None else "period", hold.key, end)])

    def _refused(self, hold: Hold, spent: Sequence[tuple[str, float, str, str, float]]) -> Refused:
        """``budget_exhausted`` naming each budget ``(whose, amount, per, period key, period
        end)`` that cannot cover ``hold``; ``Retry-After``: the latest of their period ends (the
        request fits only once every one of them has room)."""
        said = "; ".join(f"{who} has spent its budget of {amount:g} for this UTC {per} ({key})"
                         for who, amount, per, key, _ in spent)
        end = max(e for *_, e in spent)
        return Refused("budget_exhausted", f"{said}; this request may cost up to {hold.amount:.6g}",
                       retry_after=max(1.0, end - self.wall_clock()))

    def admit(self, flow: Flow, estimate: Estimate | None) -> Hold | None:
        """Reserve the request's spend in the memory ledger, in its org's budget and its
        team's (both or neither): its hold (``None``: no prices), or
        ``Refused("budget_exhausted")`` naming the budget that cannot cover it."""
        if self.prices(flow.pool) is None:  # (no clock read: a pool without prices spends nothing)
            return None
        now = self.wall_clock()
        q = self.quote(flow, estimate, now)
        if q is None:
            return None
        hold, limit, end = q
        tb = self.team_budget(flow.org, flow.team)
        budgets: list[tuple[Account, str, float]] = []
        said: list[tuple[str, float, str, str, float]] = []
        if hold.budgeted:
            budgets.append(((flow.org, ""), hold.key, limit))
            ob = self.budget(flow.org)
            said.append((f"org {flow.org!r}", limit, ob.per if ob is not None else "period", hold.key, end))
        if tb is not None and flow.team is not None:
            tkey, tend = self._period_of((flow.org, flow.team), tb.per, now)
            hold.team, hold.team_key = flow.team, tkey
            budgets.append(((flow.org, flow.team), tkey, tb.amount))
            said.append((f"team {flow.team!r} of org {flow.org!r}", tb.amount, tb.per, tkey, tend))
        if budgets:
            refused = self.ledger.reserve_all(budgets, hold.amount)
            if refused:
                raise self._refused(hold, [said[i] for i in refused])
        return hold

    def used(self, hold: Hold, prompt: float, cached: float, completion: float) -> None:
        """One attempt used these tokens (its usage report, or what it delivered)."""
        prices = self.prices(hold.pool)
        if prices is not None:
            hold.spent += prices.cost(prompt, cached, completion)

    def settle(self, hold: Hold) -> None:
        """The request ended: its reservation becomes what it spent (once: a second call is a no-op)."""
        if hold.settled:
            return
        hold.settled = True
        if hold.spent > 0:
            k = (self._label(hold.org), hold.pool)
            self.totals[k] = self.totals.get(k, 0.0) + hold.spent
        if self.on_settle is not None:  # a shared ledger: the org's budget and its team's, there
            if hold.budgeted or hold.team is not None:
                self.on_settle(hold, hold.spent)
            return
        if hold.team is not None:
            self.ledger.settle(hold.org, hold.team_key, hold.amount, hold.spent, team=hold.team)
        if hold.budgeted:
            self.ledger.settle(hold.org, hold.key, hold.amount, hold.spent)

    def _label(self, org: str) -> str:
        """``org``'s label in ``sfq_spend_total``: its own for the first ``metrics.max_org_series``
        orgs of the file, those with a budget first (file order: stable, so every counter stays
        monotonic); ``OTHER`` for the rest and for orgs the file does not name."""
        p = self.policy
        if self._labels_of is not p:
            named = [n for n, o in p.orgs.items() if o.budget is not None]
            named += [n for n, o in p.orgs.items() if o.budget is None]
            self._labels = frozenset(named[:p.metrics.max_org_series])
            self._labels_of = p
        return org if org in self._labels else OTHER

    def release(self, hold: Hold | None) -> None:
        """A request refused after its reservation: give it back unspent."""
        if hold is not None and not hold.settled:
            hold.spent = 0.0
            self.settle(hold)

    def flush(self) -> None:
        """Write the ledger's file now (at close)."""
        self.ledger.flush()

    def stats(self) -> dict[str, Any]:
        """Per org with a budget (or a team with one): its period, amount, spent and reserved
        (this ledger's view); its teams' budgets under ``teams``, the same way."""
        out: dict[str, Any] = {}
        now = self.wall_clock()

        def row(b: BudgetSpec, org: str, team: str | None) -> dict[str, Any]:
            key, end = period_of(b.per, now)
            return {"amount": b.amount, "per": b.per, "period": key, "spent": self.ledger.spent(org, key, team),
                    "reserved": self.ledger.held(org, key, team), "resets_in": end - now}

        for o in self.policy.orgs.values():
            teams = {t.name: row(t.budget, o.name, t.name) for t in o.teams.values() if t.budget is not None}
            if o.budget is not None:
                out[o.name] = row(o.budget, o.name, None)
            if teams:
                out.setdefault(o.name, {})["teams"] = teams
        return out


class SpendCollector(Collector):
    """``sfq_spend_total{org,pool}``: currency settled by this gateway since it started (at
    most ``metrics.max_org_series`` org labels, the rest under ``org="_other"``)."""

    def __init__(self, book: SpendBook) -> None:
        self.book = book

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily("sfq_spend", "Currency spent (usage x the pool's prices)", labels=("org", "pool"))]

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily("sfq_spend", "Currency spent (usage x the pool's prices)", labels=("org", "pool"))
        for (org, pool), v in sorted(self.book.totals.items()):
            fam.add_metric([org, pool], v)
        yield fam
