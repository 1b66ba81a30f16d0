"""Trusted classification: credential -> org, stated class -> checked class, model -> pool.

The flow of a request is ``(org, class, pool)``; it is decided here from the trusted policy,
never from the request body. The class a client states is checked against what its org may
use and refused when not allowed: it is never silently upgraded (nor downgraded).

An embedder that authenticates its own users names the org itself (``Flow(org, cls, pool)``,
checked by :meth:`Classifier.check`): the org needs no key in the file, and an org the file
does not name gets the file's ``org_template`` when it has one.
"""

from __future__ import annotations

import hashlib
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from ..errors import Refused
from .config import OrgSpec, Policy

__all__ = ["Classifier", "Flow", "MAX_USER_BYTES", "check_user", "unknown_org"]

#: the longest ``X-SFQ-User`` (bytes, UTF-8)
MAX_USER_BYTES = 128


if not TYPE_CHECKING:
    try:
        from _collections import _tuplegetter as _field  # (CPython's, as collections.namedtuple's fields)
    except ImportError:  # pragma: no cover - another interpreter
        def _field(i, doc):
            return property(itemgetter(i), doc=doc)


class Flow(tuple):  # type: ignore[type-arg]
    """Whose share a request uses: who owns it (``org``), what kind of work it is (``cls``)
    and which resource it waits for (``pool``); in an org with ``teams`` or ``users``, also
    the ``team`` and the ``user`` inside it (docs/policy.md, "Nested shares"). The policy's
    unit of fairness: each flow of a pool is served in proportion to its weight (the org's
    weight times the class's), and a nested flow's share is its team's and user's part of it.

    ``sfq serve`` makes it from the bearer key, ``X-SFQ-Class``, ``X-SFQ-User`` and the model;
    an embedder that authenticates its own users makes it itself, ``sfq.Flow(org="acme",
    cls="batch", pool="gpu", team="research", user="ana")``, and the policy checks it (the org
    known or from the template, the class allowed for it, the pool declared, the team one of
    the org's).

    A flow without team and user is the 3-tuple ``(org, cls, pool)`` (equal to it, same hash),
    as it always was; a nested one is the 5-tuple ``(org, cls, pool, team, user)``."""

    __slots__ = ()

    def __new__(_cls, org: str, cls: str, pool: str, team: str | None = None, user: str | None = None) -> Flow:
        if team is None and user is None:
            return tuple.__new__(_cls, (org, cls, pool))
        return tuple.__new__(_cls, (org, cls, pool, team, user))

    def __getnewargs__(self) -> tuple[Any, ...]:
        return tuple(self)

    if TYPE_CHECKING:
        @property
        def org(self) -> Any: ...  # a str under a policy; a Dispatcher's flow holds its caller's id there

        @property
        def cls(self) -> str: ...

        @property
        def pool(self) -> str: ...
    else:  # the C descriptors namedtuple uses: reading a field costs what it did when Flow was one
        org = _field(0, "who owns the request")
        cls = _field(1, "the workload class")
        pool = _field(2, "the pool it waits for")

    @property
    def team(self) -> str | None:
        """The org's team (``None``: the org has no teams)."""
        return self[3] if len(self) > 3 else None

    @property
    def user(self) -> str | None:
        """The user inside the team (or the org) when the org's ``users`` is set, else ``None``."""
        return self[4] if len(self) > 3 else None

    @property
    def flat(self) -> Flow:
        """The ``(org, cls, pool)`` flow this one is part of (itself when it is flat): what
        counters, metrics and the org's limits are kept under."""
        return self if len(self) == 3 else Flow(self[0], self[1], self[2])

    def __repr__(self) -> str:
        tail = "" if len(self) == 3 else f", team={self[3]!r}, user={self[4]!r}"
        return f"Flow(org={self[0]!r}, cls={self[1]!r}, pool={self[2]!r}{tail})"


def unknown_org(name: object) -> Refused:
    """The refusal of an org the policy has no entry and no template for (403)."""
    return Refused("unknown_org", f"the policy has no org {name!r} (and no org_template for the orgs it does not "
                                  "name)")


def check_user(value: object, param: str = "X-SFQ-User") -> str:
    """A user name as a client states it (``X-SFQ-User``): a non-empty string of at most
    :data:`MAX_USER_BYTES` bytes without control characters; ``BadRequest`` (400) naming
    ``param`` otherwise (the value itself is not echoed: it is the client's)."""
    from ..errors import BadRequest

    if not isinstance(value, str) or not value:
        raise BadRequest(f"{param} must be a non-empty string", param=param)
    n = len(value.encode("utf-8", "surrogatepass"))
    if n > MAX_USER_BYTES:
        raise BadRequest(f"{param} must be at most {MAX_USER_BYTES} bytes, got {n}", param=param)
    if any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in value):
        raise BadRequest(f"{param} must not contain control characters", param=param)
    return value


class Classifier:
    """Decides the flow of a request by a policy: from a bearer key (:meth:`classify`) or from
    the embedder's own word (:meth:`check`). Credentials are compared in constant time: the
    SHA-256 of the presented key is compared with every configured digest (no early exit), so
    the time taken does not depend on which key, if any, matched, nor on how much of it did."""

    __slots__ = ("policy", "_digests", "_teams")

    def __init__(self, policy: Policy) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be an sfq.policy.Policy, got {policy!r}")
        self.policy = policy
        # keyed by the SHA-256 of the key: a lookup learns (and leaks in its timing) nothing about
        # a key but its hash, and costs the same for 1 org as for 10,000
        self._digests: dict[bytes, OrgSpec] = {bytes.fromhex(d): o for o in policy.orgs.values() for d in o.key_digests}
        #: a team's key -> its team (nested shares); its org is in ``_digests`` too
        self._teams: dict[bytes, str] = {}
        for o in policy.orgs.values():
            for t in o.teams.values():
                for d in t.key_digests:
                    self._digests[bytes.fromhex(d)] = o
                    self._teams[bytes.fromhex(d)] = t.name

    def org_of(self, credential: str | None) -> OrgSpec:
        """The org owning ``credential`` (a bearer key). ``Refused("unauthenticated")`` if none."""
        if not isinstance(credential, str) or not credential:
            raise Refused("unauthenticated", "a key is required (Authorization: Bearer KEY)")
        found = self._digests.get(hashlib.sha256(credential.encode("utf-8")).digest())
        if found is None:
            raise Refused("unauthenticated", "unknown key")
        return found

    def org_named(self, name: str) -> OrgSpec:
        """The org an embedder names: the file's entry, else one made from its
        ``org_template``. ``Refused("unknown_org")`` (403) when the file has neither."""
        # (not kept: the org is made for good when a request of it is accepted, engine.submit)
        org = self.policy.org(name, keep=False) if isinstance(name, str) else None
        if org is None:
            raise unknown_org(name)
        return org

    def check(self, flow: Flow, model: object = None) -> Flow:
        """An embedder's own classification, checked: the org known (:meth:`org_named`), the
        class one it may use (``Refused("class_not_allowed")``), the pool declared and, when
        ``model`` is given, serving it (``Refused("unknown_model")``). Returns the flow as a
        :class:`Flow`; a ``cls`` of ``None`` or ``""`` becomes the org's default class."""
        if not isinstance(flow, tuple) or len(flow) not in (3, 5):
            raise TypeError(f"flow must be an sfq.Flow(org, cls, pool[, team, user]), got {flow!r}")
        org_name, stated, pool = flow[:3]
        org = self.org_named(org_name)
        cls = self.class_for(org, stated)
        if pool not in self.policy.pools:
            raise Refused("unknown_model", f"the policy has no pool {pool!r}; pools: {', '.join(self.policy.pools)}")
        if model is not None:
            served = self.pool_for(model)
            if served != pool:
                raise Refused("unknown_model", f"pool {pool!r} does not serve model {model!r} (pool {served!r} "
                                               "does)")
        if len(flow) == 3 and not org.nested:
            return Flow(org.name, cls, pool)
        team, user = (flow[3], flow[4]) if len(flow) == 5 else (None, None)
        return Flow(org.name, cls, pool, *self._member(org, team, user))

    # ------------------------------------------------------------ nested shares
    def _member(self, org: OrgSpec, team: object, user: object) -> tuple[str | None, str | None]:
        """The ``(team, user)`` of a request of ``org`` as its flow holds them: a team the org
        has (``Refused("unknown_org")`` otherwise: a team is part of who a request is), a user
        when the org splits between users (``check_user``; ``None`` there: the one user ``""``);
        both ``None`` in an org without teams or users."""
        if org.teams:
            if team not in org.teams:
                raise Refused("unknown_org", f"org {org.name!r} has no team {team!r}; teams: {', '.join(org.teams)}")
        elif team is not None:
            raise Refused("unknown_org", f"org {org.name!r} has no teams (got team {team!r})")
        if not org.users:
            return (team if org.teams else None), None  # type: ignore[return-value]
        return team, ("" if user is None else check_user(user, "user"))  # type: ignore[return-value]

    def member(self, org: OrgSpec, credential: str, user: str | None) -> tuple[str | None, str | None]:
        """The ``(team, user)`` of a request authenticated by ``credential`` (a key of ``org``)
        stating ``user`` (``X-SFQ-User``, checked by :func:`check_user`, or ``None``): the team
        that owns the key; the stated user, else one named after the key (a short prefix of its
        SHA-256: the key itself is never kept); ``(None, None)`` in a flat org."""
        if not org.nested:
            return None, None
        digest = hashlib.sha256(credential.encode("utf-8")).digest()
        team = self._teams.get(digest) if org.teams else None
        if not org.users:
            return team, None
        return team, (user if user is not None else "key:" + digest.hex()[:12])

    def class_for(self, org: OrgSpec, stated: str | None) -> str:
        """The class of a request of ``org`` that states ``stated`` (``None``: the org's default).
        ``Refused("class_not_allowed")`` when the org may not use it (or it does not exist)."""
        if stated is None or stated == "":
            return org.default_class
        if stated not in org.classes:
            known = "" if stated in self.policy.classes else " (no such class)"
            raise Refused("class_not_allowed",
                          f"org {org.name!r} may not use class {stated!r}{known}; allowed: {', '.join(org.classes)}")
        return stated

    def pool_for(self, model: object) -> str:
        """The pool serving ``model``. ``Refused("unknown_model")`` when none does."""
        if not isinstance(model, str) or not model:
            raise Refused("unknown_model", f"the request must name a model, got {model!r}")
        p = self.policy.pool_of(model)
        if p is None:
            models = sorted(m for pool in self.policy.pools.values() for m in pool.models)
            raise Refused("unknown_model", f"no pool serves model {model!r}; models: {', '.join(models)}")
        return p.name

    def classify(self, credential: str | None, stated_class: str | None, model: object,
                 user: str | None = None) -> Flow:
        """The flow of a request: ``(org, class, pool)``, with its team and user in a nested
        org (:meth:`member`). Raises ``Refused`` with reason ``unauthenticated``,
        ``class_not_allowed`` or ``unknown_model``."""
        org = self.org_of(credential)
        cls = self.class_for(org, stated_class)
        pool = self.pool_for(model)
        if not org.nested:
            return Flow(org.name, cls, pool)
        assert credential is not None  # (org_of accepted it)
        return Flow(org.name, cls, pool, *self.member(org, credential, user))

    def weight(self, flow: Flow) -> float:
        """The flow's weight: org weight x class weight."""
        return self.policy.flow_weight(flow.org, flow.cls)
