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
        order: list[tuple[str, int]] = []  # (org, request id) in start order
        poll = pd.engine.poll

        def recording_poll():
            started = poll()
            order.extend((r.flow.org, r.id) for r in started)
            return started

        pd.engine.poll = recording_poll  # type: ignore[method-assign]
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
        b_ids: list[tuple[int, int]] = []  # (id, number of starts seen when it was submitted)
        b = []
        backlog = []
        for _ in range(3):
            await until(lambda: q.waiting(fa_flow) > 0 and q.in_flight == helpers.LLAMA_SLOTS, "A's backlog")
            backlog.append(q.waiting(fa_flow))
            seen = len(order)
            b.append(asyncio.create_task(pd.submit("kb", {"model": model, "prompt": "hi", "max_tokens": 4})))
            await asyncio.sleep(0)  # admitted (its request id is the newest)
            rid = max(pd.engine.live)
            b_ids.append((rid, seen))
            await until(lambda: any(x == rid for _, x in order), "B's start")
        replies = await asyncio.gather(*a, *b)
        assert all(n > 0 for n in backlog), backlog  # each B arrived while A's backlog waited
        assert [r["usage"]["completion_tokens"] for r in replies] == [96] * 10 + [4] * 3
        for rid, seen in b_ids:
            at = next(i for i, (_, x) in enumerate(order) if x == rid)
            a_before = [o for o, _ in order[seen:at] if o == "team-a"]
            assert len(a_before) <= 1, (order, rid, seen)  # at most one start raced its admission
        st = pd.stats()["flows"]
        fa, fb = st["team-a/batch/gpu"], st["team-b/interactive/gpu"]
        assert fa["completed"] == 10 and fb["completed"] == 3
        # the cost served is measured from usage: prompt + 2 x completion tokens
        assert fa["served_cost"] == pytest.approx(sum(r["usage"]["prompt_tokens"] + 2 * r["usage"]["completion_tokens"]
                                                      for r in replies[:10]))
        assert pd.engine.queues["gpu"].in_flight == 0 and not pd.engine.live
        assert Flow("team-b", "interactive", "gpu") not in pd.engine.queues["gpu"].flows  # forgotten once empty
