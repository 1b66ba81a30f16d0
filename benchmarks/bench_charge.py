"""The dispatcher's charge modes on one loopback workload: delivered-token drift and shares.

Not a test: a measurement, bounded (``--seconds`` per mode, 15 by default, so about a minute
for the three). Run: ``python benchmarks/bench_charge.py [--seconds S] [--json PATH]``
(``test_bench_charge_smoke`` runs half a second of each mode in CI's benchmark smoke run).

The workload
------------
* a loopback OpenAI-shaped server (aiohttp, on its own event loop in another thread) that
  streams one token per SSE event, 4 events per 1 ms, so a request holds its slot for a
  time proportional to its output, as on a real engine;
* one ``sfq.Dispatcher`` with one backend of ``max_in_flight=2`` (the fleet's capacity);
* three flows, two shallow closed-loop clients each (a client sends its next request when the
  last one ends: at most two requests per flow waiting or running), same prompt (200
  characters), costs mis-estimated by the calibration: ``long`` asks ``max_tokens=128`` and
  gets 90-100% of it, ``short`` asks 128 and gets 10-30%, ``exact`` asks 32 and gets 32.
  The estimator calibrates per model only (``min_flow_samples`` out of reach: a proxy keyed
  by many API keys sees few samples of each), so its ratio is the flows' mix and ``long`` is
  under-estimated, ``short`` over-estimated, for as long as the run lasts.

What is measured (on the server: what it delivered to each flow, in tokens, ``prompt +
output``; all three flows are backlogged from start to end):

* ``max drift``: ``max_t (max_f W_f(0, t) - min_f W_f(0, t))`` over the run, sampled at every
  token the server writes (the metric of docs/simulator.md §4, on delivered tokens);
* ``final gap``: the same at the end; ``shares``: each flow's part of the delivered tokens;
* ``requests``: completed per flow; ``charged``: what the dispatcher charged each flow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

import sfq

FLOWS = {  # flow -> (max_tokens, lowest and highest share of it generated)
    "long": (128, 0.9, 1.0),
    "short": (128, 0.1, 0.3),
    "exact": (32, 1.0, 1.0),
}
PROMPT_CHARS = 200
CLIENTS_PER_FLOW = 2
SLOTS = 2


class Upstream:
    """The loopback server: counts what it delivers per flow (the prompt names the flow)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.delivered = {f: 0 for f in FLOWS}
        self.max_drift = 0
        self.url = ""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-upstream", daemon=True)
        self._runner: web.AppRunner | None = None

    def _deliver(self, flow: str, n: int) -> None:
        d = self.delivered
        d[flow] += n
        gap = max(d.values()) - min(d.values())
        if gap > self.max_drift:
            self.max_drift = gap

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        flow = str(body["prompt"]).split(":", 1)[0]
        cap, lo, hi = FLOWS[flow]
        n = max(1, round(cap * self.rng.uniform(lo, hi)))
        prompt_tokens = PROMPT_CHARS // 4
        self._deliver(flow, prompt_tokens)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
        for i in range(n):
            await resp.write(event)
            self._deliver(flow, 1)
            if i % 4 == 3:
                await asyncio.sleep(0.001)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Upstream:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def run_mode(mode: str, seconds: float, seed: int) -> dict[str, Any]:
    with Upstream(seed) as up:
        est = sfq.CostEstimator(1.0, 1.0, min_flow_samples=10**9)
        backend = sfq.OpenAIBackend(up.url, name="up", max_in_flight=SLOTS)
        done = {f: 0 for f in FLOWS}
        stop = asyncio.Event()
        async with sfq.Dispatcher([backend], estimator=est, charge=mode) as d:
            async def client(flow: str, k: int) -> None:
                cap = FLOWS[flow][0]
                prompt = f"{flow}:{k}:".ljust(PROMPT_CHARS, "p")
                while not stop.is_set():
                    body = {"model": "m", "prompt": prompt, "max_tokens": cap, "stream": True}
                    async with d.stream(flow, body) as s:
                        async for _ in s:
                            pass
                    done[flow] += 1

            tasks = [asyncio.create_task(client(f, k)) for f in FLOWS for k in range(CLIENTS_PER_FLOW)]
            await asyncio.sleep(seconds)
            delivered = dict(up.delivered)  # the snapshot while every flow is still backlogged
            drift = up.max_drift
            stop.set()
            await asyncio.gather(*tasks)
            charged = {f: round(d.stats()["flows"][f]["charged_cost"]) for f in FLOWS}
    total = sum(delivered.values())
    return {
        "mode": mode, "seconds": seconds, "max_drift": drift,
        "final_gap": max(delivered.values()) - min(delivered.values()),
        "delivered": delivered, "shares": {f: round(delivered[f] / total, 4) for f in FLOWS},
        "requests": done, "charged": charged,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="run length per mode (default 15)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="seed,settle,served")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if not 0 < args.seconds <= 60:
        raise SystemExit(f"--seconds must be in (0, 60], got {args.seconds}")
    results = []
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        r = asyncio.run(run_mode(mode, args.seconds, args.seed))
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        sh = " / ".join(f"{100 * r['shares'][f]:.1f}%" for f in FLOWS)
        req = " / ".join(str(r["requests"][f]) for f in FLOWS)
        print(f"{mode:7s} max drift {r['max_drift']:7,d}  final gap {r['final_gap']:7,d}  "
              f"shares {'/'.join(FLOWS)} {sh}  requests {req}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"flows": {f: list(v) for f, v in FLOWS.items()}, "slots": SLOTS,
                                         "clients_per_flow": CLIENTS_PER_FLOW, "results": results}, indent=1))


def test_bench_charge_smoke() -> None:
    """Half a second of each mode (CI's benchmark smoke run): every flow was served; nothing is timed."""
    for mode in ("seed", "settle", "served"):
        r = asyncio.run(run_mode(mode, 0.5, 0))
        assert all(r["requests"][f] > 0 and r["delivered"][f] > 0 for f in FLOWS), r
        assert abs(sum(r["shares"].values()) - 1.0) < 1e-3, r


if __name__ == "__main__":
    main()
