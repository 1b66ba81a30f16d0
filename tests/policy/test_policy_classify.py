"""Trusted classification: key -> org, stated class checked (refused, never upgraded), model -> pool."""

from __future__ import annotations

import hashlib

import pytest
from policy_helpers import EXAMPLE

from sfq.errors import Refused
from sfq.policy import Classifier, Flow, Policy, parse_policy


def test_key_to_org_and_default_class(example: Policy) -> None:
    c = Classifier(example)
    assert c.classify("sk-analytics-1", None, "llama-3-8b") == Flow("analytics", "batch", "local-gpu")
    assert c.classify("sk-product-1", "", "llama-3-8b") == Flow("product", "interactive", "local-gpu")
    assert c.classify("sk-product-1", "system", "llama-3-8b") == Flow("product", "system", "local-gpu")


def test_weight_is_org_times_class() -> None:
    pol = parse_policy(EXAMPLE.replace("    weight: 1\n    max_in_flight: 8", "    weight: 3\n    max_in_flight: 8"))
    c = Classifier(pol)
    assert c.weight(Flow("analytics", "interactive", "local-gpu")) == 18
    assert c.weight(Flow("analytics", "batch", "local-gpu")) == 3


@pytest.mark.parametrize("key", [None, "", "sk-analytics-2", "sk-analytics-1 ", "SK-ANALYTICS-1"])
def test_unknown_keys_are_refused(example: Policy, key: str | None) -> None:
    with pytest.raises(Refused) as info:
        Classifier(example).classify(key, None, "llama-3-8b")
    assert info.value.reason == "unauthenticated"


def test_key_sha256_matches_the_key() -> None:
    digest = hashlib.sha256(b"s3cret").hexdigest()
    pol = parse_policy(EXAMPLE.replace('keys: ["sk-product-1"]', f'key_sha256: ["{digest}"]'))
    c = Classifier(pol)
    assert c.org_of("s3cret").name == "product"
    with pytest.raises(Refused):
        c.org_of(digest)  # the digest itself is not a key


def test_a_class_the_org_may_not_use_is_refused_not_upgraded(example: Policy) -> None:
    c = Classifier(example)
    with pytest.raises(Refused) as info:
        c.classify("sk-analytics-1", "system", "llama-3-8b")  # analytics may use batch, interactive
    assert info.value.reason == "class_not_allowed" and "allowed: batch, interactive" in str(info.value)
    with pytest.raises(Refused) as info:
        c.classify("sk-product-1", "batch", "llama-3-8b")  # exists, but not product's: not downgraded either
    assert info.value.reason == "class_not_allowed"
    with pytest.raises(Refused, match="no such class") as info:
        c.classify("sk-product-1", "urgent", "llama-3-8b")
    assert info.value.reason == "class_not_allowed"


@pytest.mark.parametrize("model", ["gpt-4", None, 3, ""])
def test_unknown_model(example: Policy, model: object) -> None:
    with pytest.raises(Refused) as info:
        Classifier(example).classify("sk-product-1", None, model)
    assert info.value.reason == "unknown_model"


def test_needs_a_policy() -> None:
    with pytest.raises(TypeError):
        Classifier({"pools": {}})  # type: ignore[arg-type]


# ----------------------------------------------------------------- the embedder's own flows
def _embedder_policy(template: bool) -> Policy:
    text = EXAMPLE.replace('    keys: ["sk-product-1"]\n', "")
    if template:
        text += "org_template: {classes: [batch], weight: 2}\n"
    return parse_policy(text)


def test_an_embedder_names_the_org_of_a_keyless_org() -> None:
    c = Classifier(_embedder_policy(template=False))
    assert c.check(Flow("product", "interactive", "local-gpu")) == Flow("product", "interactive", "local-gpu")
    assert c.check(Flow("product", None, "local-gpu"), "llama-3-8b") == Flow(  # type: ignore[arg-type]
        "product", "interactive", "local-gpu")
    with pytest.raises(Refused) as info:  # no key reaches a keyless org
        c.classify("sk-product-1", None, "llama-3-8b")
    assert info.value.reason == "unauthenticated"


def test_an_org_the_file_does_not_name_is_refused_without_a_template() -> None:
    c = Classifier(_embedder_policy(template=False))
    with pytest.raises(Refused, match="no org 'acme'") as info:
        c.check(Flow("acme", "batch", "local-gpu"))
    exc = info.value
    assert exc.reason == "unknown_org" and exc.http_status == 403
    assert "Bearer" not in str(exc) and "analytics" not in str(exc)  # nothing about keys, no other tenant named


def test_the_template_makes_the_org() -> None:
    c = Classifier(_embedder_policy(template=True))
    assert c.check(Flow("acme", "", "local-gpu")) == Flow("acme", "batch", "local-gpu")
    assert c.weight(Flow("acme", "batch", "local-gpu")) == 2
    with pytest.raises(Refused) as info:
        c.check(Flow("acme", "interactive", "local-gpu"))
    assert info.value.reason == "class_not_allowed" and info.value.http_status == 403


@pytest.mark.parametrize("flow, model, match", [
    (Flow("product", "interactive", "cpu"), None, "no pool 'cpu'"),
    (Flow("product", "interactive", "local-gpu"), "gpt-4", "no pool serves model 'gpt-4'"),
])
def test_an_embedders_flow_needs_a_real_pool(flow: Flow, model: str | None, match: str) -> None:
    c = Classifier(_embedder_policy(template=True))
    with pytest.raises(Refused, match=match) as info:
        c.check(flow, model)
    assert info.value.reason == "unknown_model" and info.value.http_status == 404


def test_a_flow_is_a_triple() -> None:
    with pytest.raises(TypeError, match="sfq.Flow"):
        Classifier(_embedder_policy(template=True)).check(("acme", "batch"))  # type: ignore[arg-type]
