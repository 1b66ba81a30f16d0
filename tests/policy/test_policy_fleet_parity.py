"""Parity: every policy file that one gateway accepts, several gateways sharing Redis accept.

A fleet runs the engine's own rules (docs/design.md §5a.1: one gateway decides the fleet's
order with the engine's queues; Redis keeps leases, buckets, spend and the decider's inputs),
so nothing a file says may be refused because of ``state.redis``: nested org -> team -> user
shares, team and org budgets, floors, strict classes, queue space, whatever comes next.

Hypothesis draws policy files over every key of every section (``CATALOG``: one valid value per
key; each key present or not), loads each without a ``state`` section and with ``state.redis``,
and builds a :class:`~sfq.dispatch.PolicyDispatcher` over the shared state (which connects only
when started): the fleet refuses nothing one gateway accepts. A completeness check records the
keys the loader allows in each section and fails when the catalog misses one, so a key added to
the loader is a key this test draws.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfq.errors import PolicyError
from sfq.policy import config, parse_policy

#: one valid value per key, by section (``*``: any name; ``[]``: each item of a list)
CATALOG: dict[str, dict[str, Any]] = {
    "": {"pools": None, "classes": None, "orgs": None, "org_template": None, "cost": None, "retry": None,
         "state": None, "server": None, "metrics": None},
    "pools.*": {"models": ["m"], "backends": None, "limits": None, "timeouts": None, "prices": None},
    "pools.*.backends[]": {"url": "http://127.0.0.1:9", "max_in_flight": 8, "name": "b0", "max_context": 8192,
                           "api_key_env": "SFQ_TEST_KEY"},
    "pools.*.limits": {"requests_per_minute": 600, "tokens_per_minute": 100000, "max_in_flight": 6, "headroom": 1},
    "pools.*.timeouts": {"connect": 2, "first_byte": 30, "between_events": 30, "total": 600},
    "pools.*.prices": {"input": 1, "cached_input": 0.5, "output": 4},
    "classes.*": {"weight": 6, "max_in_flight": 4, "max_queue_length": 50, "max_queue_age_seconds": 30,
                  "small_cost": 200, "small_picks": 2, "deadline_seconds": 20, "ttft_objective_seconds": 2,
                  "refuse_unmeetable": True, "on_limit": "wait"},
    "classes.urgent": {"strict": True, "max_in_flight": 2, "max_queue_length": 10, "max_queue_age_seconds": 5},
    "orgs.*": {"keys": None, "key_sha256": None, "classes": ["interactive", "batch"], "weight": 2,
               "max_in_flight": 5, "requests_per_minute": 300, "teams": None, "users": "equal", "max_users": 20,
               "budget": None, "on_limit": "wait"},
    "orgs.*.budget": {"amount": 50, "per": "month"},
    "orgs.*.teams.*": {"weight": 3, "keys": None, "key_sha256": None, "max_users": 5, "budget": None},
    "orgs.*.teams.*.budget": {"amount": 5, "per": "day"},
    "org_template": {"classes": ["batch"], "weight": 1, "max_in_flight": 3, "requests_per_minute": 60,
                     "on_limit": "wait"},
    "cost": {"input_weight": 1, "output_weight": 2, "default_max_tokens": 512, "prior_ratio": 0.5,
             "charge": "served", "cached_input_weight": 0.25},
    "retry": {"max_attempts": 3, "budget_per_flow_percent": 20, "backoff": "exponential_with_jitter",
              "base_seconds": 0.2, "max_seconds": 5, "max_pause_seconds": 30},
    "state": {"redis": "redis://127.0.0.1:6379/0", "prefix": "sfq:parity:", "lease_seconds": 5, "file": None,
              "on_loss": "local"},
    "server": {"header_timeout_seconds": 10, "body_timeout_seconds": 30, "idle_timeout_seconds": 60,
               "send_timeout_seconds": 30, "max_connections": 2048, "max_header_bytes": 16384,
               "max_body_bytes": 1048576, "pools": None},
    "server.pools.*": {"max_body_bytes": 2097152},
    "metrics": {"window_seconds": 60, "max_org_series": 100},
}
#: keys the catalog knows but the drawn files never hold (one gateway's spend file is not a
#: fleet's ledger; a team's ``key_sha256`` is covered by its ``keys``)
NOT_DRAWN = {("state", "file"), ("orgs.*", "key_sha256"), ("orgs.*.teams.*", "key_sha256")}

HOST_KEYS = {"acme": ["k-acme"], "globex": ["k-globex"]}


@pytest.fixture(scope="module", autouse=True)
def _backend_key() -> Any:
    """The backend's ``api_key_env`` set (a dispatcher refuses one that is not)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SFQ_TEST_KEY", "sk-parity")
        yield


def _org(name: str, keep: set[str], nested: bool) -> dict[str, Any]:
    o: dict[str, Any] = {"classes": ["interactive", "batch", "urgent"]}
    for k in ("weight", "max_in_flight", "requests_per_minute", "on_limit"):
        if k in keep:
            o[k] = CATALOG["orgs.*"][k]
    if "budget" in keep:
        o["budget"] = dict(CATALOG["orgs.*.budget"])
    if not nested:
        o["keys"] = HOST_KEYS[name]
        return o
    users = "users" in keep
    team: dict[str, Any] = {"keys": [f"k-{name}-research"]}
    for k in ("weight", "budget") if "team_budget" in keep else ("weight",):
        if k in keep or k == "budget":
            team[k] = dict(CATALOG["orgs.*.teams.*.budget"]) if k == "budget" else CATALOG["orgs.*.teams.*"][k]
    if users:
        o["users"] = "equal"
        if "max_users" in keep:
            o["max_users"] = CATALOG["orgs.*"]["max_users"]
            team["max_users"] = CATALOG["orgs.*.teams.*"]["max_users"]
    if "teams" in keep or not users:
        o["teams"] = {"research": team, "product": {"keys": [f"k-{name}-product"]}}
    else:
        o["keys"] = HOST_KEYS[name]
    return o


def build(keep: set[str]) -> dict[str, Any]:
    """A policy file holding the keys named in ``keep`` (section-qualified where ambiguous)."""
    pool: dict[str, Any] = {"models": ["m"], "backends": [{"url": "http://127.0.0.1:9"}]}
    b = pool["backends"][0]
    for k in ("max_in_flight", "name", "max_context", "api_key_env"):
        if f"backend.{k}" in keep:
            b[k] = CATALOG["pools.*.backends[]"][k]
    for sect in ("limits", "timeouts", "prices"):
        sub = {k: v for k, v in CATALOG[f"pools.*.{sect}"].items() if f"{sect}.{k}" in keep}
        if sub:
            pool[sect] = sub
    if "prices" not in pool and ("budget" in keep or "team_budget" in keep):
        pool["prices"] = {"input": 1, "output": 4}
    classes: dict[str, Any] = {
        "interactive": {k: v for k, v in CATALOG["classes.*"].items() if f"class.{k}" in keep},
        "batch": {"weight": 1},
        "urgent": {k: v for k, v in CATALOG["classes.urgent"].items() if k == "strict" or f"urgent.{k}" in keep},
    }
    if "urgent.max_in_flight" not in keep and "urgent.max_queue_length" not in keep:
        classes["urgent"].pop("strict")  # (a strict class needs a bound: otherwise a plain one)
    d: dict[str, Any] = {
        "pools": {"gpu": pool}, "classes": classes,
        "orgs": {"acme": _org("acme", keep, "nested" in keep), "globex": _org("globex", keep, False)},
    }
    if "org_template" in keep:
        d["org_template"] = dict(CATALOG["org_template"])
    for sect in ("cost", "retry", "metrics"):
        sub = {k: v for k, v in CATALOG[sect].items() if f"{sect}.{k}" in keep}
        if sub:
            d[sect] = sub
    srv = {k: v for k, v in CATALOG["server"].items() if v is not None and f"server.{k}" in keep}
    if "server.pools" in keep:
        srv["pools"] = {"gpu": dict(CATALOG["server.pools.*"])}
    if srv:
        d["server"] = srv
    return d


KEEPABLE = sorted(
    {f"backend.{k}" for k in CATALOG["pools.*.backends[]"] if k != "url"}
    | {f"{s}.{k}" for s in ("limits", "timeouts", "prices") for k in CATALOG[f"pools.*.{s}"]}
    | {f"class.{k}" for k in CATALOG["classes.*"]}
    | {f"urgent.{k}" for k in CATALOG["classes.urgent"] if k != "strict"}
    | {"weight", "max_in_flight", "requests_per_minute", "on_limit", "budget", "team_budget", "teams", "users",
       "max_users", "nested", "org_template", "server.pools"}
    | {f"{s}.{k}" for s in ("cost", "retry", "metrics") for k in CATALOG[s]}
    | {f"server.{k}" for k, v in CATALOG["server"].items() if v is not None})


def _fleet(d: dict[str, Any]) -> dict[str, Any]:
    st_ = {k: v for k, v in CATALOG["state"].items() if v is not None}
    return {**d, "state": st_}


def _load(d: dict[str, Any]) -> Any:
    return parse_policy(yaml.safe_dump(d, sort_keys=False))


def _outcome(d: dict[str, Any]) -> tuple[bool, str]:
    try:
        _load(d)
    except PolicyError as exc:
        return False, str(exc)
    return True, ""


def _check(keep: set[str]) -> None:
    from sfq.dispatch import PolicyDispatcher

    alone = build(keep)
    ok, why = _outcome(alone)
    if not ok:  # (a combination one gateway refuses: the fleet must refuse it too, for the same reason)
        ok2, why2 = _outcome(_fleet(alone))
        assert not ok2 and why2 == why, (keep, why, why2)
        return
    fleet = _load(_fleet(alone))  # accepted: a PolicyError here is the defect this test looks for
    assert fleet.state is not None and fleet.state.redis
    PolicyDispatcher(_load(alone))
    pd = PolicyDispatcher(fleet)  # its RedisState connects only when started
    assert pd.state.shared


def test_the_fleet_accepts_the_whole_catalog_and_each_key_alone() -> None:
    _check(set(KEEPABLE))
    for k in KEEPABLE:
        _check({k})
        _check({k, "nested"})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sets(st.sampled_from(KEEPABLE)))
def test_the_fleet_refuses_nothing_one_gateway_accepts(keep: set[str]) -> None:
    _check(keep)


def test_the_catalog_names_every_key_the_loader_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every section's allowed keys, as the loader itself lists them while it reads the whole
    catalog, are in ``CATALOG`` (a new key fails this until the parity test draws it)."""
    seen: dict[str, set[str]] = {}
    real = config._section

    def spy(v: object, path: str, allowed: tuple[str, ...], errs: Any) -> dict[str, Any]:
        shape = re.sub(r"\[\d+\]", "[]", path)
        shape = re.sub(r"^(pools|orgs|classes)\.[^.]+", r"\1.*", shape)
        shape = re.sub(r"^(orgs\.\*\.teams|server\.pools)\.[^.]+", r"\1.*", shape)
        seen.setdefault(shape, set()).update(allowed)
        return real(v, path, allowed, errs)

    monkeypatch.setattr(config, "_section", spy)
    whole = _fleet(build(set(KEEPABLE)))
    _load(whole)
    missing = []
    for shape, allowed in seen.items():
        cat = CATALOG.get(shape) or (CATALOG["classes.*"] | CATALOG["classes.urgent"] if shape == "classes.*" else None)
        assert cat is not None, f"a section the catalog does not know: {shape}"
        if shape == "classes.*":
            cat = CATALOG["classes.*"] | CATALOG["classes.urgent"]
        missing += [f"{shape}.{k}" for k in allowed if k not in cat]
    top = set(yaml.safe_load(yaml.safe_dump(whole)))
    assert not missing, f"keys the loader allows that the parity test never draws: {missing}"
    assert top <= set(CATALOG[""]), top
    drawn_sections = {s for s in seen}
    for s in ("pools.*", "pools.*.backends[]", "pools.*.limits", "pools.*.timeouts", "pools.*.prices", "classes.*",
              "orgs.*", "orgs.*.budget", "orgs.*.teams.*", "orgs.*.teams.*.budget", "org_template", "cost", "retry",
              "state", "server", "server.pools.*", "metrics"):
        assert s in drawn_sections, f"the whole catalog never reached section {s}"
    assert NOT_DRAWN <= {(s, k) for s, ks in CATALOG.items() for k in ks}
