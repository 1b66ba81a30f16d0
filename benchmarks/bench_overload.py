"""The overload test, for real: three teams through the policy and the dispatcher, against
loopback fake OpenAI servers (aiohttp), under three policies with the same slots.

* team A dumps heavy batch work at the start (a backlog far larger than the fleet);
* team B sends short interactive requests at a steady rate;
* team C sends bursts of medium requests.

The fleet: two loopback servers with 4 slots each (8 slots). A request holds its slot for a
service time that grows with its tokens (``PREFILL`` per prompt token + ``PER_TOKEN`` per
output token), like a decode-bound engine. Modes, all through ``sfq.PolicyDispatcher``:

* ``fifo``: one org, one class, one flow (first come, first served);
* ``strict``: B's class strict (capped at the whole pool, i.e. plain strict priority), A and C
  share one batch flow in arrival order (priority levels, FIFO inside a level);
* ``policy``: orgs A, B, C; B interactive (weight 6), A and C batch (weight 1 each, A capped
  at 6 running): weighted fair sharing between the flows (org, class, pool).

Reported: B's wait before start (p50/p95/p99, from the client's submit to the server
receiving the request), A's share of the busy slot-time, C's requests completed by the end of
the run, B's completed. ``python benchmarks/bench_overload.py`` prints a markdown table and
writes ``benchmarks/results/overload.json`` (about 15 s per mode by default, ``--seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
try:
    import sfq  # noqa: F401
except ImportError:  # a checkout without an install: use python/
    sys.path.insert(0, str(HERE.parent / "python"))

from aiohttp import web  # noqa: E402

from sfq.errors import SFQError  # noqa: E402
from sfq.dispatch import PolicyDispatcher
from sfq.policy import parse_policy  # noqa: E402

PREFILL = 0.00005  # seconds per prompt token
PER_TOKEN = 0.001  # seconds per output token
SLOTS = 4  # per server
SERVERS = 2

TEAMS = {
    # team: (prompt characters, max_tokens: uniform in [lo, hi])
    "A": (2000, (128, 384)),
    "B": (200, (8, 24)),
    "C": (400, (32, 96)),
}

POLICIES = {
    "fifo": """
classes:
  all: {weight: 1, small_cost: null}
orgs:
  everyone: {keys: [k-all], classes: [all]}
""",
    "strict": """
classes:
  interactive: {strict: true, max_in_flight: %(slots)d, max_queue_age_seconds: 3600}
  batch: {weight: 1, small_cost: null}
orgs:
  shared: {keys: [k-shared], classes: [batch, interactive]}
""",
    "policy": """
classes:
  interactive: {weight: 6, max_queue_age_seconds: 45, small_cost: 2048, small_picks: 4}
  batch: {weight: 1}
orgs:
  team-a: {keys: [k-a], classes: [batch], max_in_flight: 6}
  team-b: {keys: [k-b], classes: [interactive]}
  team-c: {keys: [k-c], classes: [batch]}
""",
}
KEYS = {
    "fifo": {"A": ("k-all", None), "B": ("k-all", None), "C": ("k-all", None)},
    "strict": {"A": ("k-shared", "batch"), "B": ("k-shared", "interactive"), "C": ("k-shared", "batch")},
    "policy": {"A": ("k-a", None), "B": ("k-b", None), "C": ("k-c", None)},
}


class Server:
    """A loopback OpenAI completions server whose service time grows with the tokens."""

    def __init__(self) -> None:
        self.log: list[tuple[str, float, float]] = []  # (request id, start, end)
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _complete(self, request: web.Request) -> web.Response:
        t0 = time.monotonic()
        body = await request.json()
        n = int(body["max_tokens"])
        p = len(body["prompt"]) // 4
        try:
            await asyncio.sleep(p * PREFILL + n * PER_TOKEN)
        finally:
            self.log.append((body["user"], t0, time.monotonic()))
        return web.json_response({"id": body["user"], "object": "text_completion",
                                  "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}})


def arrivals(seconds: float, seed: int) -> list[tuple[float, str, int]]:
    """(time offset, team, max_tokens) of every request: A's dump at 0, B's steady rate, C's
    bursts; sizes drawn from a seeded generator (the same for every mode)."""
    rng = random.Random(seed)

    def size(team: str) -> int:
        lo, hi = TEAMS[team][1]
        return rng.randint(lo, hi)

    out = [(0.0, "A", size("A")) for _ in range(int(60 * seconds))]  # far more than the fleet serves
    t = 0.5
    while t < seconds:
        out.append((t, "B", size("B")))
        t += 0.05  # 20 per second
    for k in range(max(1, int(seconds // 5))):
        at = min(2.0, seconds / 3) + 5.0 * k
        out += [(at + rng.random() * 0.2, "C", size("C")) for _ in range(40)]
    return sorted(out, key=lambda x: x[0])


async def run_mode(mode: str, seconds: float, seed: int) -> dict[str, Any]:
    servers = [Server() for _ in range(SERVERS)]
    for s in servers:
        await s.start()
    backends = "\n".join(f'      - {{url: "{s.url}", max_in_flight: {SLOTS}}}' for s in servers)
    text = (f"pools:\n  fleet:\n    models: [m]\n    backends:\n{backends}\n"
            + POLICIES[mode] % {"slots": SLOTS * SERVERS} + "cost: {input_weight: 1, output_weight: 2}\n")
    pd = PolicyDispatcher(parse_policy(text), close_grace=1.0)
    submitted: dict[str, tuple[str, float]] = {}
    done: dict[str, float] = {}
    outcomes: dict[str, int] = defaultdict(int)

    async def one(rid: str, team: str, max_tokens: int) -> None:
        key, cls = KEYS[mode][team]
        chars = TEAMS[team][0]
        body = {"model": "m", "prompt": "w" * chars, "max_tokens": max_tokens, "user": rid}
        submitted[rid] = (team, time.monotonic())
        try:
            await pd.submit(key, body, cls=cls)
            done[rid] = time.monotonic()
            outcomes["completed"] += 1
        except SFQError as exc:
            outcomes[type(exc).__name__] += 1
        except asyncio.CancelledError:  # still waiting or running when the run ended
            outcomes["cut_at_end"] += 1
            raise

    tasks: list[asyncio.Task[None]] = []
    async with pd:
        t0 = time.monotonic()
        for i, (at, team, max_tokens) in enumerate(arrivals(seconds, seed)):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(f"{team}{i}", team, max_tokens)))
        end = t0 + seconds
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stats = pd.stats()
    for s in servers:
        await s.stop()

    starts = {rid: t for s in servers for rid, t, _ in s.log}
    waits = {team: [] for team in TEAMS}  # type: dict[str, list[float]]
    for rid, (team, t_sub) in submitted.items():
        if rid in starts:
            waits[team].append(starts[rid] - t_sub)
        elif team == "B":  # never started by the end of the run: it waited at least until then
            waits[team].append(end - t_sub)
    busy: dict[str, float] = defaultdict(float)
    for s in servers:
        for rid, a, b in s.log:
            team = submitted[rid][0]
            busy[team] += max(0.0, min(b, end) - max(a, t0))
    total = sum(busy.values())
    b = np.array(waits["B"]) * 1000.0
    sent = {team: sum(1 for t, _ in submitted.values() if t == team) for team in TEAMS}
    fin = {team: sum(1 for rid in done if submitted[rid][0] == team) for team in TEAMS}
    return {
        "mode": mode,
        "seconds": seconds,
        "b_wait_ms": {"p50": float(np.percentile(b, 50)), "p95": float(np.percentile(b, 95)),
                      "p99": float(np.percentile(b, 99))},
        "a_share": busy["A"] / total if total else 0.0,
        "utilisation": total / (SLOTS * SERVERS * (end - t0)),
        "sent": sent,
        "completed": fin,
        "outcomes": dict(outcomes),
        "live_after_close": stats["live"],
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| mode | B wait p50 (ms) | B wait p95 (ms) | B wait p99 (ms) | A's share of busy slot-time | "
           "C completed / sent | B completed / sent | utilisation |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        w = r["b_wait_ms"]
        out.append(f"| {r['mode']} | {w['p50']:.0f} | {w['p95']:.0f} | {w['p99']:.0f} | {r['a_share']:.0%} | "
                   f"{r['completed']['C']} / {r['sent']['C']} | {r['completed']['B']} / {r['sent']['B']} | "
                   f"{r['utilisation']:.0%} |")
    return "\n".join(out)


async def main_async(seconds: float, seed: int, modes: list[str]) -> list[dict[str, Any]]:
    return [await run_mode(m, seconds, seed) for m in modes]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="run length per mode (default 15)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="fifo,strict,policy")
    ap.add_argument("--json", default=str(HERE / "results" / "overload.json"), help="where to write the results")
    args = ap.parse_args(argv)
    rows = asyncio.run(main_async(args.seconds, args.seed, args.modes.split(",")))
    import sfq as _sfq

    doc = {"core": _sfq.CORE, "python": sys.version.split()[0], "servers": SERVERS, "slots_per_server": SLOTS,
           "prefill_s_per_token": PREFILL, "decode_s_per_token": PER_TOKEN, "teams": TEAMS, "results": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(markdown(rows))
    return 0


def test_overload_smoke() -> None:
    """A two-second run of each mode (the CI smoke): every request it sent ended, none is left."""
    rows = asyncio.run(main_async(2.0, 0, ["fifo", "strict", "policy"]))
    for r in rows:
        assert r["live_after_close"] == 0
        assert sum(r["outcomes"].values()) == sum(r["sent"].values())


if __name__ == "__main__":
    sys.exit(main())
