"""The policy file: a valid file loads into immutable objects; every kind of mistake is
refused with a message that starts with the bad field's path."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from typing import Any, Callable

import pytest
import yaml

from sfq.errors import PolicyError, SFQError
from sfq.policy import ClassSpec, Policy, ServerSpec, load_policy, parse_policy, policy_from_mapping

from policy_helpers import EXAMPLE


def base() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE)


def test_example_loads(example: Policy) -> None:
    assert list(example.pools) == ["local-gpu"]
    pool = example.pools["local-gpu"]
    assert pool.models == ("llama-3-8b",)
    assert pool.backends[0].url == "http://127.0.0.1:8001" and pool.backends[0].max_in_flight == 16
    assert pool.limits.requests_per_minute == 900 and pool.limits.tokens_per_minute == 180000
    assert pool.limits.max_in_flight == 24
    assert example.classes["system"] == ClassSpec("system", strict=True, max_in_flight=2, max_queue_length=50,
                                                  max_queue_age_seconds=5.0, weight=1.0)
    assert example.classes["interactive"].weight == 6 and example.classes["batch"].max_queue_age_seconds == 7200
    a = example.orgs["analytics"]
    assert a.classes == ("batch", "interactive") and a.default_class == "batch"
    assert a.key_digests == (hashlib.sha256(b"sk-analytics-1").hexdigest(),)
    assert a.max_in_flight == 8 and a.requests_per_minute == 600 and a.weight == 1
    assert example.orgs["product"].weight == 1.0 and example.orgs["product"].max_in_flight is None
    assert example.cost.input_weight == 1 and example.cost.output_weight == 2
    r = example.retry
    assert (r.max_attempts, r.budget_per_flow_percent, r.backoff, r.base_seconds, r.max_seconds) == (
        3, 10, "exponential_with_jitter", 0.5, 30)
    assert example.state is None
    assert example.strict_classes == ("system",)


def test_flows_weights_and_shares(example: Policy) -> None:
    assert example.flows() == [("analytics", "batch", "local-gpu"), ("analytics", "interactive", "local-gpu"),
                               ("product", "interactive", "local-gpu"), ("product", "system", "local-gpu")]
    assert example.flow_weight("analytics", "interactive") == 6
    # weighted flows of the pool: analytics/batch 1, analytics/interactive 6, product/interactive 6
    assert example.share(("analytics", "batch", "local-gpu")) == pytest.approx(1 / 13)
    assert example.share(("product", "interactive", "local-gpu")) == pytest.approx(6 / 13)
    assert example.share(("product", "system", "local-gpu")) is None
    assert example.pool_of("llama-3-8b").name == "local-gpu" and example.pool_of("gpt") is None


def test_objects_are_immutable(example: Policy) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        example.classes["batch"].weight = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        example.classes["new"] = example.classes["batch"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        example.retry = None  # type: ignore[misc, assignment]


def test_the_plain_keys_are_not_kept(example: Policy) -> None:
    assert "sk-analytics-1" not in repr(example)


def test_load_from_file(tmp_path) -> None:
    p = tmp_path / "policy.yaml"
    p.write_text(EXAMPLE)
    pol = load_policy(p)
    assert pol.source == str(p) and pol == parse_policy(EXAMPLE)
    with pytest.raises(OSError):
        load_policy(tmp_path / "missing.yaml")


def test_key_sha256_and_defaults() -> None:
    d = base()
    digest = hashlib.sha256(b"secret").hexdigest().upper()
    d["orgs"]["product"] = {"key_sha256": [digest], "classes": ["interactive"]}
    del d["retry"], d["cost"]
    pol = policy_from_mapping(d)
    assert pol.orgs["product"].key_digests == (digest.lower(),)
    assert pol.retry.max_attempts == 3 and pol.cost.output_weight == 2


def test_state_section() -> None:
    d = base()
    d["state"] = {"redis": "redis://127.0.0.1:6379/0", "lease_seconds": 2.5}
    st = policy_from_mapping(d).state
    assert st is not None and st.redis == "redis://127.0.0.1:6379/0" and st.prefix == "sfq:" and st.lease_seconds == 2.5


def test_server_section() -> None:
    d = base()
    assert policy_from_mapping(d).server == ServerSpec()
    pool = next(iter(d["pools"]))
    d["server"] = {"header_timeout_seconds": 2, "max_connections": 100, "max_body_bytes": 1 << 20,
                   "pools": {pool: {"max_body_bytes": 4096}}}
    sv = policy_from_mapping(d).server
    assert (sv.header_timeout_seconds, sv.body_timeout_seconds, sv.max_connections) == (2.0, 30.0, 100)
    assert sv.body_limit(pool) == 4096 and sv.body_limit("other") == 1 << 20
    for bad, path in (({"max_connections": 0}, "server.max_connections"),
                      ({"idle_timeout_seconds": -1}, "server.idle_timeout_seconds"),
                      ({"max_body_bytes": 10}, "server.max_body_bytes"),
                      ({"pools": {"nope": {"max_body_bytes": 4096}}}, "server.pools.nope"),
                      ({"pools": {pool: {"max_bytes": 4096}}}, f"server.pools.{pool}.max_bytes"),
                      ({"timeout": 1}, "server.timeout")):
        d["server"] = bad
        with pytest.raises(PolicyError) as err:
            policy_from_mapping(d)
        assert err.value.path == path
    # the edge's settings are the gateway's own: gateways sharing one queue may differ in them
    d["server"] = {"max_connections": 5}
    assert "max_connections" not in repr(policy_from_mapping(d))


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = d
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return mutate


def _del(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = d
        for p in parents:
            node = node[p]
        del node[last]
    return mutate


SYSTEM = {"strict": True, "max_in_flight": 2, "max_queue_length": 50}

MISTAKES: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    # (kind of mistake, mutation, path, a phrase of the message)
    ("negative number", _set("classes.batch.weight", -1), "classes.batch.weight", "must be a number > 0, got -1"),
    ("zero weight", _set("orgs.analytics.weight", 0), "orgs.analytics.weight", "must be a number > 0, got 0"),
    ("string for a number", _set("classes.batch.weight", "heavy"), "classes.batch.weight", "got 'heavy'"),
    ("bool for a number", _set("orgs.analytics.weight", True), "orgs.analytics.weight", "got True"),
    ("NaN", _set("pools.local-gpu.limits.tokens_per_minute", float("nan")), "pools.local-gpu.limits.tokens_per_minute",
     "must be a number > 0"),
    ("infinity", _set("classes.batch.max_queue_age_seconds", float("inf")), "classes.batch.max_queue_age_seconds",
     "must be a number > 0"),
    ("negative duration", _set("classes.interactive.max_queue_age_seconds", -5),
     "classes.interactive.max_queue_age_seconds", "got -5"),
    ("fraction for an integer", _set("pools.local-gpu.limits.max_in_flight", 2.5),
     "pools.local-gpu.limits.max_in_flight", "must be an integer >= 1, got 2.5"),
    ("zero integer", _set("classes.interactive.max_queue_length", 0), "classes.interactive.max_queue_length",
     "must be an integer >= 1, got 0"),
    ("unknown top-level key", _set("pool", {}), "pool", "unknown key"),
    ("typo in a class", _set("classes.batch.wieght", 2), "classes.batch.wieght", "unknown key"),
    ("typo in a backend", _set("pools.local-gpu.backends.0.max_inflight", 2), "pools.local-gpu.backends[0].max_inflight",
     "unknown key"),
    ("typo in limits", _set("pools.local-gpu.limits.rpm", 2), "pools.local-gpu.limits.rpm", "unknown key"),
    ("typo in an org", _set("orgs.product.max_in_flght", 2), "orgs.product.max_in_flght", "unknown key"),
    ("typo in retry", _set("retry.attempts", 2), "retry.attempts", "unknown key"),
    ("missing section", _del("orgs"), "orgs", "is required (or an org_template"),
    ("missing models", _del("pools.local-gpu.models"), "pools.local-gpu.models", "is required"),
    ("missing backend url", _set("pools.local-gpu.backends.0", {"max_in_flight": 2}), "pools.local-gpu.backends[0].url",
     "is required"),
    ("bad url", _set("pools.local-gpu.backends.0.url", "127.0.0.1:8001"), "pools.local-gpu.backends[0].url",
     "http://"),
    ("no backends", _set("pools.local-gpu.backends", []), "pools.local-gpu.backends", "non-empty list"),
    ("empty models", _set("pools.local-gpu.models", []), "pools.local-gpu.models", "must not be empty"),
    ("a scalar for a list", _set("pools.local-gpu.models", "llama"), "pools.local-gpu.models", "must be a list"),
    ("a scalar for a mapping", _set("classes.batch", 3), "classes.batch", "must be a mapping"),
    ("a list for a mapping", _set("classes", ["batch"]), "classes", "mapping of names"),
    ("empty section", _set("pools", {}), "pools", "at least one"),
    ("missing org classes", _del("orgs.product.classes"), "orgs.product.classes", "is required"),
    ("unknown class for an org", _set("orgs.product.classes", ["interactive", "urgent"]), "orgs.product.classes[1]",
     "unknown class 'urgent'"),
    ("class listed twice", _set("orgs.product.classes", ["system", "system"]), "orgs.product.classes[1]",
     "listed twice"),
    ("a template with keys", _set("org_template", {"keys": ["k"], "classes": ["batch"]}), "org_template.keys",
     "a template has no keys"),
    ("a template without classes", _set("org_template", {"weight": 2}), "org_template.classes", "is required"),
    ("a template with an unknown class", _set("org_template", {"classes": ["urgent"]}), "org_template.classes[0]",
     "unknown class 'urgent'"),
    ("typo in a template", _set("org_template", {"classes": ["batch"], "wieght": 2}), "org_template.wieght",
     "unknown key"),
    ("a template's bad limit", _set("org_template", {"classes": ["batch"], "max_in_flight": 0}),
     "org_template.max_in_flight", "must be an integer >= 1, got 0"),
    ("key shared by two orgs", _set("orgs.product.keys", ["sk-analytics-1"]), "orgs.product.keys[0]",
     "already the key of org 'analytics'"),
    ("bad sha256", _set("orgs.product.key_sha256", ["abc"]), "orgs.product.key_sha256[0]", "64 hexadecimal"),
    ("model in two pools", _set("pools.other", {"models": ["llama-3-8b"], "backends": [{"url": "http://h:1"}]}),
     "pools.other.models[0]", "already served by pool 'local-gpu'"),
    ("backend declared twice", _set("pools.other", {"models": ["x"], "backends": [{"url": "http://127.0.0.1:8001"}]}),
     "pools.other.backends[0]", "already declared"),
    ("strict without max_in_flight", _set("classes.system", {"strict": True, "max_queue_length": 5}),
     "classes.system.max_in_flight", "a strict class needs one"),
    ("strict without a queue limit", _set("classes.system", {"strict": True, "max_in_flight": 2}), "classes.system",
     "max_queue_length or max_queue_age_seconds"),
    ("strict with a weight", _set("classes.system", {**SYSTEM, "weight": 5}), "classes.system.weight",
     "a strict class has no weight"),
    ("strict not a bool", _set("classes.system", {**SYSTEM, "strict": "yes please"}), "classes.system.strict",
     "true or false"),
    ("unknown backoff", _set("retry.backoff", "linear"), "retry.backoff", "exponential_with_jitter"),
    ("max below base", _set("retry.max_seconds", 0.1), "retry.max_seconds", ">= base_seconds"),
    ("percent over 100", _set("retry.budget_per_flow_percent", 150), "retry.budget_per_flow_percent", "<= 100"),
    ("zero attempts", _set("retry.max_attempts", 0), "retry.max_attempts", "integer >= 1"),
    ("both cost weights zero", _set("cost", {"input_weight": 0, "output_weight": 0}), "cost", "cannot both be 0"),
    ("negative cost weight", _set("cost.output_weight", -2), "cost.output_weight", "must be a number >= 0"),
    ("bad redis url", _set("state", {"redis": "127.0.0.1:6379"}), "state.redis", "redis://"),
    ("state without redis", _set("state", {"prefix": "x"}), "state.redis", "is required"),
    ("small_picks zero", _set("classes.interactive.small_picks", 0), "classes.interactive.small_picks", ">= 1"),
]


@pytest.mark.parametrize("kind,mutate,path,phrase", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_mistake_names_its_field(kind: str, mutate: Callable[[dict[str, Any]], None], path: str,
                                      phrase: str) -> None:
    d = base()
    mutate(d)
    text = yaml.safe_dump(d, sort_keys=False)
    with pytest.raises(PolicyError) as info:
        parse_policy(text)
    err = info.value
    assert err.path == path, str(err)
    assert str(err).startswith(f"{path}: "), str(err)
    assert phrase in str(err)
    assert isinstance(err, SFQError) and isinstance(err, ValueError)
    # the same data given as a mapping fails the same way
    with pytest.raises(PolicyError) as again:
        policy_from_mapping(copy.deepcopy(yaml.safe_load(text)))
    assert again.value.path == path


def test_the_exact_message_of_api_md() -> None:
    d = base()
    d["classes"]["batch"]["weight"] = -1
    with pytest.raises(PolicyError, match=r"^classes\.batch\.weight: must be a number > 0, got -1$"):
        policy_from_mapping(d)


def test_repeated_key_is_an_error_not_a_silent_overwrite() -> None:
    text = EXAMPLE.replace("    weight: 1\n    max_in_flight: 8", "    weight: 1\n    weight: 5\n    max_in_flight: 8")
    assert text != EXAMPLE
    with pytest.raises(PolicyError) as info:
        parse_policy(text)
    assert info.value.path == "orgs.analytics.weight" and "appears twice" in str(info.value)


def test_invalid_yaml() -> None:
    with pytest.raises(PolicyError, match="not valid YAML"):
        parse_policy("pools: [unclosed", source="x.yaml")


def test_empty_or_scalar_file() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy("")
    assert info.value.path == "pools"
    with pytest.raises(PolicyError, match="must be a mapping"):
        parse_policy("42")


def test_non_string_key() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(EXAMPLE.replace("  batch:       {weight: 1", "  7:       {weight: 1"))
    assert info.value.path == "classes"


def test_not_text() -> None:
    with pytest.raises(TypeError):
        parse_policy(b"pools: {}")  # type: ignore[arg-type]


# ----------------------------------------------------------------- identity the embedder owns
def test_an_org_without_keys_is_valid() -> None:
    d = base()
    del d["orgs"]["product"]["keys"]
    pol = policy_from_mapping(d)
    assert pol.orgs["product"].key_digests == ()
    assert pol.org("product") is pol.orgs["product"]
    assert ("product", "interactive", "local-gpu") in pol.flows()


def test_the_org_template_gives_unnamed_orgs_their_settings() -> None:
    d = base()
    d["org_template"] = {"classes": ["batch", "interactive"], "weight": 2, "max_in_flight": 3,
                         "requests_per_minute": 120}
    pol = policy_from_mapping(d)
    t = pol.org_template
    assert t is not None and t.key_digests == () and t.classes == ("batch", "interactive")
    acme = pol.org("acme")
    assert acme is not None and acme.name == "acme" and acme.key_digests == ()
    assert (acme.classes, acme.weight, acme.max_in_flight, acme.requests_per_minute) == (
        ("batch", "interactive"), 2.0, 3, 120.0)
    assert pol.org("acme") is acme  # made once
    assert pol.org("analytics") is pol.orgs["analytics"]  # a named org keeps its own entry
    assert pol.made_orgs() == [acme]
    assert pol.org("") is None
    assert pol.allows(("acme", "interactive", "local-gpu")) and not pol.allows(("acme", "system", "local-gpu"))
    assert pol.flow_weight("acme", "interactive") == 12
    # the file's flows only; a template org's share counts itself with them
    assert [f for f in pol.flows() if f[0] == "acme"] == []
    assert pol.share(("acme", "batch", "local-gpu")) == pytest.approx(2 / 15)


def test_without_a_template_an_unnamed_org_is_unknown(example: Policy) -> None:
    assert example.org_template is None and example.org("acme") is None
    assert not example.allows(("acme", "batch", "local-gpu"))


def test_a_file_of_template_orgs_only() -> None:
    d = base()
    del d["orgs"]
    d["org_template"] = {"classes": ["batch"]}
    pol = policy_from_mapping(d)
    assert dict(pol.orgs) == {} and pol.flows() == []
    assert pol.org("anyone") is not None
    d["orgs"] = {}
    assert dict(policy_from_mapping(d).orgs) == {}


def test_the_template_is_part_of_the_policy() -> None:
    d = base()
    d["org_template"] = {"classes": ["batch"]}
    with_template = policy_from_mapping(d)
    with_template.org("acme")  # what was made is not part of the policy's identity
    assert with_template == policy_from_mapping(d)
    assert repr(with_template) == repr(policy_from_mapping(d))
    assert with_template != policy_from_mapping(base())
    plain = dataclasses.replace(with_template, org_template=None)
    assert plain.org("acme") is None


def test_a_large_file_parses_to_the_policy_its_mapping_gives() -> None:
    """A file with many orgs has its orgs made again after the parse (``_org_rows``: memory,
    not meaning): the policy equals the one made from the same mapping, field for field, in
    file order, and orgs with the same class list still share one tuple."""
    lines = ["pools:", "  p: {models: [m], backends: [{url: 'http://127.0.0.1:9'}], prices: {input: 1, output: 2}}",
             "classes: {interactive: {weight: 4}, batch: {weight: 1}}", "orgs:"]
    for i in range(1_500):
        extra = [", weight: 2.5", ", max_in_flight: 3", ", requests_per_minute: 90", ""][i % 4]
        if i % 7 == 1:  # (nested shares and a budget come through too)
            extra += ", budget: {amount: 5, per: day}"
        cls = "[interactive, batch]" if i % 3 else "[batch]"
        if i % 5 == 1:
            lines.append(f"  org-{i}: {{classes: {cls}{extra}, users: equal, teams: {{t1: {{weight: 2, keys: [k-{i}]}}, "
                         f"t2: {{keys: [k2-{i}], max_users: 7}}}}}}")
        else:
            lines.append(f"  org-{i}: {{keys: [k-{i}, k2-{i}], classes: {cls}{extra}}}")
    text = "\n".join(lines) + "\n"
    pol = parse_policy(text)
    assert pol == policy_from_mapping(yaml.safe_load(text), source="<string>")
    assert list(pol.orgs) == [f"org-{i}" for i in range(1_500)]
    o = pol.orgs["org-5"]
    assert (o.classes, o.max_in_flight, o.key_digests[1]) == (
        ("interactive", "batch"), 3, hashlib.sha256(b"k2-5").hexdigest())
    assert pol.orgs["org-1"].classes is pol.orgs["org-2"].classes
    assert pol.org("org-5") is o
    n = pol.orgs["org-36"]
    assert n.users and n.teams["t1"].weight == 2 and n.teams["t2"].max_users == 7 and n.budget is not None
