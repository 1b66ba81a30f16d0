"""CostEstimator: the formula, prompt forms, calibration, persistence, bad input."""

from __future__ import annotations

import json
import math

import pytest

from sfq.cost import CostEstimator, prompt_of
from sfq.errors import BadRequest


def test_formula_with_prior_and_exact_tokenizer():
    est = CostEstimator(input_weight=1.0, output_weight=2.0, prior_ratio=0.5, tokenizer=lambda t: t.split())
    e = est.estimate({"model": "m", "prompt": "one two three", "max_tokens": 100})
    assert e.prompt_exact and e.prompt_tokens == 3
    assert e.ratio == 0.5 and e.expected_output == 50
    assert e.cost == 1.0 * 3 + 2.0 * 50


def test_n_multiplies_the_output_cap_and_default_max_tokens_applies():
    est = CostEstimator(input_weight=0.0, output_weight=1.0, default_max_tokens=64)
    assert est.estimate({"prompt": "x", "max_tokens": 10, "n": 3}).cost == 30
    assert est.estimate({"prompt": "x"}).cost == 64
    assert est.estimate({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7}).cost == 7


def test_prompt_forms():
    assert prompt_of({"prompt": "abc"}) == ("abc", 0)
    assert prompt_of({"prompt": ["ab", "cd"]}) == ("ab\ncd", 0)
    assert prompt_of({"prompt": [1, 2, 3]}) == ("", 3)
    assert prompt_of({"prompt": [[1, 2], [3]]}) == ("", 3)
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]},
            {"role": "assistant", "content": None}]
    assert prompt_of({"messages": msgs}) == ("be brief\nhi", 0)
    # token ids are exact even without a tokenizer
    e = CostEstimator().estimate({"prompt": [5] * 40, "max_tokens": 1})
    assert e.prompt_exact and e.prompt_tokens == 40


def test_chars_per_token_prior_then_calibrated_from_usage():
    est = CostEstimator(input_weight=1.0, output_weight=0.0, chars_per_token=4.0)
    body = {"model": "m", "prompt": "x" * 400, "max_tokens": 8}
    e = est.estimate(body)
    assert not e.prompt_exact and e.prompt_tokens == 100 and e.prompt_chars == 400
    assert est.observe(e, {"prompt_tokens": 200, "completion_tokens": 8})
    # the prior counts as 64 characters at 4 per token: (400 + 64) / (200 + 16)
    assert est.chars_per_token_of("m") == pytest.approx(464 / 216)
    for _ in range(99):
        est.observe(e, {"prompt_tokens": 200, "completion_tokens": 8})
    assert est.chars_per_token_of("m") == pytest.approx(40064 / 20016)  # the evidence takes over
    assert est.estimate(body).prompt_tokens == pytest.approx(400 * 20016 / 40064)
    assert est.chars_per_token_of("other") == 4.0  # per model
    # exact prompts never feed the chars-per-token calibration
    exact = CostEstimator(tokenizer=len)
    exact.observe(exact.estimate(body), {"prompt_tokens": 1, "completion_tokens": 1})
    assert exact.chars_per_token_of("m") == exact.chars_per_token


def test_ratio_per_model_then_per_flow_after_enough_samples():
    est = CostEstimator(input_weight=0.0, output_weight=1.0, prior_ratio=1.0, min_model_samples=2,
                        min_flow_samples=3)
    body = {"model": "m", "prompt": "p", "max_tokens": 100}
    assert est.ratio("m") == 1.0
    e = est.estimate(body, "a")
    est.observe(e, {"completion_tokens": 10}, "a")
    assert est.ratio("m") == 1.0  # one sample < min_model_samples
    est.observe(e, {"completion_tokens": 30}, "b")
    assert est.ratio("m") == pytest.approx(0.2)  # (10 + 30) / 200: the ratio of totals
    assert est.ratio("m", "a") == pytest.approx(0.2)  # flow a has 1 < 3 samples: the model's ratio
    est.observe(e, {"completion_tokens": 90}, "a")
    est.observe(e, {"completion_tokens": 80}, "a")
    assert est.ratio("m", "a") == pytest.approx(180 / 300)
    assert est.estimate(body, "a").cost == pytest.approx(60)
    assert est.ratio("m", "b") == pytest.approx(210 / 400)  # b still uses the model's ratio
    assert est.ratio("other") == 1.0


def test_observe_ignores_missing_or_bad_usage():
    est = CostEstimator()
    e = est.estimate({"prompt": "p", "max_tokens": 4})
    for bad in (None, {}, {"completion_tokens": -1}, {"completion_tokens": 2.5}, {"completion_tokens": True}, "x"):
        assert not est.observe(e, bad)  # type: ignore[arg-type]
    assert est.ignored == 6 and est.observed == 0
    assert est.ratio("") == est.prior_ratio


def test_min_cost_and_overflow():
    est = CostEstimator(input_weight=0.0, output_weight=1.0, prior_ratio=0.001, min_cost=0.5)
    assert est.estimate({"prompt": "", "max_tokens": 1}).cost == 0.5
    big = CostEstimator(input_weight=1e6)
    with pytest.raises(BadRequest, match="exceeds the largest cost") as info:  # the body's fault: a 400
        big.estimate({"prompt": [1] * 2000, "max_tokens": 1})
    assert info.value.http_status == 400
    with pytest.raises(OverflowError, match="exceeds the largest cost"):  # the caller's own numbers
        big.estimate_tokens(2000, 1)


@pytest.mark.parametrize(
    "body, match",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "'n'"),
        ({"prompt": "x", "model": 3}, "'model'"),
        ({"prompt": 3.5}, "'prompt'"),
        ({"prompt": [1, "a"]}, "'prompt'"),
        ({"messages": "hi"}, "'messages'"),
        ({"messages": ["hi"]}, "message"),
        ({"messages": [{"content": 5}]}, "content"),
    ],
)
def test_bad_bodies_name_the_field(body, match):
    with pytest.raises(BadRequest, match=match) as info:  # a ValueError too
        CostEstimator().estimate(body)
    assert isinstance(info.value, ValueError) and info.value.http_status == 400
    assert info.value.to_openai()["error"]["type"] == "invalid_request_error"
    assert info.value.param in body  # the field at fault (OpenAI's "param")


def test_a_body_without_a_prompt_is_a_bad_request():
    with pytest.raises(BadRequest, match="neither 'prompt'") as info:
        CostEstimator().estimate({"max_tokens": 3})
    assert info.value.param is None and info.value.reason == "bad_request"


def test_bad_configuration():
    with pytest.raises(ValueError, match="both 0"):
        CostEstimator(0, 0)
    with pytest.raises(ValueError, match="prior_ratio"):
        CostEstimator(prior_ratio=0)
    with pytest.raises(ValueError, match="chars_per_token"):
        CostEstimator(chars_per_token=math.inf)
    with pytest.raises(TypeError, match="output_weight"):
        CostEstimator(output_weight="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_flow_samples"):
        CostEstimator(min_flow_samples=0)
    with pytest.raises(TypeError, match="tokenizer"):
        CostEstimator(tokenizer=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mapping"):
        CostEstimator().estimate(["prompt"])  # type: ignore[arg-type]


def _trained() -> CostEstimator:
    est = CostEstimator(min_flow_samples=1)
    for flow, comp in (("a", 5), (("org", 7), 9), (3, 2)):
        e = est.estimate({"model": "m", "prompt": "abcdefgh", "max_tokens": 10}, flow)
        est.observe(e, {"prompt_tokens": 4, "completion_tokens": comp}, flow)
    return est


def test_save_and_load_round_trip(tmp_path):
    est = _trained()
    path = tmp_path / "cal.json"
    est.save(path)
    json.loads(path.read_text())  # plain JSON
    fresh = CostEstimator(min_flow_samples=1)
    fresh.load(path)
    assert fresh.state() == est.state()
    for flow in ("a", ("org", 7), 3, "unseen"):
        assert fresh.ratio("m", flow) == est.ratio("m", flow)
    assert fresh.chars_per_token_of("m") == est.chars_per_token_of("m") == pytest.approx((24 + 64) / (12 + 16))
    assert fresh.ratio("m", ("org", 7)) == 0.9  # the tuple flow id survived JSON


def test_bad_state_leaves_the_estimator_unchanged(tmp_path):
    est = _trained()
    before = est.state()
    for bad in ({"version": 99}, {"version": 1, "models": {"m": {"output": -1}}},
                {"version": 1, "models": {}, "flows": [{"model": "m", "flow": {"x": 1}, "output": 1}]}):
        with pytest.raises(ValueError):
            est.restore(bad)
        assert est.state() == before
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        est.load(p)
    assert est.state() == before


def test_unserializable_flow_id_is_named():
    est = CostEstimator(min_flow_samples=1)
    flow = frozenset({1})
    est.observe(est.estimate({"prompt": "p", "max_tokens": 2}, flow), {"completion_tokens": 1}, flow)
    with pytest.raises(TypeError, match="frozenset"):
        est.state()


def test_reestimate_is_estimate_with_the_calibration_of_now():
    """The dispatcher re-estimates at dispatch without reading the body again: the same result
    as ``estimate`` on the body, before and after the calibration moved."""
    bodies = [
        {"model": "m", "prompt": "hello there, how are you", "max_tokens": 40},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "more"}]},
        {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "n": 3},
        {"model": "m", "prompt": ["a b c", "d e"], "max_tokens": 16},
        {"model": "other", "prompt": "x" * 400, "max_completion_tokens": 100},
    ]
    for tok in (None, lambda text: text.split()):
        e = CostEstimator(1.0, 2.0, min_flow_samples=1, tokenizer=tok)
        olds = [(e.estimate(b, "f"), b) for b in bodies]
        for old, b in olds:
            again = e.reestimate(old, "f")
            assert (again.cost, again.prompt_tokens, again.ratio) == (old.cost, old.prompt_tokens, old.ratio)
        e.observe(olds[0][0], {"prompt_tokens": 9, "completion_tokens": 10}, "f")
        e.observe(olds[4][0], {"prompt_tokens": 50, "completion_tokens": 7}, "g")
        for old, b in olds:
            fresh, again = e.estimate(b, "f"), e.reestimate(old, "f")
            assert again.cost == fresh.cost and again.prompt_tokens == fresh.prompt_tokens, b
            assert again.ratio == fresh.ratio and again.max_tokens == fresh.max_tokens, b
        assert e.reestimate(olds[0][0], "f").cost != olds[0][0].cost  # the calibration did move it


def test_the_epoch_moves_with_the_calibration():
    e = CostEstimator()
    est = e.estimate({"model": "m", "prompt": "hi", "max_tokens": 4})
    start = e.epoch
    assert not e.observe(est, None) and e.epoch == start  # ignored: nothing changed
    assert e.observe(est, {"prompt_tokens": 1, "completion_tokens": 2}) and e.epoch == start + 1
    e.restore(e.state())
    assert e.epoch == start + 2


def test_the_token_count_entry_prices_like_a_body():
    """``estimate_tokens`` (the simulator's entry) gives what ``estimate`` gives for a body
    whose prompt has that many tokens, and checks its arguments."""
    import pytest as _pytest

    from sfq.cost import CostEstimator

    est = CostEstimator(input_weight=1.0, output_weight=2.0, prior_ratio=0.5, tokenizer=len)
    a = est.estimate({"model": "m", "prompt": "x" * 37, "max_tokens": 64}, "f")
    b = est.estimate_tokens(37, 64, model="m", flow="f")
    assert (a.cost, a.prompt_tokens, a.max_tokens, a.ratio) == (b.cost, b.prompt_tokens, b.max_tokens, b.ratio)
    for bad in (-1, 1.5, True, "3"):
        with _pytest.raises(ValueError, match="prompt_tokens must be an integer"):
            est.estimate_tokens(bad, 64)  # type: ignore[arg-type]
    with _pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        est.estimate_tokens(1, 0)
