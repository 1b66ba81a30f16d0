"""The ``sfq serve`` process freezes its start-up objects out of the garbage collector and raises
the youngest generation's threshold once it listens; an embedder awaiting ``serve()`` keeps its
own settings. Each case runs in a fresh interpreter (freezing is process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from serve_helpers import UPSTREAM_KEY, Upstream, policy_yaml

SCRIPT = """
import asyncio, gc, json, sys
from sfq.serve import main

async def run(process):
    stop = asyncio.Event()
    if process:
        task = asyncio.ensure_future(main._serve_process(sys.argv[1], port=0, grace=0.1, stop=stop))
        for _ in range(1000):  # until it listens and has tuned the collector (10 s at most)
            if gc.get_freeze_count() or task.done():
                break
            await asyncio.sleep(0.01)
    else:
        ready = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(main.serve(sys.argv[1], port=0, grace=0.1, ready=ready, stop=stop))
        await asyncio.wait_for(ready, 10)
        await asyncio.sleep(0.1)
    out = {"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()[0], "wanted": main.GC_THRESHOLD}
    stop.set()
    await asyncio.wait_for(task, 10)
    print(json.dumps(out))

asyncio.run(run(sys.argv[2] == "process"))
"""


def _gc_state(tmp_path: Path, how: str, upstream: Upstream, refused_url: str) -> dict[str, int]:
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(upstream.url, refused_url))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(cfg), how], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SFQ_TEST_UPSTREAM_KEY": UPSTREAM_KEY})
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_process_freezes_start_up_and_raises_the_threshold(tmp_path: Path, upstream: Upstream,
                                                               refused_url: str) -> None:
    s = _gc_state(tmp_path, "process", upstream, refused_url)
    assert s["frozen"] > 1000 and s["threshold"] == s["wanted"] > 700


def test_an_embedder_keeps_its_own_collector_settings(tmp_path: Path, upstream: Upstream, refused_url: str) -> None:
    s = _gc_state(tmp_path, "embedded", upstream, refused_url)
    assert s["frozen"] == 0 and s["threshold"] == 700


RELOAD_SCRIPT = """
import asyncio, gc, json, os, signal, sys, weakref
from sfq.serve import app, main

made = []
init = app.Gateway.__init__
def spy(self, *a, **k):
    init(self, *a, **k)
    made.append(self)
app.Gateway.__init__ = spy

async def run():
    stop = asyncio.Event()
    task = asyncio.ensure_future(main._serve_process(sys.argv[1], port=0, grace=0.1, stop=stop))
    for _ in range(1000):  # until it listens and has frozen its start-up objects (10 s at most)
        if gc.get_freeze_count() or task.done():
            break
        await asyncio.sleep(0.01)
    gw = made[0]
    first = weakref.ref(gw.policy)
    os.kill(os.getpid(), signal.SIGHUP)
    for _ in range(1000):
        if gw.policy is not first():
            break
        await asyncio.sleep(0.01)
    out = {"reloaded": gw.policy is not first(), "first_alive": first() is not None,
           "frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()[0], "wanted": main.GC_THRESHOLD}
    stop.set()
    await asyncio.wait_for(task, 10)
    print(json.dumps(out))

asyncio.run(run())
"""


def test_a_reload_frees_the_policy_it_replaced(tmp_path: Path, upstream: Upstream, refused_url: str) -> None:
    """The start-up policy was frozen with the rest; after a SIGHUP reload it is freed (its
    reference cycles collected), and the survivors are frozen again."""
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(policy_yaml(upstream.url, refused_url))
    out = subprocess.run([sys.executable, "-c", RELOAD_SCRIPT, str(cfg)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "SFQ_TEST_UPSTREAM_KEY": UPSTREAM_KEY})
    assert out.returncode == 0, out.stderr[-2000:]
    s = json.loads(out.stdout.strip().splitlines()[-1])
    assert s["reloaded"] and not s["first_alive"], s
    assert s["frozen"] > 1000 and s["threshold"] == s["wanted"], s
