"""Integration: one end-to-end overload run through PolicyDispatcher in front of a real
llama.cpp ``llama-server`` on loopback (the tiny synthetic model of tests/dispatch).

Team A dumps long batch requests, team B sends short interactive ones while A's backlog
waits. The check is on order, not on time: once a B request waits, no A request starts before
it (B's flow has the smaller meter), and every request ends completed with its usage counted.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from sfq.dispatch import PolicyDispatcher
from sfq.policy import Flow, parse_policy

HERE = Path(__file__).resolve().parent
_DISPATCH = HERE.parent / "dispatch"


def _load(name: str, path: Path):  # the dispatch tests' llama helpers, without their conftest's name
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


sys.path.insert(0, str(_DISPATCH))  # dispatch_helpers imports tinymodel
helpers = _load("sfq_dispatch_test_helpers", _DISPATCH / "dispatch_helpers.py")
tinymodel = _load("tinymodel", _DISPATCH / "tinymodel.py")

pytestmark = [pytest.mark.integration, helpers.needs_llama]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    model = tinymodel.write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama.gguf")
    server = helpers.start_llama(model, tmp_path_factory.mktemp("llama") / "llama-server.log")
    try:
        yield server
    finally:
        server.stop()


async def test_overload_through_the_policy(llama) -> None:
    model = helpers.LLAMA_MODEL_NAME
    pol = parse_policy(f"""
pools:
  gpu:
    models: [{model}]
    backends: [{{url: "{llama.url}", max_in_flight: {helpers.LLAMA_SLOTS}}}]
    limits: {{tokens_per_minute: 1000000}}
classes:
  interactive: {{weight: 6, max_queue_age_seconds: 120}}
  batch: {{weight: 1}}
orgs:
  team-a: {{keys: [ka], classes: [batch]}}
  team-b: {{keys: [kb], classes: [interactive]}}
cost: {{input_weight: 1, output_weight: 2}}
""")
    async with PolicyDispatcher(pol) as pd:
        # the org of every start, in order, as the engine counts them in its metrics (a start
        # from a poll, or one at admission when nothing waits); the engine itself may be
        # compiled, whose methods cannot be replaced
        order: list[str] = []
        metrics = pd.engine.metrics

        def recording(count):
            def record(key, *args):
                order.append(key[0])
                return count(key, *args)
            return record

        metrics.started = recording(metrics.started)  # type: ignore[method-assign]
        metrics.began = recording(metrics.began)  # type: ignore[method-assign]
        q = pd.engine.queues["gpu"]
        fa_flow = Flow("team-a", "batch", "gpu")

        async def until(cond, what: str) -> None:  # a bounded wait, not a timing check
            for _ in range(3000):
                if cond():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"timed out waiting for {what}")

        a = [asyncio.create_task(pd.submit("ka", {"model": model, "prompt": "long job", "max_tokens": 96}))
             for _ in range(10)]
        b_seen: list[int] = []  # the number of starts seen when each B was submitted
        b = []
        backlog = []
        for _ in range(3):
            await until(lambda: q.waiting(fa_flow) > 0 and q.in_flight == helpers.LLAMA_SLOTS, "A's backlog")
            backlog.append(q.waiting(fa_flow))
            seen = len(order)
            b.append(asyncio.create_task(pd.submit("kb", {"model": model, "prompt": "hi", "max_tokens": 4})))
            b_seen.append(seen)
            # (B's requests go one at a time: the first team-b start after `seen` is this one's)
            await until(lambda: "team-b" in order[seen:], "B's start")
        replies = await asyncio.gather(*a, *b)
        assert all(n > 0 for n in backlog), backlog  # each B arrived while A's backlog waited
        assert [r["usage"]["completion_tokens"] for r in replies] == [96] * 10 + [4] * 3
        assert order.count("team-a") == 10 and order.count("team-b") == 3
        for seen in b_seen:
            at = order.index("team-b", seen)
            a_before = [o for o in order[seen:at] if o == "team-a"]
            assert len(a_before) <= 1, (order, seen)  # at most one start raced its admission
        st = pd.stats()["flows"]
        fa, fb = st["team-a/batch/gpu"], st["team-b/interactive/gpu"]
        assert fa["completed"] == 10 and fb["completed"] == 3
        # the cost served is measured from usage: prompt + 2 x completion tokens
        assert fa["served_cost"] == pytest.approx(sum(r["usage"]["prompt_tokens"] + 2 * r["usage"]["completion_tokens"]
                                                      for r in replies[:10]))
        assert pd.engine.queues["gpu"].in_flight == 0 and not pd.engine.live
        assert Flow("team-b", "interactive", "gpu") not in pd.engine.queues["gpu"].flows  # forgotten once empty
