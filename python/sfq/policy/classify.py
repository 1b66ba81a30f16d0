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
from typing import NamedTuple

from ..errors import Refused
from .config import OrgSpec, Policy

__all__ = ["Classifier", "Flow", "unknown_org"]


class Flow(NamedTuple):
    """Whose share a request uses: who owns it (``org``), what kind of work it is (``cls``)
    and which resource it waits for (``pool``). The policy's unit of fairness: each flow of a
    pool is served in proportion to its weight (the org's weight times the class's).

    ``sfq serve`` makes it from the bearer key, ``X-SFQ-Class`` and the model; an embedder
    that authenticates its own users makes it itself, ``sfq.Flow(org="acme", cls="batch",
    pool="gpu")``, and the policy checks it (the org known or from the template, the class
    allowed for it, the pool declared)."""

    org: str
    cls: str
    pool: str


def unknown_org(name: object) -> Refused:
    """The refusal of an org the policy has no entry and no template for (403)."""
    return Refused("unknown_org", f"the policy has no org {name!r} (and no org_template for the orgs it does not "
                                  "name)")


class Classifier:
    """Decides the flow of a request by a policy: from a bearer key (:meth:`classify`) or from
    the embedder's own word (:meth:`check`). Credentials are compared in constant time: the
    SHA-256 of the presented key is compared with every configured digest (no early exit), so
    the time taken does not depend on which key, if any, matched, nor on how much of it did."""

    __slots__ = ("policy", "_digests")

    def __init__(self, policy: Policy) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be an sfq.policy.Policy, got {policy!r}")
        self.policy = policy
        # keyed by the SHA-256 of the key: a lookup learns (and leaks in its timing) nothing about
        # a key but its hash, and costs the same for 1 org as for 10,000
        self._digests: dict[bytes, OrgSpec] = {bytes.fromhex(d): o for o in policy.orgs.values() for d in o.key_digests}

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
        if not isinstance(flow, tuple) or len(flow) != 3:
            raise TypeError(f"flow must be an sfq.Flow(org, cls, pool), got {flow!r}")
        org_name, stated, pool = flow
        org = self.org_named(org_name)
        cls = self.class_for(org, stated)
        if pool not in self.policy.pools:
            raise Refused("unknown_model", f"the policy has no pool {pool!r}; pools: {', '.join(self.policy.pools)}")
        if model is not None:
            served = self.pool_for(model)
            if served != pool:
                raise Refused("unknown_model", f"pool {pool!r} does not serve model {model!r} (pool {served!r} "
                                               "does)")
        return Flow(org.name, cls, pool)

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

    def classify(self, credential: str | None, stated_class: str | None, model: object) -> Flow:
        """The flow of a request: ``(org, class, pool)``. Raises ``Refused`` with reason
        ``unauthenticated``, ``class_not_allowed`` or ``unknown_model``."""
        org = self.org_of(credential)
        cls = self.class_for(org, stated_class)
        return Flow(org.name, cls, self.pool_for(model))

    def weight(self, flow: Flow) -> float:
        """The flow's weight: org weight x class weight."""
        return self.policy.flow_weight(flow.org, flow.cls)
