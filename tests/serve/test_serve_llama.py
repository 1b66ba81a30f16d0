"""Integration: ``sfq serve`` in front of a real llama.cpp ``llama-server`` (the tiny synthetic
model the dispatch tests build), through the official ``openai`` client: a reply, a stream,
and two teams' requests at once."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import GatewayProcess, make_client

DISPATCH = Path(__file__).resolve().parent.parent / "dispatch"


def _load(name: str, path: Path) -> Any:
    """A helper module of tests/dispatch, loaded under its own name (no ``conftest`` clash)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


tinymodel = _load("tinymodel", DISPATCH / "tinymodel.py")
dispatch_fixtures = _load("sfq_tests_dispatch_helpers", DISPATCH / "dispatch_helpers.py")

pytestmark = [pytest.mark.integration, dispatch_fixtures.needs_llama]

M = dispatch_fixtures.LLAMA_MODEL_NAME


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    d = tmp_path_factory.mktemp("llama")
    model = tinymodel.write_tiny_llama(d / "tiny-llama.gguf")
    server = dispatch_fixtures.start_llama(model, d / "llama-server.log")
    try:
        yield server
    finally:
        server.stop()


def test_serve_in_front_of_llama_server(llama: Any, tmp_path: Path):
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(f"""\
pools:
  local:
    models: [{M}]
    backends: [{{url: "{llama.url}", max_in_flight: {dispatch_fixtures.LLAMA_SLOTS}}}]
classes:
  interactive: {{weight: 4}}
  batch: {{weight: 1}}
orgs:
  product: {{keys: [sk-product], classes: [interactive]}}
  analytics: {{keys: [sk-analytics], classes: [batch]}}
""")
    gw = GatewayProcess(cfg)
    try:
        product, analytics = make_client(gw, "sk-product"), make_client(gw, "sk-analytics")
        r = product.chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
        assert r.choices[0].message.content.strip() == tinymodel.OUTPUT_CHAR * 8
        assert r.usage is not None and r.usage.completion_tokens == 8
        chunks = list(product.completions.create(model=M, prompt="hello", max_tokens=6, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices).strip() == tinymodel.OUTPUT_CHAR * 6
        with ThreadPoolExecutor(6) as ex:
            futs = [ex.submit((analytics if i % 2 else product).completions.create, model=M, prompt="x",
                              max_tokens=12) for i in range(6)]
            assert all(f.result().usage.completion_tokens == 12 for f in futs)
        assert gw.metric("sfq_requests_total", org="analytics", outcome="completed") == 3
        assert gw.metric("sfq_requests_total", org="product", outcome="completed") == 5
        assert gw.stop() == 0
    finally:
        gw.stop()
