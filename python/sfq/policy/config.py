"""The policy file: YAML into typed, immutable objects.

Every field is checked; unknown keys and repeated keys are errors (a typo is caught, not
ignored), and every error is a :class:`sfq.errors.PolicyError` whose message starts with the
path of the bad field, e.g. ``classes.batch.weight: must be a number > 0, got -1``. List
items are written ``pools.gpu.backends[0].url``. Every entry is checked: a file with several
bad entries raises one :class:`PolicyErrors` that lists them all (``errors``). The format is documented field by field in
``docs/policy.md``.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, cast

import yaml

from ..errors import PolicyError
from .charge import CHARGE_MODES

__all__ = [
    "BackendSpec",
    "BudgetSpec",
    "ClassSpec",
    "CostSpec",
    "OrgSpec",
    "Policy",
    "PoolLimits",
    "PoolSpec",
    "PriceSpec",
    "RetrySpec",
    "ServerSpec",
    "StateSpec",
    "TeamSpec",
    "UpstreamTimeouts",
    "BACKOFFS",
    "PolicyErrors",
    "load_policy",
    "parse_policy",
    "policy_from_mapping",
]

#: retry backoff shapes: full jitter (uniform in [0, cap]), plain doubling, a constant delay
BACKOFFS = ("exponential_with_jitter", "exponential", "constant")
#: what a gateway sharing Redis does while it cannot reach it (``state.on_loss``)
ON_LOSS = ("local", "refuse")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_URL = re.compile(r"^https?://[^\s/]+(/\S*)?$")
_REDIS = re.compile(r"^(redis|rediss|unix)://\S+$")
#: a budget's periods (UTC): the spend starts again at each day's or month's start
BUDGET_PERIODS = ("day", "month")


# ===================================================================== the objects
@dataclass(frozen=True)
class BackendSpec:
    """One inference server of a pool."""

    url: str
    max_in_flight: int = 8
    name: str = ""  # unique within the policy; default: the URL
    max_context: int | None = None
    #: the environment variable holding this backend's own API key (sent upstream as
    #: ``Authorization: Bearer ...``); clients' keys are never forwarded
    api_key_env: str | None = None


@dataclass(frozen=True)
class PoolLimits:
    """A pool's own limits (each ``None`` = no limit). Token buckets start full, refill
    continuously and hold at most the per-minute figure."""

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_in_flight: int | None = None


@dataclass(frozen=True)
class UpstreamTimeouts:
    """How long a pool's backends may take, in seconds (``None``: no limit). ``connect``: to
    open a connection; ``first_byte``: from sending a request to its first event (a stream)
    or its reply (a plain request, which engines send whole when the generation ends);
    ``between_events``: the longest silence between two events of a stream; ``total``: one
    attempt, start to end. A request past one of them fails as a backend timeout (retried by
    the retry rules while nothing reached its client)."""

    connect: float | None = 5.0
    first_byte: float | None = 300.0
    between_events: float | None = 60.0
    total: float | None = 1800.0


@dataclass(frozen=True)
class PoolSpec:
    """A resource pool: the models it serves, its backends, its limits, its upstream
    timeouts; its own queue."""

    name: str
    models: tuple[str, ...]
    backends: tuple[BackendSpec, ...]
    limits: PoolLimits = PoolLimits()
    timeouts: UpstreamTimeouts = UpstreamTimeouts()
    #: what the pool's tokens cost (``None``: no prices, so no spend and no budget applies here)
    prices: PriceSpec | None = None


@dataclass(frozen=True)
class PriceSpec:
    """A pool's prices, in currency per 1M tokens: ``input`` (prompt tokens not read from a
    cache), ``cached_input`` (``usage.prompt_tokens_details.cached_tokens``; default: the input
    price) and ``output`` (completion tokens)."""

    input: float
    output: float
    cached_input: float | None = None

    def cost(self, prompt: float, cached: float, completion: float) -> float:
        """Currency for ``prompt`` prompt tokens of which ``cached`` came from a cache, and
        ``completion`` output tokens."""
        ci = self.input if self.cached_input is None else self.cached_input
        return ((prompt - cached) * self.input + cached * ci + completion * self.output) / 1e6


@dataclass(frozen=True)
class BudgetSpec:
    """An org's spending budget: at most ``amount`` (currency, the pools' ``prices``) per UTC
    ``per`` (``day`` or ``month``)."""

    amount: float
    per: str


@dataclass(frozen=True)
class ClassSpec:
    """A workload class. ``strict`` classes are served before the weighted ones, each capped
    by ``max_in_flight``; weighted classes share the rest by cost in proportion to ``weight``
    (times the org's weight). ``small_cost``/``small_picks``: within one flow, requests whose
    estimated cost is at most ``small_cost`` go first, but after ``small_picks`` small ones in
    a row the oldest large one goes (``small_cost`` ``None``: one FIFO per flow)."""

    name: str
    strict: bool = False
    weight: float = 1.0
    max_in_flight: int | None = None
    max_queue_length: int | None = None
    max_queue_age_seconds: float | None = None
    small_cost: float | None = 2048.0
    small_picks: int = 4


#: users live at once in one team (or one org without teams) unless the file says otherwise
DEFAULT_MAX_USERS = 1000


@dataclass(frozen=True, slots=True)
class TeamSpec:
    """A team of an org (``orgs.NAME.teams``): its part of the org's share (``weight``,
    against the org's other teams), its keys (SHA-256 hex, as an org's), the most users
    it may have live at once (``max_users``; used when the org's ``users`` is set) and its
    own spending budget (``budget``: a request must fit it and the org's)."""

    name: str
    weight: float = 1.0
    key_digests: tuple[str, ...] = ()
    max_users: int = DEFAULT_MAX_USERS
    #: what the team may spend per day or month, within its org's budget (``None``: no budget)
    budget: BudgetSpec | None = None


@dataclass(frozen=True, slots=True)
class OrgSpec:
    """An organisation: its credentials, the classes it may use (the first is its default),
    its weight and its own limits. ``key_digests`` holds the SHA-256 (hex) of every key, the
    plain ``keys`` hashed at load time plus ``key_sha256``; the plain keys are not kept. An
    org without keys is one an embedder classifies itself (``sfq.Flow(org, cls, pool)``):
    ``sfq serve`` cannot authenticate it. Orgs made from the file's ``org_template`` have no
    keys either."""

    name: str
    key_digests: tuple[str, ...]
    classes: tuple[str, ...]
    weight: float = 1.0
    max_in_flight: int | None = None
    requests_per_minute: float | None = None
    #: what the org may spend per day or month (``None``: no budget)
    budget: BudgetSpec | None = None
    #: the org's share split between its teams by weight (empty: no teams)
    teams: Mapping[str, TeamSpec] = field(default_factory=lambda: MappingProxyType({}))
    #: ``users: equal``: inside each team (or the org, without teams) users share equally
    users: bool = False
    #: users live at once in the org (without teams); each team has its own ``max_users``
    max_users: int = DEFAULT_MAX_USERS

    @property
    def default_class(self) -> str:
        return self.classes[0]

    @property
    def nested(self) -> bool:
        """Whether the org's share is split further (teams or users): its flows are nodes of
        a tree (``sfq.engine.tree``), not leaves of the pool's scheduler."""
        return bool(self.teams) or self.users


@dataclass(frozen=True)
class CostSpec:
    """The cost estimator's weights: cost = input_weight * prompt + output_weight * output."""

    input_weight: float = 1.0
    output_weight: float = 2.0
    default_max_tokens: int = 1024
    prior_ratio: float = 1.0
    #: what a request is charged (``sfq.engine.CHARGE_MODES``): ``served`` (default), ``settle`` or ``seed``
    charge: str = "served"
    #: what one cached prompt token (``usage.prompt_tokens_details.cached_tokens``) counts as, in
    #: prompt tokens: in the charge and in ``tokens_per_minute`` (1: like any prompt token)
    cached_input_weight: float = 1.0


@dataclass(frozen=True)
class RetrySpec:
    """Retries: ``max_attempts`` counts the first try; at most ``budget_per_flow_percent`` of
    a flow's attempts over the last minute may be retries (one is always allowed)."""

    max_attempts: int = 3
    budget_per_flow_percent: float = 10.0
    backoff: str = "exponential_with_jitter"
    base_seconds: float = 0.5
    max_seconds: float = 30.0
    #: the longest an upstream's ``Retry-After`` may pause one of its backends (seconds)
    max_pause_seconds: float = 60.0


@dataclass(frozen=True)
class StateSpec:
    """Shared state for several gateways (``sfq serve`` replicas), or (``file`` without
    ``redis``) one gateway's spend kept in a file across restarts. An in-process policy keeps
    its state in memory and does not connect anywhere."""

    redis: str | None
    prefix: str = "sfq:"
    lease_seconds: float = 10.0
    #: one gateway without Redis: the file its spend (budgets) is kept in across restarts
    file: str | None = None
    #: what a gateway does while Redis cannot be reached: ``local`` (go on with its own engine
    #: and its slice of every limit and budget) or ``refuse`` (answer 503 state_unavailable)
    on_loss: str = "local"


@dataclass(frozen=True)
class ServerSpec:
    """The gateway's edge (``sfq serve``): how long a client may take, how much it may send,
    how many connections it may hold. ``max_connections`` ``None``: what the process's
    file-descriptor limit leaves after the backends' share. ``pool_max_body_bytes``: a pool's
    own body limit where it differs from ``max_body_bytes``."""

    header_timeout_seconds: float = 10.0
    body_timeout_seconds: float = 30.0
    idle_timeout_seconds: float = 15.0
    send_timeout_seconds: float = 30.0
    max_connections: int | None = None
    max_header_bytes: int = 32 << 10
    max_body_bytes: int = 32 << 20
    pool_max_body_bytes: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def body_limit(self, pool: str) -> int:
        """The largest body a request for ``pool`` may have, bytes."""
        return self.pool_max_body_bytes.get(pool, self.max_body_bytes)


@dataclass(frozen=True)
class MetricsSpec:
    """What the gateway's fair-share figures and series cover (``metrics:``, docs/gateway.md):
    ``window_seconds``, the window of ``sfq_share``, ``sfq_expected_share``,
    ``sfq_fairness_jain`` and ``/stats``; ``max_org_series``, the most orgs with their own
    ``org`` label (the rest are summed under ``org="_other"``)."""

    window_seconds: float = 60.0
    max_org_series: int = 1000


@dataclass(frozen=True)
class Policy:
    """A validated policy: build it with :func:`load_policy` or :func:`parse_policy`.

    ``orgs`` are the orgs the file names; ``org_template`` (``None`` without one) the spec of
    every other org, which :meth:`org` makes on first use. Ask :meth:`org`, not ``orgs``, for
    the org of a request."""

    pools: Mapping[str, PoolSpec]
    classes: Mapping[str, ClassSpec]
    orgs: Mapping[str, OrgSpec]
    cost: CostSpec = CostSpec()
    retry: RetrySpec = RetrySpec()
    state: StateSpec | None = None
    source: str = field(default="<mapping>", compare=False)
    #: the settings of an org the file does not name (its ``name`` is ``"*"``; no keys)
    org_template: OrgSpec | None = None
    _made: dict[str, OrgSpec] = field(default_factory=dict, init=False, repr=False, compare=False)
    #: the gateway's own edge limits (not the policy's): left out of ``repr``, so gateways
    #: sharing one queue may set them differently
    server: ServerSpec = field(default_factory=ServerSpec, repr=False)
    #: the metrics' window and series bound (the gateway's own, like ``server``: left out of ``repr``)
    metrics: MetricsSpec = field(default_factory=MetricsSpec, repr=False)

    # ------------------------------------------------------------ derived facts
    def pool_of(self, model: str) -> PoolSpec | None:
        """The pool serving ``model``, or ``None``."""
        for p in self.pools.values():
            if model in p.models:
                return p
        return None

    def org(self, name: str, *, keep: bool = True) -> OrgSpec | None:
        """The org called ``name``: the file's entry, else one made from ``org_template`` (made
        once, then kept: the same object every time), else ``None`` (the policy does not know
        it). Every rule that needs an org's spec asks here. ``keep=False``: a template org not
        made yet is made for this answer only (a request not accepted yet must leave nothing)."""
        o = self.orgs.get(name)
        if o is not None:
            return o
        o = self._made.get(name)
        if o is None and self.org_template is not None and isinstance(name, str) and name:
            o = replace(self.org_template, name=name)
            if keep:
                self._made[name] = o
        return o

    def made_orgs(self) -> list[OrgSpec]:
        """The orgs :meth:`org` has made from the template so far, in the order they were made."""
        return list(self._made.values())

    def allows(self, flow: tuple[str, ...]) -> bool:
        """Whether ``flow`` ``(org, class, pool[, team, user])`` is one the policy allows (in
        an org with teams, a team of it; with users, a user; neither in a flat org)."""
        org, cls, pool = flow[:3]
        o = self.org(org)
        if o is None or cls not in o.classes or pool not in self.pools:
            return False
        if len(flow) == 3:
            return not o.nested
        team, user = flow[3], flow[4]
        return ((team in o.teams) if o.teams else team is None) and (user is not None) == o.users

    def flow_weight(self, org: str, cls: str) -> float:
        """A flow's weight: the org's weight times the class's (strict classes: the org's)."""
        c = self.classes[cls]
        o = self.org(org)
        if o is None:
            raise KeyError(org)
        return o.weight * (1.0 if c.strict else c.weight)

    def flows(self, pool: str | None = None) -> list[tuple[str, str, str]]:
        """Every flow ``(org, class, pool)`` of the orgs the file names, in file order (an org
        made from the template has flows too, once used; they are not listed here)."""
        pools = [pool] if pool is not None else list(self.pools)
        return [(o.name, c, p) for p in pools for o in self.orgs.values() for c in o.classes]

    def share(self, flow: tuple[str, str, str]) -> float | None:
        """The flow's share of its pool's weighted capacity when it and every weighted flow of
        the orgs the file names are backlogged (``None`` for a strict class's flow)."""
        org, cls, pool = flow[:3]
        if self.classes[cls].strict:
            return None
        flows = self.flows(pool)
        if (org, cls, pool) not in flows:
            flows.append((org, cls, pool))
        total = sum(self.flow_weight(o, c) for o, c, _ in flows if not self.classes[c].strict)
        return self.flow_weight(org, cls) / total

    @property
    def nested(self) -> bool:
        """Whether some org of the file has teams or users (nested shares)."""
        return any(o.nested for o in self.orgs.values())

    @property
    def strict_classes(self) -> tuple[str, ...]:
        """Strict classes in file order (the order they are served in)."""
        return tuple(c.name for c in self.classes.values() if c.strict)


# ===================================================================== loading
def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file (YAML). Raises ``PolicyError`` (naming the field) or
    ``OSError`` when the file cannot be read."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    return parse_policy(text, source=str(p))


def parse_policy(text: str, *, source: str = "<string>") -> Policy:
    """Validate a policy given as YAML text."""
    if not isinstance(text, str):
        raise TypeError(f"the policy text must be a str, got {type(text).__name__}")
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            data = _plain(loader, node, "") if node is not None else None
        finally:
            loader.dispose()
            loader.constructed_objects.clear()  # (it keeps every node it constructed)
    except yaml.YAMLError as exc:
        raise PolicyError("", f"{source}: not valid YAML: {exc}") from None
    del loader, node
    policy = policy_from_mapping(data, source=source)
    del data
    if len(policy.orgs) >= _COMPACT_ORGS:
        rows = _org_rows(policy)
        policy = replace(policy, orgs=MappingProxyType({}))  # the parse's orgs go, and the arenas they held
        policy = replace(policy, orgs=_orgs_from_rows(rows))
    return policy


#: orgs from which a parsed policy's orgs are made again, side by side (below: a few arenas at most)
_COMPACT_ORGS = 1_000


def _org_rows(policy: Policy) -> bytes:
    """The orgs of ``policy``, written out so that they can be made again once everything the
    parse made is freed (:func:`_orgs_from_rows`).

    CPython's small-object allocator returns memory to the system an arena (1 MiB) at a time,
    and only an arena with no live object left. The parse makes about twenty short-lived
    objects per scalar (YAML nodes, marks, plain values, paths), and the orgs' names and specs
    end up scattered among them, a few per 16 KiB pool: a 10,000-org file left the process
    about 35 MB larger for the 3 MB it keeps. Written out (``pickle``: one ``bytes``, outside
    that allocator), let go, and read back once the rest is freed, the orgs are made side by
    side (``benchmarks/README.md``, "Memory per org")."""
    names = [f.name for f in fields(OrgSpec)]
    return pickle.dumps([tuple(dict(v) if isinstance(v, MappingProxyType) else v  # (teams: pickled as a dict)
                               for v in (getattr(o, n) for n in names)) for o in policy.orgs.values()],
                        protocol=pickle.HIGHEST_PROTOCOL)


def _orgs_from_rows(rows: bytes) -> Mapping[str, OrgSpec]:
    """The orgs :func:`_org_rows` wrote, in the same order (orgs that shared a tuple still do)."""
    made: dict[str, OrgSpec] = {}
    for r in pickle.loads(rows):
        values: list[Any] = [MappingProxyType(v) if isinstance(v, dict) else v for v in r]
        made[r[0]] = OrgSpec(*values)
    return MappingProxyType(made)


#: libyaml's parser when PyYAML was built with it (a 10,000-org file: about 1 s, not 4), else PyYAML's own
_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _plain(loader: Any, node: yaml.Node, path: str) -> Any:
    """A composed YAML node as plain Python, refusing repeated keys (PyYAML keeps the last)."""
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for knode, vnode in node.value:
            key = loader.construct_object(knode, deep=True)
            if not isinstance(key, str):
                raise PolicyError(path, f"keys must be strings, got {key!r} (line {knode.start_mark.line + 1})")
            sub = f"{path}.{key}" if path else key
            if key in out:
                raise PolicyError(sub, f"appears twice (line {knode.start_mark.line + 1})")
            out[key] = _plain(loader, vnode, sub)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_plain(loader, v, f"{path}[{i}]") for i, v in enumerate(node.value)]
    return loader.construct_object(node, deep=True)


# ===================================================================== field checks
def _desc(v: object) -> str:
    return repr(v) if not isinstance(v, (dict, list)) else f"a {'mapping' if isinstance(v, dict) else 'list'}"


def _section(v: object, path: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise PolicyError(path, f"must be a mapping, got {_desc(v)}")
    for k in v:
        if k not in allowed:
            raise PolicyError(f"{path}.{k}" if path else k,
                              f"unknown key (expected one of: {', '.join(allowed)})")
    return v


def _named(v: object, path: str) -> dict[str, Any]:
    """A mapping of names to entries (pools, classes, orgs): non-empty, names non-empty."""
    if not isinstance(v, dict):
        raise PolicyError(path, f"must be a mapping of names to entries, got {_desc(v)}")
    if not v:
        raise PolicyError(path, "must name at least one entry")
    for k in v:
        if not k.strip():
            raise PolicyError(f"{path}.{k}", "names must be non-empty")
    return v


def _number(v: object, path: str, *, minimum: float = 0.0, strict_min: bool = True,
            maximum: float | None = None) -> float:
    want = f"a number {'>' if strict_min else '>='} {minimum:g}" + (f" and <= {maximum:g}" if maximum else "")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PolicyError(path, f"must be {want}, got {_desc(v)}")
    x = float(v)
    if not math.isfinite(x) or x < minimum or (strict_min and x == minimum) or (maximum is not None and x > maximum):
        raise PolicyError(path, f"must be {want}, got {_desc(v)}")
    return x


def _integer(v: object, path: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise PolicyError(path, f"must be an integer >= {minimum}, got {_desc(v)}")
    return v


def _string(v: object, path: str) -> str:
    if not isinstance(v, str) or not v:
        raise PolicyError(path, f"must be a non-empty string, got {_desc(v)}")
    return v


def _strings(v: object, path: str, *, allow_empty: bool = False) -> list[str]:
    if not isinstance(v, list):
        raise PolicyError(path, f"must be a list of strings, got {_desc(v)}")
    if not v and not allow_empty:
        raise PolicyError(path, "must not be empty")
    out = [_string(x, f"{path}[{i}]") for i, x in enumerate(v)]
    for i, x in enumerate(out):
        if x in out[:i]:
            raise PolicyError(f"{path}[{i}]", f"{x!r} is listed twice")
    return out


def _opt(d: Mapping[str, Any], key: str) -> Any:
    """A key's value, ``None`` when absent (an explicit ``null`` also means "no limit")."""
    return d.get(key)


# ===================================================================== sections
class PolicyErrors(PolicyError):
    """Several fields of one policy are invalid. ``errors`` lists them (each a
    :class:`~sfq.errors.PolicyError` naming its field), in file order; ``path`` and ``problem``
    are the first one's, and the message lists them all, one per line."""

    def __init__(self, errors: list[PolicyError]) -> None:
        super().__init__(errors[0].path, errors[0].problem)
        self.errors = list(errors)
        self.args = ("\n".join(str(e) for e in errors),)

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)


class _Collect:
    """Runs each check, keeping its error and going on, so one file reports every bad entry."""

    def __init__(self) -> None:
        self.errors: list[PolicyError] = []

    def add(self, exc: PolicyError) -> None:
        self.errors.extend(exc.errors if isinstance(exc, PolicyErrors) else [exc])

    def raise_any(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise PolicyErrors(self.errors)


def policy_from_mapping(data: object, *, source: str = "<mapping>") -> Policy:
    """Validate a policy given as plain data (what ``yaml.safe_load`` returns). Every entry
    (pool, class, org) and section is checked, so one call names every bad field: a single
    error is raised as itself, several as one :class:`PolicyErrors`."""
    sections = ("pools", "classes", "orgs", "org_template", "cost", "retry", "state", "server", "metrics")
    top = data if data is not None else {}
    if not isinstance(top, dict):
        raise PolicyError("", f"must be a mapping, got {_desc(top)}")
    errs = _Collect()
    for k in top:
        if k not in sections:
            errs.add(PolicyError(k, f"unknown key (expected one of: {', '.join(sections)})"))
    for need in ("pools", "classes"):
        if need not in top:
            errs.add(PolicyError(need, "is required"))
    has_template = top.get("org_template") is not None
    if "orgs" not in top and not has_template:
        errs.add(PolicyError("orgs", "is required (or an org_template for the orgs the file does not name)"))
    classes: dict[str, ClassSpec] = {}
    bad_classes: list[str] = []  # named but invalid: an org may still list them (no second error)
    try:
        named = _named(top["classes"], "classes") if "classes" in top else {}
    except PolicyError as exc:
        errs.add(exc)
        named = {}
    for name, v in named.items():
        try:
            classes[name] = _class(name, v, f"classes.{name}")
        except PolicyError as exc:
            errs.add(exc)
            bad_classes.append(name)
    pools: dict[str, PoolSpec] = {}
    bad_pools: list[str] = []
    model_owner: dict[str, str] = {}
    backend_owner: dict[str, str] = {}
    try:
        named = _named(top["pools"], "pools") if "pools" in top else {}
    except PolicyError as exc:
        errs.add(exc)
        named = {}
    for name, v in named.items():
        try:
            p = _pool(name, v, f"pools.{name}")
        except PolicyError as exc:
            errs.add(exc)
            bad_pools.append(name)
            continue
        for i, m in enumerate(p.models):
            if m in model_owner:
                errs.add(PolicyError(f"pools.{name}.models[{i}]", f"model {m!r} is already served by pool "
                                                                  f"{model_owner[m]!r} (a model has one pool)"))
            model_owner.setdefault(m, name)
        for i, b in enumerate(p.backends):
            if b.name in backend_owner:
                errs.add(PolicyError(f"pools.{name}.backends[{i}]",
                                     f"backend {b.name!r} is already declared (in pool {backend_owner[b.name]!r}); "
                                     "give each backend a unique name"))
            backend_owner.setdefault(b.name, name)
        pools[name] = p
    orgs: dict[str, OrgSpec] = {}
    key_owner: dict[str, str] = {}
    lists: dict[tuple[str, ...], tuple[str, ...]] = {}  # one tuple per distinct class list, shared by its orgs
    known = {**classes, **{n: ClassSpec(n) for n in bad_classes}}
    raw_orgs = top.get("orgs")
    try:
        named = ({} if (has_template and (raw_orgs is None or raw_orgs == {})) or "orgs" not in top
                 else _named(raw_orgs, "orgs"))
    except PolicyError as exc:
        errs.add(exc)
        named = {}
    for name, v in named.items():
        try:
            o, keys = _org(name, v, f"orgs.{name}", known, lists)
        except PolicyError as exc:
            errs.add(exc)
            continue
        for digest, at in keys:
            if digest in key_owner:
                errs.add(PolicyError(at, f"this key is already the key of {key_owner[digest]}"))
            key_owner.setdefault(digest, _key_holder(o, digest))
        orgs[name] = o
    cost, retry, state, template, server = CostSpec(), RetrySpec(), None, None, ServerSpec()
    try:
        cost = _cost(top.get("cost"), "cost") if "cost" in top else CostSpec()
    except PolicyError as exc:
        errs.add(exc)
    try:
        retry = _retry(top.get("retry"), "retry") if "retry" in top else RetrySpec()
    except PolicyError as exc:
        errs.add(exc)
    try:
        state = _state(top.get("state"), "state") if "state" in top else None
    except PolicyError as exc:
        errs.add(exc)
    try:
        template = _org_template(top["org_template"], "org_template", known) if has_template else None
    except PolicyError as exc:
        errs.add(exc)
    try:  # a pool that is named but invalid is still a pool the section may name
        named_pools = cast("Mapping[str, PoolSpec]", {**pools, **dict.fromkeys(bad_pools)})
        server = _server(top.get("server"), "server", named_pools) if "server" in top else ServerSpec()
    except PolicyError as exc:
        errs.add(exc)
    metrics = MetricsSpec()
    try:
        metrics = _metrics(top.get("metrics"), "metrics") if "metrics" in top else MetricsSpec()
    except PolicyError as exc:
        errs.add(exc)
    if state is not None and state.redis is not None:  # (a state file is one gateway's: nested shares are fine)
        for name, o in orgs.items():
            if o.nested:
                errs.add(PolicyError(f"orgs.{name}.{'teams' if o.teams else 'users'}",
                                     "nested shares (teams, users) are not carried by the shared ledger yet: "
                                     "remove the state section (one gateway) or this org's teams and users"))
    errs.raise_any()
    return Policy(MappingProxyType(pools), MappingProxyType(classes), MappingProxyType(orgs), cost, retry, state,
                  source, org_template=template, server=server, metrics=metrics)


def _class(name: str, v: object, path: str) -> ClassSpec:
    d = _section(v, path, ("strict", "weight", "max_in_flight", "max_queue_length", "max_queue_age_seconds",
                           "small_cost", "small_picks"))
    strict = d.get("strict", False)
    if not isinstance(strict, bool):
        raise PolicyError(f"{path}.strict", f"must be true or false, got {_desc(strict)}")
    if strict and "weight" in d:
        raise PolicyError(f"{path}.weight", "a strict class has no weight: it is served before the weighted "
                                            "classes, capped by its max_in_flight")
    weight = _number(d["weight"], f"{path}.weight") if "weight" in d else 1.0
    mif = _integer(d["max_in_flight"], f"{path}.max_in_flight") if _opt(d, "max_in_flight") is not None else None
    mql = (_integer(d["max_queue_length"], f"{path}.max_queue_length")
           if _opt(d, "max_queue_length") is not None else None)
    age = (_number(d["max_queue_age_seconds"], f"{path}.max_queue_age_seconds")
           if _opt(d, "max_queue_age_seconds") is not None else None)
    if strict and mif is None:
        raise PolicyError(f"{path}.max_in_flight", "a strict class needs one, so urgent work can never take the "
                                                   "whole pool")
    if strict and mql is None and age is None:
        raise PolicyError(path, "a strict class needs max_queue_length or max_queue_age_seconds, so stale "
                                "urgent work cannot pile up")
    small_cost: float | None = 2048.0
    if "small_cost" in d:
        small_cost = None if d["small_cost"] is None else _number(d["small_cost"], f"{path}.small_cost")
    picks = _integer(d["small_picks"], f"{path}.small_picks") if "small_picks" in d else 4
    return ClassSpec(name, strict, weight, mif, mql, age, small_cost, picks)


def _pool(name: str, v: object, path: str) -> PoolSpec:
    d = _section(v, path, ("models", "backends", "limits", "timeouts", "prices"))
    for need in ("models", "backends"):
        if need not in d:
            raise PolicyError(f"{path}.{need}", "is required")
    models = tuple(_strings(d["models"], f"{path}.models"))
    bl = d["backends"]
    if not isinstance(bl, list) or not bl:
        raise PolicyError(f"{path}.backends", f"must be a non-empty list of backends, got {_desc(bl)}")
    backends: list[BackendSpec] = []
    for i, b in enumerate(bl):
        bp = f"{path}.backends[{i}]"
        bd = _section(b, bp, ("url", "max_in_flight", "name", "max_context", "api_key_env"))
        if "url" not in bd:
            raise PolicyError(f"{bp}.url", "is required")
        url = _string(bd["url"], f"{bp}.url")
        if not _URL.match(url):
            raise PolicyError(f"{bp}.url", f"must be an http:// or https:// URL, got {url!r}")
        mif = _integer(bd["max_in_flight"], f"{bp}.max_in_flight") if "max_in_flight" in bd else 8
        bname = _string(bd["name"], f"{bp}.name") if "name" in bd else url
        ctx = (_integer(bd["max_context"], f"{bp}.max_context")
               if _opt(bd, "max_context") is not None else None)
        env = _string(bd["api_key_env"], f"{bp}.api_key_env") if _opt(bd, "api_key_env") is not None else None
        backends.append(BackendSpec(url.rstrip("/"), mif, bname.rstrip("/") if "name" not in bd else bname, ctx,
                                    env))
    limits = PoolLimits()
    if d.get("limits") is not None:
        lp = f"{path}.limits"
        ld = _section(d["limits"], lp, ("requests_per_minute", "tokens_per_minute", "max_in_flight"))
        limits = PoolLimits(
            _number(ld["requests_per_minute"], f"{lp}.requests_per_minute")
            if _opt(ld, "requests_per_minute") is not None else None,
            _number(ld["tokens_per_minute"], f"{lp}.tokens_per_minute")
            if _opt(ld, "tokens_per_minute") is not None else None,
            _integer(ld["max_in_flight"], f"{lp}.max_in_flight") if _opt(ld, "max_in_flight") is not None else None,
        )
    timeouts = UpstreamTimeouts()
    if d.get("timeouts") is not None:
        tp = f"{path}.timeouts"
        fields = ("connect", "first_byte", "between_events", "total")
        td = _section(d["timeouts"], tp, fields)
        timeouts = UpstreamTimeouts(**{
            k: (_number(td[k], f"{tp}.{k}") if td[k] is not None else None) if k in td else getattr(timeouts, k)
            for k in fields})
    prices = _prices(d["prices"], f"{path}.prices") if _opt(d, "prices") is not None else None
    return PoolSpec(name, models, tuple(backends), limits, timeouts, prices)


_ORG_SETTINGS = ("classes", "weight", "max_in_flight", "requests_per_minute")
_NESTED = ("teams", "users", "max_users")


def _keys(d: Mapping[str, Any], path: str) -> tuple[list[str], list[str]]:
    """The SHA-256 digests of an entry's ``keys`` and ``key_sha256``, and where each is written."""
    digests: list[str] = []
    where: list[str] = []
    if "keys" in d:
        for i, k in enumerate(_strings(d["keys"], f"{path}.keys", allow_empty=True)):
            digests.append(hashlib.sha256(k.encode("utf-8")).hexdigest())
            where.append(f"{path}.keys[{i}]")
    if "key_sha256" in d:
        for i, h in enumerate(_strings(d["key_sha256"], f"{path}.key_sha256", allow_empty=True)):
            if not _HEX64.match(h):
                raise PolicyError(f"{path}.key_sha256[{i}]", f"must be 64 hexadecimal digits (a SHA-256), got {h!r}")
            digests.append(h.lower())
            where.append(f"{path}.key_sha256[{i}]")
    for i, dg in enumerate(digests):
        if dg in digests[:i]:
            raise PolicyError(where[i], "this key is listed twice")
    return digests, where


def _org(name: str, v: object, path: str, classes: Mapping[str, ClassSpec],
         lists: dict[tuple[str, ...], tuple[str, ...]] | None = None) -> tuple[OrgSpec, list[tuple[str, str]]]:
    """The org, and every key of it and of its teams as ``(digest, where it is written)``."""
    d = _section(v, path, ("keys", "key_sha256", *_ORG_SETTINGS, *_NESTED, "budget"))
    digests, where = _keys(d, path)
    o = _org_settings(name, d, path, classes, tuple(digests), lists)
    keys = list(zip(digests, where))
    if any(k in d for k in _NESTED):
        teams, users, max_users, team_keys = _nested(d, path)
        if teams and digests:
            raise PolicyError(where[0], "an org with teams gives its keys to its teams (a key names one team)")
        o = replace(o, teams=teams, users=users, max_users=max_users)
        keys += team_keys
    return o, keys


# --------------------------------------------------------------------- nested shares (teams, users)
def _nested(d: Mapping[str, Any], path: str) -> tuple[Mapping[str, TeamSpec], bool, int, list[tuple[str, str]]]:
    """An org's ``teams``, ``users`` and ``max_users`` (docs/policy.md, "Nested shares"), and
    its teams' keys as ``(digest, where it is written)``."""
    users = False
    if _opt(d, "users") is not None:
        if d["users"] != "equal":
            raise PolicyError(f"{path}.users", f"must be 'equal' (users share their team's part equally), got "
                                               f"{_desc(d['users'])}")
        users = True
    max_users = (_integer(d["max_users"], f"{path}.max_users") if _opt(d, "max_users") is not None
                 else DEFAULT_MAX_USERS)
    if "max_users" in d and not users:
        raise PolicyError(f"{path}.max_users", "applies only with users: equal")
    teams: dict[str, TeamSpec] = {}
    keys: list[tuple[str, str]] = []
    if _opt(d, "teams") is not None:
        named = _named(d["teams"], f"{path}.teams")
        for tname, tv in named.items():
            tp = f"{path}.teams.{tname}"
            td = _section(tv, tp, ("weight", "keys", "key_sha256", "max_users", "budget"))
            tdig, twhere = _keys(td, tp)
            keys += zip(tdig, twhere)
            w = _number(td["weight"], f"{tp}.weight") if "weight" in td else 1.0
            if _opt(td, "max_users") is not None and not users:
                raise PolicyError(f"{tp}.max_users", f"applies only with users: equal (set {path}.users)")
            tmu = _integer(td["max_users"], f"{tp}.max_users") if _opt(td, "max_users") is not None else max_users
            budget = _budget(td["budget"], f"{tp}.budget") if _opt(td, "budget") is not None else None
            teams[tname] = TeamSpec(tname, w, tuple(tdig), tmu, budget)
    return MappingProxyType(teams), users, max_users, keys


def _key_holder(o: OrgSpec, digest: str) -> str:
    """Who holds the key ``digest`` of ``o``: one of its teams, else the org (in messages)."""
    for t in o.teams.values():
        if digest in t.key_digests:
            return f"team {t.name!r} of org {o.name!r}"
    return f"org {o.name!r}"


def _org_template(v: object, path: str, classes: Mapping[str, ClassSpec]) -> OrgSpec:
    if isinstance(v, dict):
        for k in ("keys", "key_sha256"):
            if k in v:
                raise PolicyError(f"{path}.{k}", "a template has no keys: the orgs made from it are the embedder's "
                                                 "own (sfq.Flow(org, cls, pool)); give an org keys under orgs")
    d = _section(v, path, _ORG_SETTINGS)
    return _org_settings("*", d, path, classes, ())


def _org_settings(name: str, d: Mapping[str, Any], path: str, classes: Mapping[str, ClassSpec],
                  digests: tuple[str, ...], lists: dict[tuple[str, ...], tuple[str, ...]] | None = None) -> OrgSpec:
    """An org's settings; ``lists``: the class lists made so far, so that orgs with the same
    list share one tuple (10,000 orgs of one file: 10,000 copies otherwise)."""
    if "classes" not in d:
        raise PolicyError(f"{path}.classes", "is required (the classes the org may use; the first is its default)")
    cls = _strings(d["classes"], f"{path}.classes")
    for i, c in enumerate(cls):
        if c not in classes:
            raise PolicyError(f"{path}.classes[{i}]", f"unknown class {c!r} (classes: {', '.join(classes)})")
    weight = _number(d["weight"], f"{path}.weight") if "weight" in d else 1.0
    mif = _integer(d["max_in_flight"], f"{path}.max_in_flight") if _opt(d, "max_in_flight") is not None else None
    rpm = (_number(d["requests_per_minute"], f"{path}.requests_per_minute")
           if _opt(d, "requests_per_minute") is not None else None)
    budget = _budget(d["budget"], f"{path}.budget") if _opt(d, "budget") is not None else None
    ct = tuple(cls)
    if lists is not None:
        ct = lists.setdefault(ct, ct)
    return OrgSpec(name, digests, ct, weight, mif, rpm, budget)


def _cost(v: object, path: str) -> CostSpec:
    d = _section(v, path, ("input_weight", "output_weight", "default_max_tokens", "prior_ratio", "charge",
                           "cached_input_weight"))
    iw = _number(d["input_weight"], f"{path}.input_weight", strict_min=False) if "input_weight" in d else 1.0
    ow = _number(d["output_weight"], f"{path}.output_weight", strict_min=False) if "output_weight" in d else 2.0
    if iw == 0 and ow == 0:
        raise PolicyError(path, "input_weight and output_weight cannot both be 0")
    dm = _integer(d["default_max_tokens"], f"{path}.default_max_tokens") if "default_max_tokens" in d else 1024
    pr = _number(d["prior_ratio"], f"{path}.prior_ratio", maximum=1.0) if "prior_ratio" in d else 1.0
    charge = d.get("charge", "served")
    if charge not in CHARGE_MODES:
        raise PolicyError(f"{path}.charge", f"must be one of {', '.join(CHARGE_MODES)}, got {_desc(charge)}")
    cw = (_number(d["cached_input_weight"], f"{path}.cached_input_weight", strict_min=False)
          if "cached_input_weight" in d else 1.0)
    return CostSpec(iw, ow, dm, pr, charge, cw)


# ------------------------------------------------------------ spend: prices and budgets
def _prices(v: object, path: str) -> PriceSpec:
    """``pools.NAME.prices``: currency per 1M tokens; ``cached_input`` defaults to ``input``."""
    d = _section(v, path, ("input", "cached_input", "output"))
    for need in ("input", "output"):
        if need not in d:
            raise PolicyError(f"{path}.{need}", "is required (currency per 1M tokens)")
    inp = _number(d["input"], f"{path}.input", strict_min=False)
    out = _number(d["output"], f"{path}.output", strict_min=False)
    ci = (_number(d["cached_input"], f"{path}.cached_input", strict_min=False)
          if _opt(d, "cached_input") is not None else None)
    return PriceSpec(inp, out, ci)


def _budget(v: object, path: str) -> BudgetSpec:
    """``orgs.NAME.budget`` (and ``orgs.NAME.teams.TEAM.budget``): ``{amount: >= 0, per: day |
    month}`` (UTC periods)."""
    d = _section(v, path, ("amount", "per"))
    for need in ("amount", "per"):
        if need not in d:
            raise PolicyError(f"{path}.{need}", "is required")
    amount = _number(d["amount"], f"{path}.amount", strict_min=False)
    per = d["per"]
    if per not in BUDGET_PERIODS:
        raise PolicyError(f"{path}.per", f"must be one of {', '.join(BUDGET_PERIODS)} (UTC), got {_desc(per)}")
    return BudgetSpec(amount, str(per))


def _retry(v: object, path: str) -> RetrySpec:
    d = _section(v, path, ("max_attempts", "budget_per_flow_percent", "backoff", "base_seconds", "max_seconds",
                           "max_pause_seconds"))
    ma = _integer(d["max_attempts"], f"{path}.max_attempts") if "max_attempts" in d else 3
    bp = (_number(d["budget_per_flow_percent"], f"{path}.budget_per_flow_percent", strict_min=False, maximum=100.0)
          if "budget_per_flow_percent" in d else 10.0)
    bo = d.get("backoff", "exponential_with_jitter")
    if bo not in BACKOFFS:
        raise PolicyError(f"{path}.backoff", f"must be one of {', '.join(BACKOFFS)}, got {_desc(bo)}")
    base = _number(d["base_seconds"], f"{path}.base_seconds") if "base_seconds" in d else 0.5
    mx = _number(d["max_seconds"], f"{path}.max_seconds") if "max_seconds" in d else max(30.0, base)
    if mx < base:
        raise PolicyError(f"{path}.max_seconds", f"must be >= base_seconds ({base:g}), got {mx:g}")
    mp = _number(d["max_pause_seconds"], f"{path}.max_pause_seconds") if "max_pause_seconds" in d else 60.0
    return RetrySpec(ma, bp, str(bo), base, mx, mp)


def _state(v: object, path: str) -> StateSpec:
    d = _section(v, path, ("redis", "prefix", "lease_seconds", "file", "on_loss"))
    if "redis" not in d and "file" not in d:
        raise PolicyError(f"{path}.redis", "is required (a redis:// URL), or file: a path for one gateway's spend")
    if "redis" in d and "file" in d:
        raise PolicyError(f"{path}.file", "a gateway sharing Redis keeps its spend there: give redis or file, not both")
    if "file" in d:
        _section(d, path, ("file",))  # prefix, lease_seconds and on_loss are Redis's
        return StateSpec(None, file=_string(d["file"], f"{path}.file"))
    url = _string(d["redis"], f"{path}.redis")
    if not _REDIS.match(url):
        raise PolicyError(f"{path}.redis", f"must be a redis://, rediss:// or unix:// URL, got {url!r}")
    prefix = d.get("prefix", "sfq:")
    if not isinstance(prefix, str):
        raise PolicyError(f"{path}.prefix", f"must be a string, got {_desc(prefix)}")
    lease = _number(d["lease_seconds"], f"{path}.lease_seconds") if "lease_seconds" in d else 10.0
    on_loss = d.get("on_loss", "local")
    if on_loss not in ON_LOSS:
        raise PolicyError(f"{path}.on_loss", f"must be one of {', '.join(ON_LOSS)}, got {_desc(on_loss)}")
    return StateSpec(url, prefix, lease, on_loss=str(on_loss))


def _server(v: object, path: str, pools: Mapping[str, PoolSpec]) -> ServerSpec:
    keys = ("header_timeout_seconds", "body_timeout_seconds", "idle_timeout_seconds", "send_timeout_seconds",
            "max_connections", "max_header_bytes", "max_body_bytes")
    d = _section(v, path, (*keys, "pools"))
    dflt = ServerSpec()
    kw: dict[str, Any] = {}
    for k in keys:
        if _opt(d, k) is None:
            continue
        if k.endswith("_seconds"):
            kw[k] = _number(d[k], f"{path}.{k}")
        else:
            kw[k] = _integer(d[k], f"{path}.{k}", 1024 if k.endswith("_bytes") else 1)
    per_pool: dict[str, int] = {}
    if _opt(d, "pools") is not None:
        pp = d["pools"]
        if not isinstance(pp, dict):
            raise PolicyError(f"{path}.pools", f"must be a mapping of pool names to settings, got {_desc(pp)}")
        for name, sv in pp.items():
            if name not in pools:
                raise PolicyError(f"{path}.pools.{name}", f"unknown pool (pools: {', '.join(pools)})")
            sd = _section(sv, f"{path}.pools.{name}", ("max_body_bytes",))
            if _opt(sd, "max_body_bytes") is not None:
                per_pool[name] = _integer(sd["max_body_bytes"], f"{path}.pools.{name}.max_body_bytes", 1024)
    return ServerSpec(**{**{k: getattr(dflt, k) for k in keys}, **kw}, pool_max_body_bytes=MappingProxyType(per_pool))


def _metrics(v: object, path: str) -> MetricsSpec:
    d = _section(v, path, ("window_seconds", "max_org_series"))
    dflt = MetricsSpec()
    window = (_number(d["window_seconds"], f"{path}.window_seconds", minimum=1.0, strict_min=False)
              if _opt(d, "window_seconds") is not None else dflt.window_seconds)
    most = (_integer(d["max_org_series"], f"{path}.max_org_series")
            if _opt(d, "max_org_series") is not None else dflt.max_org_series)
    return MetricsSpec(window, most)
