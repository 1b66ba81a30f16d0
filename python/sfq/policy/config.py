"""The policy file: YAML into typed, immutable objects.

Every field is checked; unknown keys and repeated keys are errors (a typo is caught, not
ignored), and every error is a :class:`sfq.errors.PolicyError` whose message starts with the
path of the bad field, e.g. ``classes.batch.weight: must be a number > 0, got -1``. List
items are written ``pools.gpu.backends[0].url``. Every field is checked: a file with several
bad fields raises one :class:`PolicyErrors` that lists them all (``errors``), and names in
``unchecked`` what could not be checked until they are fixed (a check that needs a bad field:
a key against the other orgs' when its org is bad). A YAML syntax error names the source and
its line. The format is documented field by field in ``docs/policy.md``.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar, cast

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
    "ON_LIMIT",
    "PolicyErrors",
    "load_policy",
    "parse_policy",
    "policy_from_mapping",
]

#: retry backoff shapes: full jitter (uniform in [0, cap]), plain doubling, a constant delay
BACKOFFS = ("exponential_with_jitter", "exponential", "constant")
#: what a gateway sharing Redis does while it cannot reach it (``state.on_loss``)
ON_LOSS = ("local", "refuse")
#: what a request over its org's ``requests_per_minute`` gets (``on_limit`` of an org, the
#: org template or a class): ``wait``, for its token when that comes before its deadline (or
#: queue age, or ``max_wait``), else a refusal; ``refuse``, a refusal at once
ON_LIMIT = ("wait", "refuse")
#: ``on_limit`` where neither the org nor the class sets it: today's 429 (docs/policy.md)
DEFAULT_ON_LIMIT = "refuse"
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_URL = re.compile(r"^https?://[^\s/]+(/\S*)?$")
_REDIS = re.compile(r"^(redis|rediss|unix)://\S+$")
#: a budget's periods (UTC): the spend starts again at each day's or month's start
BUDGET_PERIODS = ("day", "month")
_T = TypeVar("_T")


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
    #: slots kept back (a prototype, default 0: off): when no more than ``headroom`` of the
    #: pool's slots are free, a weighted flow may take one only while it has nothing running
    #: or fewer running than its part of the slots not kept (over the flows with work; as
    #: Kubernetes API Priority and Fairness lets seats be borrowed); the rest wait, set aside,
    #: so that a quiet flow finds a slot at once instead of waiting for one to free
    headroom: int = 0


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
    a row the oldest large one goes (``small_cost`` ``None``: one FIFO per flow).
    ``deadline_seconds``: the deadline of a request of the class that states none (as if it
    sent ``X-SFQ-Timeout``); ``ttft_objective_seconds``: the time to first token the operator
    promises (a readout, it changes no decision); ``refuse_unmeetable``: a request that cannot
    start before its deadline is refused at once (``deadline_unmeetable``) rather than wait and
    be dropped (docs/policy.md, "Deadlines and service levels")."""

    name: str
    strict: bool = False
    weight: float = 1.0
    max_in_flight: int | None = None
    max_queue_length: int | None = None
    max_queue_age_seconds: float | None = None
    small_cost: float | None = 2048.0
    small_picks: int = 4
    deadline_seconds: float | None = None
    ttft_objective_seconds: float | None = None
    refuse_unmeetable: bool = False
    #: what its requests get over their org's ``requests_per_minute`` (``ON_LIMIT``; ``None``:
    #: not set, so the org's setting or the default applies: :meth:`Policy.waits_for_rate`)
    on_limit: str | None = None


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
    #: what its requests get over its ``requests_per_minute`` (``ON_LIMIT``; ``None``: not set,
    #: the class's setting or the default applies: :meth:`Policy.waits_for_rate`)
    on_limit: str | None = None

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
    """Shared state for several gateways (every ``sfq serve`` and ``PolicyDispatcher`` started
    with the file), or (``file`` without ``redis``) one gateway's spend kept in a file across
    restarts. Without the section a dispatcher keeps its state in memory."""

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
        once, then kept until :meth:`forget_orgs` lets it go: an equal one is made again on the
        next use), else ``None`` (the policy does not know it). Every rule that needs an org's
        spec asks here. ``keep=False``: a template org not made yet is made for this answer
        only (a request not accepted yet must leave nothing)."""
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
        """The orgs :meth:`org` has made from the template and keeps, in the order they were made."""
        return list(self._made.values())

    def forget_orgs(self, keep: Container[str] = ()) -> int:
        """Let go of the orgs made from the template, but those named in ``keep`` (the orgs
        with requests live); returns how many. Their specs are the template's under their
        names: made again, equal, on their next use, so an org name seen once costs nothing
        once forgotten (``PolicyEngine.forget_idle`` calls it on a timer)."""
        made = self._made
        gone = [name for name in made if name not in keep]
        for name in gone:
            del made[name]
        if gone and len(gone) >= len(made):  # (a dict keeps its size after deletions: a new one is compact)
            kept = dict(made)
            made.clear()
            made.update(kept)
        return len(gone)

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

    def waits_for_rate(self, org: str, cls: str) -> bool:
        """Whether a request of ``org`` in class ``cls`` over the org's ``requests_per_minute``
        waits for its token (``on_limit: wait``) rather than being refused at once: the org's
        own ``on_limit`` (or its template's) when it sets one, else the class's, else
        :data:`DEFAULT_ON_LIMIT`."""
        o = self.org(org, keep=False)
        how = o.on_limit if o is not None else None
        if how is None:
            c = self.classes.get(cls)
            how = c.on_limit if c is not None else None
        return (how or DEFAULT_ON_LIMIT) == "wait"

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
    errs = _Collect()  # repeated keys: reported with the fields' errors
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            data = _plain(loader, node, "", errs) if node is not None else None
        finally:
            loader.dispose()
            loader.constructed_objects.clear()  # (it keeps every node it constructed)
    except yaml.YAMLError as exc:
        raise PolicyError("", _yaml_problem(source, exc)) from None
    del loader, node
    try:
        policy = policy_from_mapping(data, source=source)
    except PolicyError as exc:
        errs.add(exc)
    errs.raise_any()
    del data
    if len(policy.orgs) >= _COMPACT_ORGS:
        rows = _org_rows(policy)
        policy = replace(policy, orgs=MappingProxyType({}))  # the parse's orgs go, and the arenas they held
        policy = replace(policy, orgs=_orgs_from_rows(rows))
    return policy


def _yaml_problem(source: str, exc: yaml.YAMLError) -> str:
    """A YAML syntax error as ``SOURCE, line L, column C: not valid YAML: PROBLEM (CONTEXT)``:
    PyYAML's own message names ``<unicode string>``, the text it was given, not the file."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return f"{source}: not valid YAML: {exc}"
    m = exc.problem_mark
    out = f"{source}, line {m.line + 1}, column {m.column + 1}: not valid YAML: {exc.problem}"
    if exc.context:
        cm = exc.context_mark
        out += f" ({exc.context}" + (f" at line {cm.line + 1}, column {cm.column + 1})" if cm is not None else ")")
    return out


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


def _plain(loader: Any, node: yaml.Node, path: str, errs: _Collect) -> Any:
    """A composed YAML node as plain Python, refusing repeated keys (PyYAML keeps the last):
    each is an error in ``errs``, and the first value is the one checked."""
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for knode, vnode in node.value:
            key = loader.construct_object(knode, deep=True)
            if not isinstance(key, str):
                errs.add(PolicyError(path, f"keys must be strings, got {key!r} (line {knode.start_mark.line + 1})"))
                continue
            sub = f"{path}.{key}" if path else key
            if key in out:
                errs.add(PolicyError(sub, f"appears twice (line {knode.start_mark.line + 1})"))
                continue
            out[key] = _plain(loader, vnode, sub, errs)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_plain(loader, v, f"{path}[{i}]", errs) for i, v in enumerate(node.value)]
    return loader.construct_object(node, deep=True)


# ===================================================================== field checks
def _desc(v: object) -> str:
    return repr(v) if not isinstance(v, (dict, list)) else f"a {'mapping' if isinstance(v, dict) else 'list'}"


def _section(v: object, path: str, allowed: tuple[str, ...], errs: _Collect) -> dict[str, Any]:
    """``v`` as a mapping (else an error raised); each unknown key is an error in ``errs``, and
    the known ones are still checked."""
    if not isinstance(v, dict):
        raise PolicyError(path, f"must be a mapping, got {_desc(v)}")
    for k in v:
        if k not in allowed:
            errs.add(PolicyError(f"{path}.{k}" if path else k, f"unknown key (expected one of: {', '.join(allowed)})"))
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
    errs = _Collect()
    out = [errs.check(_string, x, f"{path}[{i}]") for i, x in enumerate(v)]
    seen: set[str] = set()
    for i, x in enumerate(out):
        if x is not None and x in seen:
            errs.add(PolicyError(f"{path}[{i}]", f"{x!r} is listed twice"))
        if x is not None:
            seen.add(x)
    errs.raise_any()
    return cast("list[str]", out)


def _opt(d: Mapping[str, Any], key: str) -> Any:
    """A key's value, ``None`` when absent (an explicit ``null`` also means "no limit")."""
    return d.get(key)


# ===================================================================== sections
class PolicyErrors(PolicyError):
    """Several fields of one policy are invalid (or one is, and something could not be checked
    because of it). ``errors`` lists them (each a :class:`~sfq.errors.PolicyError` naming its
    field), in file order; ``path`` and ``problem`` are the first one's, and the message lists
    them all, one per line. ``unchecked``: what was not checked because it needs a field that
    is bad (``orgs.c.keys: against the other orgs' keys``): more errors may follow there once
    these are fixed."""

    def __init__(self, errors: list[PolicyError], unchecked: list[str] | None = None) -> None:
        super().__init__(errors[0].path, errors[0].problem)
        self.errors = list(errors)
        self.unchecked = list(unchecked or ())
        self.args = ("\n".join(str(e) for e in errors),)

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)


class _Collect:
    """Runs each check, keeping its error and going on, so one file reports every bad field."""

    def __init__(self) -> None:
        self.errors: list[PolicyError] = []
        self.unchecked: list[str] = []

    def add(self, exc: PolicyError) -> None:
        if isinstance(exc, PolicyErrors):
            self.errors.extend(exc.errors)
            self.unchecked.extend(exc.unchecked)
        else:
            self.errors.append(exc)

    def check(self, fn: Callable[..., _T], *args: Any, **kw: Any) -> _T | None:
        """``fn(*args, **kw)``, or ``None`` with its error kept."""
        try:
            return fn(*args, **kw)
        except PolicyError as exc:
            self.add(exc)
            return None

    def bad(self, *paths: str) -> bool:
        """Whether an error was kept for one of ``paths`` or a field under it."""
        return any(e.path == p or e.path.startswith((p + ".", p + "[")) for e in self.errors for p in paths)

    def skip(self, what: str) -> None:
        """A check left out because a field it needs is bad (``PolicyErrors.unchecked``)."""
        self.unchecked.append(what)

    def raise_any(self) -> None:
        if len(self.errors) == 1 and not self.unchecked:
            raise self.errors[0]
        if self.errors:
            raise PolicyErrors(self.errors, self.unchecked)


def policy_from_mapping(data: object, *, source: str = "<mapping>") -> Policy:
    """Validate a policy given as plain data (what ``yaml.safe_load`` returns). Every field of
    every entry (pool, class, org) and section is checked, so one call names every bad field:
    a single error is raised as itself, several as one :class:`PolicyErrors`."""
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
    named = errs.check(_named, top["classes"], "classes") if "classes" in top else None
    for name, v in (named or {}).items():
        try:
            classes[name] = _class(name, v, f"classes.{name}")
        except PolicyError as exc:
            errs.add(exc)
            bad_classes.append(name)
    # the classes an org may list; None: the section is missing or bad, and nothing is checked against it
    known = {**classes, **{n: ClassSpec(n) for n in bad_classes}} if named is not None else None
    pools: dict[str, PoolSpec] = {}
    bad_pools: list[str] = []
    model_owner: dict[str, str] = {}
    backend_owner: dict[str, str] = {}
    named = (errs.check(_named, top["pools"], "pools") if "pools" in top else None) or {}
    for name, v in named.items():
        try:
            p = _pool(name, v, f"pools.{name}")
        except PolicyError as exc:  # its good models and backends are still checked against the others'
            errs.add(exc)
            bad_pools.append(name)
            models, backend_names = _raw_pool_names(v)
        else:
            pools[name] = p
            models, backend_names = list(enumerate(p.models)), [(i, b.name) for i, b in enumerate(p.backends)]
        for i, m in models:
            if m in model_owner:
                errs.add(PolicyError(f"pools.{name}.models[{i}]", f"model {m!r} is already served by pool "
                                                                  f"{model_owner[m]!r} (a model has one pool)"))
            model_owner.setdefault(m, name)
        for i, bn in backend_names:
            if bn in backend_owner:
                errs.add(PolicyError(f"pools.{name}.backends[{i}]",
                                     f"backend {bn!r} is already declared (in pool {backend_owner[bn]!r}); "
                                     "give each backend a unique name"))
            backend_owner.setdefault(bn, name)
    orgs: dict[str, OrgSpec] = {}
    key_owner: dict[str, str] = {}
    lists: dict[tuple[str, ...], tuple[str, ...]] = {}  # one tuple per distinct class list, shared by its orgs
    raw_orgs = top.get("orgs")
    named = (errs.check(_named, raw_orgs, "orgs") if "orgs" in top and not (has_template and not raw_orgs)
             else None) or {}
    if known is None and named:
        errs.skip("orgs: each org's classes against the classes section")
    for name, v in named.items():
        try:
            o, keys = _org(name, v, f"orgs.{name}", known, lists)
        except PolicyError as exc:  # its good keys are still checked against the other orgs'
            errs.add(exc)
            keys, holder = _raw_org_keys(v, f"orgs.{name}"), None
        else:
            orgs[name] = o
            holder = o
        for digest, at in keys:
            if digest in key_owner:
                errs.add(PolicyError(at, f"this key is already the key of {key_owner[digest]}"))
            key_owner.setdefault(digest, _key_holder(holder, digest) if holder is not None else
                                 _raw_key_holder(name, at))
    cost, retry, state, template, server = CostSpec(), RetrySpec(), None, None, ServerSpec()
    cost = (errs.check(_cost, top.get("cost"), "cost") if "cost" in top else None) or cost
    retry = (errs.check(_retry, top.get("retry"), "retry") if "retry" in top else None) or retry
    state = errs.check(_state, top.get("state"), "state") if "state" in top else None
    if has_template:
        template = errs.check(_org_template, top["org_template"], "org_template", known)
    # a pool that is named but invalid is still a pool the section may name
    named_pools = cast("Mapping[str, PoolSpec]", {**pools, **dict.fromkeys(bad_pools)})
    server = (errs.check(_server, top.get("server"), "server", named_pools) if "server" in top else None) or server
    metrics = (errs.check(_metrics, top.get("metrics"), "metrics") if "metrics" in top else None) or MetricsSpec()
    errs.raise_any()
    return Policy(MappingProxyType(pools), MappingProxyType(classes), MappingProxyType(orgs), cost, retry, state,
                  source, org_template=template, server=server, metrics=metrics)


def _raw_pool_names(v: object) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """The models and backend names (``(index, name)``) a pool that does not validate gives
    as far as they are well formed, so that they are checked against the other pools'."""
    d = v if isinstance(v, dict) else {}
    ms, bs = d.get("models"), d.get("backends")
    models = [(i, m) for i, m in enumerate(ms) if isinstance(m, str) and m] if isinstance(ms, list) else []
    names = []
    for i, b in enumerate(bs if isinstance(bs, list) else ()):
        if isinstance(b, dict) and isinstance(b.get("name"), str) and b["name"]:
            names.append((i, b["name"]))
        elif isinstance(b, dict) and "name" not in b and isinstance(b.get("url"), str) and _URL.match(b["url"]):
            names.append((i, b["url"].rstrip("/")))
    return models, names


def _raw_org_keys(v: object, path: str) -> list[tuple[str, str]]:
    """The well-formed keys of an org that does not validate, and of its teams, as
    ``(digest, where it is written)``, so that they are checked against the other orgs'."""
    d = v if isinstance(v, dict) else {}
    out = []
    for entry, where in [(d, path)] + [(t, f"{path}.teams.{n}") for n, t in
                                        (d["teams"].items() if isinstance(d.get("teams"), dict) else ())]:
        if not isinstance(entry, dict):
            continue
        ks, hs = entry.get("keys"), entry.get("key_sha256")
        out += [(hashlib.sha256(k.encode("utf-8")).hexdigest(), f"{where}.keys[{i}]")
                for i, k in enumerate(ks if isinstance(ks, list) else ()) if isinstance(k, str) and k]
        out += [(h.lower(), f"{where}.key_sha256[{i}]")
                for i, h in enumerate(hs if isinstance(hs, list) else ()) if isinstance(h, str) and _HEX64.match(h)]
    first: dict[str, str] = {}
    for dg, at in out:  # (its own repeats are its own errors)
        first.setdefault(dg, at)
    return [(dg, at) for dg, at in first.items()]


def _raw_key_holder(org: str, where: str) -> str:
    """Who holds a key written at ``where`` in org ``org`` (one that does not validate)."""
    team = re.match(r"^orgs\.[^.]+\.teams\.([^.]+)\.", where) if ".teams." in where else None
    return f"team {team.group(1)!r} of org {org!r}" if team else f"org {org!r}"


def _opt_check(errs: _Collect, d: Mapping[str, Any], key: str, path: str, fn: Callable[..., _T], *args: Any,
               default: _T | None = None, **kw: Any) -> _T | None:
    """``fn(d[key], PATH.KEY, *args, **kw)`` when ``key`` is set to something other than
    ``null``, else ``default``; an error is kept in ``errs`` (and gives ``None``)."""
    if _opt(d, key) is None:
        return default
    return errs.check(fn, d[key], f"{path}.{key}", *args, **kw)


def _class(name: str, v: object, path: str) -> ClassSpec:
    errs = _Collect()
    d = _section(v, path, ("strict", "weight", "max_in_flight", "max_queue_length", "max_queue_age_seconds",
                           "small_cost", "small_picks", "deadline_seconds", "ttft_objective_seconds",
                           "refuse_unmeetable", "on_limit"), errs)
    strict = d.get("strict", False)
    if not isinstance(strict, bool):
        errs.add(PolicyError(f"{path}.strict", f"must be true or false, got {_desc(strict)}"))
        errs.skip(f"{path}: the rules of a strict class (max_in_flight and a queue limit, no weight)")
        strict = False
    if strict and "weight" in d:
        errs.add(PolicyError(f"{path}.weight", "a strict class has no weight: it is served before the weighted "
                                               "classes, capped by its max_in_flight"))
    weight = errs.check(_number, d["weight"], f"{path}.weight") if "weight" in d and not strict else 1.0
    mif = _opt_check(errs, d, "max_in_flight", path, _integer)
    mql = _opt_check(errs, d, "max_queue_length", path, _integer)
    age = _opt_check(errs, d, "max_queue_age_seconds", path, _number)
    if strict and mif is None and not errs.bad(f"{path}.max_in_flight"):
        errs.add(PolicyError(f"{path}.max_in_flight", "a strict class needs one, so urgent work can never take the "
                                                      "whole pool"))
    if strict and mql is None and age is None and not errs.bad(f"{path}.max_queue_length",
                                                               f"{path}.max_queue_age_seconds"):
        errs.add(PolicyError(path, "a strict class needs max_queue_length or max_queue_age_seconds, so stale "
                                   "urgent work cannot pile up"))
    small_cost: float | None = 2048.0
    if "small_cost" in d:
        small_cost = None if d["small_cost"] is None else errs.check(_number, d["small_cost"], f"{path}.small_cost")
    picks = errs.check(_integer, d["small_picks"], f"{path}.small_picks") if "small_picks" in d else 4
    deadline = _opt_check(errs, d, "deadline_seconds", path, _number)
    ttft = _opt_check(errs, d, "ttft_objective_seconds", path, _number)
    if deadline is not None and ttft is not None and ttft > deadline:
        errs.add(PolicyError(f"{path}.ttft_objective_seconds", f"must be at most the class's deadline_seconds "
                                                               f"({deadline:g}): a request is ended at its deadline, "
                                                               f"got {ttft:g}"))
    refuse = d.get("refuse_unmeetable", False)
    if not isinstance(refuse, bool):
        errs.add(PolicyError(f"{path}.refuse_unmeetable", f"must be true or false, got {_desc(refuse)}"))
        refuse = False
    elif refuse and strict:
        errs.add(PolicyError(f"{path}.refuse_unmeetable", "a strict class is first come first served across its "
                                                          "orgs, not by deadline: its requests are not refused early"))
    on_limit = _opt_check(errs, d, "on_limit", path, _on_limit)
    errs.raise_any()
    return ClassSpec(name, strict, cast(float, weight), mif, mql, age, small_cost, cast(int, picks), deadline, ttft,
                     refuse, on_limit)


def _on_limit(v: object, path: str) -> str:
    """``on_limit`` (an org's, the template's, a class's): one of :data:`ON_LIMIT`."""
    if v not in ON_LIMIT:
        raise PolicyError(path, f"must be one of {', '.join(ON_LIMIT)}, got {_desc(v)}")
    return str(v)


def _backend(b: object, bp: str) -> BackendSpec:
    errs = _Collect()
    bd = _section(b, bp, ("url", "max_in_flight", "name", "max_context", "api_key_env"), errs)
    url = ""
    if "url" not in bd:
        errs.add(PolicyError(f"{bp}.url", "is required"))
    else:
        url = errs.check(_string, bd["url"], f"{bp}.url") or ""
        if url and not _URL.match(url):
            errs.add(PolicyError(f"{bp}.url", f"must be an http:// or https:// URL, got {url!r}"))
    mif = errs.check(_integer, bd["max_in_flight"], f"{bp}.max_in_flight") if "max_in_flight" in bd else 8
    bname = errs.check(_string, bd["name"], f"{bp}.name") if "name" in bd else url
    ctx = _opt_check(errs, bd, "max_context", bp, _integer)
    env = _opt_check(errs, bd, "api_key_env", bp, _string)
    errs.raise_any()
    return BackendSpec(url.rstrip("/"), cast(int, mif), cast(str, bname).rstrip("/") if "name" not in bd
                       else cast(str, bname), ctx, env)


def _pool(name: str, v: object, path: str) -> PoolSpec:
    errs = _Collect()
    d = _section(v, path, ("models", "backends", "limits", "timeouts", "prices"), errs)
    for need in ("models", "backends"):
        if need not in d:
            errs.add(PolicyError(f"{path}.{need}", "is required"))
    models = errs.check(_strings, d["models"], f"{path}.models") if "models" in d else None
    bl = d.get("backends")
    backends: list[BackendSpec] = []
    if "backends" in d and (not isinstance(bl, list) or not bl):
        errs.add(PolicyError(f"{path}.backends", f"must be a non-empty list of backends, got {_desc(bl)}"))
    elif "backends" in d:
        for i, b in enumerate(cast("list[Any]", bl)):
            spec = errs.check(_backend, b, f"{path}.backends[{i}]")
            if spec is not None:
                backends.append(spec)
    limits: PoolLimits | None = PoolLimits()
    if d.get("limits") is not None:
        limits = errs.check(_limits, d["limits"], f"{path}.limits")
    timeouts: UpstreamTimeouts | None = UpstreamTimeouts()
    if d.get("timeouts") is not None:
        timeouts = errs.check(_timeouts, d["timeouts"], f"{path}.timeouts")
    prices = _opt_check(errs, d, "prices", path, _prices)
    errs.raise_any()
    return PoolSpec(name, tuple(cast("list[str]", models)), tuple(backends), cast(PoolLimits, limits),
                    cast(UpstreamTimeouts, timeouts), prices)


def _limits(v: object, lp: str) -> PoolLimits:
    errs = _Collect()
    ld = _section(v, lp, ("requests_per_minute", "tokens_per_minute", "max_in_flight", "headroom"), errs)
    limits = PoolLimits(_opt_check(errs, ld, "requests_per_minute", lp, _number),
                        _opt_check(errs, ld, "tokens_per_minute", lp, _number),
                        _opt_check(errs, ld, "max_in_flight", lp, _integer),
                        _opt_check(errs, ld, "headroom", lp, _integer) or 0)
    errs.raise_any()
    return limits


def _timeouts(v: object, tp: str) -> UpstreamTimeouts:
    errs = _Collect()
    dflt = UpstreamTimeouts()
    fields = ("connect", "first_byte", "between_events", "total")
    td = _section(v, tp, fields, errs)
    out = UpstreamTimeouts(**{k: _opt_check(errs, td, k, tp, _number) if k in td else getattr(dflt, k)
                              for k in fields})
    errs.raise_any()
    return out


_ORG_SETTINGS = ("classes", "weight", "max_in_flight", "requests_per_minute", "on_limit")
_NESTED = ("teams", "users", "max_users")


def _keys(d: Mapping[str, Any], path: str) -> tuple[list[str], list[str]]:
    """The SHA-256 digests of an entry's ``keys`` and ``key_sha256``, and where each is written."""
    errs = _Collect()
    digests: list[str] = []
    where: list[str] = []
    if "keys" in d:
        for i, k in enumerate(errs.check(_strings, d["keys"], f"{path}.keys", allow_empty=True) or ()):
            digests.append(hashlib.sha256(k.encode("utf-8")).hexdigest())
            where.append(f"{path}.keys[{i}]")
    if "key_sha256" in d:
        for i, h in enumerate(errs.check(_strings, d["key_sha256"], f"{path}.key_sha256", allow_empty=True) or ()):
            if not _HEX64.match(h):
                errs.add(PolicyError(f"{path}.key_sha256[{i}]", f"must be 64 hexadecimal digits (a SHA-256), got {h!r}"))
                continue
            digests.append(h.lower())
            where.append(f"{path}.key_sha256[{i}]")
    for i, dg in enumerate(digests):
        if dg in digests[:i]:
            errs.add(PolicyError(where[i], "this key is listed twice"))
    errs.raise_any()
    return digests, where


def _org(name: str, v: object, path: str, classes: Mapping[str, ClassSpec] | None,
         lists: dict[tuple[str, ...], tuple[str, ...]] | None = None) -> tuple[OrgSpec, list[tuple[str, str]]]:
    """The org, and every key of it and of its teams as ``(digest, where it is written)``.
    ``classes``: those the org may list (``None``: unknown, the org's classes are not checked)."""
    errs = _Collect()
    d = _section(v, path, ("keys", "key_sha256", *_ORG_SETTINGS, *_NESTED, "budget"), errs)
    digests, where = errs.check(_keys, d, path) or ([], [])
    o = errs.check(_org_settings, name, d, path, classes, tuple(digests), lists)
    keys = list(zip(digests, where))
    nested = errs.check(_nested, d, path) if any(k in d for k in _NESTED) else None
    if nested is not None:
        teams, users, max_users, team_keys = nested
        if teams and digests:
            errs.add(PolicyError(where[0], "an org with teams gives its keys to its teams (a key names one team)"))
        keys += team_keys
        if o is not None:
            o = replace(o, teams=teams, users=users, max_users=max_users)
    errs.raise_any()
    return cast(OrgSpec, o), keys


# --------------------------------------------------------------------- nested shares (teams, users)
def _nested(d: Mapping[str, Any], path: str) -> tuple[Mapping[str, TeamSpec], bool, int, list[tuple[str, str]]]:
    """An org's ``teams``, ``users`` and ``max_users`` (docs/policy.md, "Nested shares"), and
    its teams' keys as ``(digest, where it is written)``."""
    errs = _Collect()
    users = False
    if _opt(d, "users") is not None:
        if d["users"] != "equal":
            errs.add(PolicyError(f"{path}.users", f"must be 'equal' (users share their team's part equally), got "
                                                  f"{_desc(d['users'])}"))
        users = True
    max_users = _opt_check(errs, d, "max_users", path, _integer, default=DEFAULT_MAX_USERS)
    if "max_users" in d and not users:
        errs.add(PolicyError(f"{path}.max_users", "applies only with users: equal"))
    teams: dict[str, TeamSpec] = {}
    keys: list[tuple[str, str]] = []
    named = errs.check(_named, d["teams"], f"{path}.teams") if _opt(d, "teams") is not None else None
    for tname, tv in (named or {}).items():
        team = errs.check(_team, tname, tv, f"{path}.teams.{tname}", path, users, max_users)
        if team is not None:
            teams[tname], tkeys = team
            keys += tkeys
    errs.raise_any()
    return MappingProxyType(teams), users, cast(int, max_users), keys


def _team(tname: str, tv: object, tp: str, path: str, users: bool,
          max_users: int | None) -> tuple[TeamSpec, list[tuple[str, str]]]:
    """One team of the org at ``path``, and its keys as ``(digest, where it is written)``."""
    errs = _Collect()
    td = _section(tv, tp, ("weight", "keys", "key_sha256", "max_users", "budget"), errs)
    tdig, twhere = errs.check(_keys, td, tp) or ([], [])
    w = errs.check(_number, td["weight"], f"{tp}.weight") if "weight" in td else 1.0
    if _opt(td, "max_users") is not None and not users:
        errs.add(PolicyError(f"{tp}.max_users", f"applies only with users: equal (set {path}.users)"))
    tmu = _opt_check(errs, td, "max_users", tp, _integer, default=max_users)
    budget = _opt_check(errs, td, "budget", tp, _budget)
    errs.raise_any()
    return TeamSpec(tname, cast(float, w), tuple(tdig), cast(int, tmu), budget), list(zip(tdig, twhere))


def _key_holder(o: OrgSpec, digest: str) -> str:
    """Who holds the key ``digest`` of ``o``: one of its teams, else the org (in messages)."""
    for t in o.teams.values():
        if digest in t.key_digests:
            return f"team {t.name!r} of org {o.name!r}"
    return f"org {o.name!r}"


def _org_template(v: object, path: str, classes: Mapping[str, ClassSpec] | None) -> OrgSpec:
    errs = _Collect()
    if isinstance(v, dict):
        for k in ("keys", "key_sha256"):
            if k in v:
                errs.add(PolicyError(f"{path}.{k}", "a template has no keys: the orgs made from it are the "
                                                    "embedder's own (sfq.Flow(org, cls, pool)); give an org keys "
                                                    "under orgs"))
        v = {k: x for k, x in v.items() if k not in ("keys", "key_sha256")}
    d = _section(v, path, _ORG_SETTINGS, errs)
    o = errs.check(_org_settings, "*", d, path, classes, ())
    if classes is None:
        errs.skip(f"{path}.classes: against the classes section")
    errs.raise_any()
    return cast(OrgSpec, o)


def _org_settings(name: str, d: Mapping[str, Any], path: str, classes: Mapping[str, ClassSpec] | None,
                  digests: tuple[str, ...], lists: dict[tuple[str, ...], tuple[str, ...]] | None = None) -> OrgSpec:
    """An org's settings; ``lists``: the class lists made so far, so that orgs with the same
    list share one tuple (10,000 orgs of one file: 10,000 copies otherwise)."""
    errs = _Collect()
    cls: list[str] | None = None
    if "classes" not in d:
        errs.add(PolicyError(f"{path}.classes", "is required (the classes the org may use; the first is its default)"))
    else:
        cls = errs.check(_strings, d["classes"], f"{path}.classes")
    for i, c in enumerate(cls if classes is not None and cls is not None else ()):
        if classes is not None and c not in classes:
            errs.add(PolicyError(f"{path}.classes[{i}]", f"unknown class {c!r} (classes: {', '.join(classes)})"))
    weight = errs.check(_number, d["weight"], f"{path}.weight") if "weight" in d else 1.0
    mif = _opt_check(errs, d, "max_in_flight", path, _integer)
    rpm = _opt_check(errs, d, "requests_per_minute", path, _number)
    budget = _opt_check(errs, d, "budget", path, _budget)
    on_limit = _opt_check(errs, d, "on_limit", path, _on_limit)
    errs.raise_any()
    ct = tuple(cast("list[str]", cls))
    if lists is not None:
        ct = lists.setdefault(ct, ct)
    o = OrgSpec(name, digests, ct, cast(float, weight), mif, rpm, budget)
    return o if on_limit is None else replace(o, on_limit=on_limit)


def _cost(v: object, path: str) -> CostSpec:
    errs = _Collect()
    d = _section(v, path, ("input_weight", "output_weight", "default_max_tokens", "prior_ratio", "charge",
                           "cached_input_weight"), errs)
    iw = errs.check(_number, d["input_weight"], f"{path}.input_weight", strict_min=False) if "input_weight" in d else 1.0
    ow = (errs.check(_number, d["output_weight"], f"{path}.output_weight", strict_min=False) if "output_weight" in d
          else 2.0)
    if iw == 0 and ow == 0:
        errs.add(PolicyError(path, "input_weight and output_weight cannot both be 0"))
    dm = (errs.check(_integer, d["default_max_tokens"], f"{path}.default_max_tokens") if "default_max_tokens" in d
          else 1024)
    pr = errs.check(_number, d["prior_ratio"], f"{path}.prior_ratio", maximum=1.0) if "prior_ratio" in d else 1.0
    charge = d.get("charge", "served")
    if charge not in CHARGE_MODES:
        errs.add(PolicyError(f"{path}.charge", f"must be one of {', '.join(CHARGE_MODES)}, got {_desc(charge)}"))
    cw = (errs.check(_number, d["cached_input_weight"], f"{path}.cached_input_weight", strict_min=False)
          if "cached_input_weight" in d else 1.0)
    errs.raise_any()
    return CostSpec(cast(float, iw), cast(float, ow), cast(int, dm), cast(float, pr), charge, cast(float, cw))


# ------------------------------------------------------------ spend: prices and budgets
def _prices(v: object, path: str) -> PriceSpec:
    """``pools.NAME.prices``: currency per 1M tokens; ``cached_input`` defaults to ``input``."""
    errs = _Collect()
    d = _section(v, path, ("input", "cached_input", "output"), errs)
    for need in ("input", "output"):
        if need not in d:
            errs.add(PolicyError(f"{path}.{need}", "is required (currency per 1M tokens)"))
    inp = errs.check(_number, d["input"], f"{path}.input", strict_min=False) if "input" in d else None
    out = errs.check(_number, d["output"], f"{path}.output", strict_min=False) if "output" in d else None
    ci = _opt_check(errs, d, "cached_input", path, _number, strict_min=False)
    errs.raise_any()
    return PriceSpec(cast(float, inp), cast(float, out), ci)


def _budget(v: object, path: str) -> BudgetSpec:
    """``orgs.NAME.budget`` (and ``orgs.NAME.teams.TEAM.budget``): ``{amount: >= 0, per: day |
    month}`` (UTC periods)."""
    errs = _Collect()
    d = _section(v, path, ("amount", "per"), errs)
    for need in ("amount", "per"):
        if need not in d:
            errs.add(PolicyError(f"{path}.{need}", "is required"))
    amount = errs.check(_number, d["amount"], f"{path}.amount", strict_min=False) if "amount" in d else None
    per = d.get("per")
    if "per" in d and per not in BUDGET_PERIODS:
        errs.add(PolicyError(f"{path}.per", f"must be one of {', '.join(BUDGET_PERIODS)} (UTC), got {_desc(per)}"))
    errs.raise_any()
    return BudgetSpec(cast(float, amount), str(per))


def _retry(v: object, path: str) -> RetrySpec:
    errs = _Collect()
    d = _section(v, path, ("max_attempts", "budget_per_flow_percent", "backoff", "base_seconds", "max_seconds",
                           "max_pause_seconds"), errs)
    ma = errs.check(_integer, d["max_attempts"], f"{path}.max_attempts") if "max_attempts" in d else 3
    bp = (errs.check(_number, d["budget_per_flow_percent"], f"{path}.budget_per_flow_percent", strict_min=False,
                     maximum=100.0) if "budget_per_flow_percent" in d else 10.0)
    bo = d.get("backoff", "exponential_with_jitter")
    if bo not in BACKOFFS:
        errs.add(PolicyError(f"{path}.backoff", f"must be one of {', '.join(BACKOFFS)}, got {_desc(bo)}"))
    base = errs.check(_number, d["base_seconds"], f"{path}.base_seconds") if "base_seconds" in d else 0.5
    mx = (errs.check(_number, d["max_seconds"], f"{path}.max_seconds") if "max_seconds" in d
          else max(30.0, base or 0.0))
    if base is None and mx is not None and "max_seconds" in d:
        errs.skip(f"{path}.max_seconds: against base_seconds (at least as long)")
    elif base is not None and mx is not None and mx < base:
        errs.add(PolicyError(f"{path}.max_seconds", f"must be >= base_seconds ({base:g}), got {mx:g}"))
    mp = errs.check(_number, d["max_pause_seconds"], f"{path}.max_pause_seconds") if "max_pause_seconds" in d else 60.0
    errs.raise_any()
    return RetrySpec(cast(int, ma), cast(float, bp), str(bo), cast(float, base), cast(float, mx), cast(float, mp))


def _state(v: object, path: str) -> StateSpec:
    errs = _Collect()
    d = _section(v, path, ("redis", "prefix", "lease_seconds", "file", "on_loss"), errs)
    if "redis" not in d and "file" not in d:
        raise PolicyError(f"{path}.redis", "is required (a redis:// URL), or file: a path for one gateway's spend")
    if "redis" in d and "file" in d:
        errs.add(PolicyError(f"{path}.file", "a gateway sharing Redis keeps its spend there: give redis or file, "
                                             "not both"))
        errs.raise_any()
    if "file" in d:
        for k in ("prefix", "lease_seconds", "on_loss"):  # Redis's
            if k in d:
                errs.add(PolicyError(f"{path}.{k}", "unknown key (expected one of: file)"))
        file = errs.check(_string, d["file"], f"{path}.file")
        errs.raise_any()
        return StateSpec(None, file=file)
    url = errs.check(_string, d["redis"], f"{path}.redis")
    if url is not None and not _REDIS.match(url):
        errs.add(PolicyError(f"{path}.redis", f"must be a redis://, rediss:// or unix:// URL, got {url!r}"))
    prefix = d.get("prefix", "sfq:")
    if not isinstance(prefix, str):
        errs.add(PolicyError(f"{path}.prefix", f"must be a string, got {_desc(prefix)}"))
    lease = errs.check(_number, d["lease_seconds"], f"{path}.lease_seconds") if "lease_seconds" in d else 10.0
    on_loss = d.get("on_loss", "local")
    if on_loss not in ON_LOSS:
        errs.add(PolicyError(f"{path}.on_loss", f"must be one of {', '.join(ON_LOSS)}, got {_desc(on_loss)}"))
    errs.raise_any()
    return StateSpec(url, str(prefix), cast(float, lease), on_loss=str(on_loss))


def _server(v: object, path: str, pools: Mapping[str, PoolSpec]) -> ServerSpec:
    errs = _Collect()
    keys = ("header_timeout_seconds", "body_timeout_seconds", "idle_timeout_seconds", "send_timeout_seconds",
            "max_connections", "max_header_bytes", "max_body_bytes")
    d = _section(v, path, (*keys, "pools"), errs)
    dflt = ServerSpec()
    kw: dict[str, Any] = {}
    for k in keys:
        if _opt(d, k) is None:
            continue
        if k.endswith("_seconds"):
            kw[k] = errs.check(_number, d[k], f"{path}.{k}")
        else:
            kw[k] = errs.check(_integer, d[k], f"{path}.{k}", 1024 if k.endswith("_bytes") else 1)
    per_pool: dict[str, int] = {}
    pp = d.get("pools")
    if pp is not None and not isinstance(pp, dict):
        errs.add(PolicyError(f"{path}.pools", f"must be a mapping of pool names to settings, got {_desc(pp)}"))
    elif pp is not None:
        for name, sv in pp.items():
            sp = f"{path}.pools.{name}"
            if name not in pools:
                errs.add(PolicyError(sp, f"unknown pool (pools: {', '.join(pools)})"))
                continue
            sd = errs.check(_section, sv, sp, ("max_body_bytes",), errs)
            limit = _opt_check(errs, sd or {}, "max_body_bytes", sp, _integer, 1024)
            if limit is not None:
                per_pool[name] = limit
    errs.raise_any()
    return ServerSpec(**{**{k: getattr(dflt, k) for k in keys}, **kw}, pool_max_body_bytes=MappingProxyType(per_pool))


def _metrics(v: object, path: str) -> MetricsSpec:
    errs = _Collect()
    d = _section(v, path, ("window_seconds", "max_org_series"), errs)
    dflt = MetricsSpec()
    window = _opt_check(errs, d, "window_seconds", path, _number, default=dflt.window_seconds, minimum=1.0,
                        strict_min=False)
    most = _opt_check(errs, d, "max_org_series", path, _integer, default=dflt.max_org_series)
    errs.raise_any()
    return MetricsSpec(cast(float, window), cast(int, most))
