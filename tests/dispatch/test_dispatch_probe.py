"""SaturationProbe: reading llama.cpp, vLLM and SGLang metrics texts."""

from __future__ import annotations

import pytest

from sfq.backends import SaturationProbe

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred {deferred}
"""

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 12.0
vllm:num_requests_running{{engine="1",model_name="m"}} 10.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
vllm:num_requests_waiting{{engine="1",model_name="m"}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
vllm:kv_cache_usage_perc{{engine="1",model_name="m"}} 0.10
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.97
"""


def test_llamacpp():
    p = SaturationProbe()
    r = p.read(LLAMACPP.format(deferred=0))
    assert (r.waiting, r.running, r.kv_usage, r.saturated, r.reason) == (0, 2, None, False, None)
    r = p.read(LLAMACPP.format(deferred=1))
    assert r.saturated and "1 requests waiting" in r.reason
    assert not SaturationProbe(max_waiting=1).read(LLAMACPP.format(deferred=1)).saturated


def test_vllm_sums_waiting_and_takes_the_worst_kv_usage():
    p = SaturationProbe(max_kv_usage=0.9)
    r = p.read(VLLM.format(waiting=0.0, kv=0.5))
    assert (r.waiting, r.running, r.kv_usage, r.saturated) == (0.0, 22.0, 0.5, False)
    r = p.read(VLLM.format(waiting=0.0, kv=0.93))
    assert r.saturated and "KV-cache usage 0.930" in r.reason
    r = p.read(VLLM.format(waiting=4.0, kv=0.2))
    assert r.saturated and r.waiting == 4.0
    old = VLLM.format(waiting=0.0, kv=0.95).replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert p.read(old).saturated  # older vLLM name


def test_sglang():
    r = SaturationProbe().read(SGLANG)
    assert (r.waiting, r.running, r.kv_usage, r.saturated) == (0.0, 7.0, 0.97, True)


def test_unknown_server_is_never_saturated_and_custom_names_work():
    text = "# TYPE my_queue gauge\nmy_queue 5\n"
    assert SaturationProbe().read(text) == (None, None, None, False, None)
    assert SaturationProbe(waiting_metrics=["my_queue"]).read(text).saturated


def test_bad_text_and_bad_configuration():
    with pytest.raises(ValueError):
        SaturationProbe().read("this is { not prometheus")
    for kw in ({"interval": 0}, {"max_waiting": -1}, {"max_kv_usage": 0}, {"interval": float("nan")},
               {"max_waiting": True}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SaturationProbe(**kw)
