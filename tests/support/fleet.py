"""The fleet harness: N loopback engines, a real ``redis-server``, K real ``sfq serve``
processes with one policy file, and a workload of orgs sent with the official ``openai``
client, each org's requests going to the gateways ALTERNATING (round-robin, per request) or
STICKY (an org to one gateway); the shares of service measured as the ENGINES delivered it.

A :class:`Scenario` says what to run; :func:`run_scenario` runs it (every wait bounded) and
returns a :class:`Report`:

* each backlogged org's share of the backlogged orgs' delivered service (prompt + 2 x output
  tokens, counted at the engines as they deliver it) over the measured interval (after the
  warm-up, until the load stops), next to its weighted share (its weight over the backlogged
  orgs' weights); the largest deviation in points, over the whole interval and over each
  ``window`` seconds of it; Jain's index of the shares divided by the weighted shares;
* the interactive (not backlogged) orgs' time to first token, p50 and p99, over the requests
  sent after the warm-up;
* each org's requests sent, completed (200) and failed (with the status and the gateway's
  message), per gateway too; and the harness's check that every request got exactly one
  outcome and that the engines served each completed request exactly once
  (:meth:`Report.outcome_problems`).

Nothing here is timed: the measures are shares of the work done. The workloads
(:func:`issue27_orgs`, :func:`weighted_orgs`) are those of ``tests/fleet`` and
``benchmarks/bench_fleet.py``.
"""

from __future__ import annotations

import asyncio
import math
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from support.processes import REDIS, Gateway, RedisServer
from support.workload import Fleet, OrgLoad, RunResult, jain, policy_text, run_workload, service, shares

ALTERNATING = "alternating"
STICKY = "sticky"


@dataclass
class Scenario:
    """One run: the fleet, the gateways and how the orgs reach them, the workload, the timing."""

    name: str
    orgs: Sequence[OrgLoad]
    gateways: int = 1
    routing: str = ALTERNATING  # alternating | sticky
    #: sticky: org name -> gateway index, or None for an org spread over every gateway (round-robin,
    #: per request); default: the orgs, in order, dealt over the gateways
    sticky: dict[str, int | None] | None = None
    #: share the state through Redis; None: when there is more than one gateway
    redis: bool | None = None
    speeds: tuple[float, ...] = (1.0,)
    slots: int = 4  # requests at a time per engine (and the backend's max_in_flight)
    unit: float = 0.0005  # seconds per service unit at speed 1
    chunk: int = 16  # output tokens per stream event
    warmup: float = 3.0
    seconds: float = 8.0  # measured, after the warm-up
    window: float = 2.0  # the per-window shares' window, seconds
    charge: str = "served"
    #: ``(at, for)``: Redis stopped ``at`` seconds into the load, restarted (empty) ``for``
    #: seconds later; the gateways' ``/health`` is read in the middle of the outage
    redis_outage: tuple[float, float] | None = None
    #: ``(gateway, at, for)``: that gateway SIGKILLed ``at`` seconds into the load, started
    #: again on its port ``for`` seconds later (a load balancer sends its clients to the
    #: next gateway meanwhile)
    gateway_kill: tuple[int, float, float] | None = None
    lease: float = 10.0  # the state's lease_seconds: a killed gateway's slots come back within this

    @property
    def uses_redis(self) -> bool:
        return self.gateways > 1 if self.redis is None else self.redis

    def routed(self) -> list[OrgLoad]:
        """The orgs with their ``route`` set for this scenario's routing."""
        if self.routing == ALTERNATING:
            return [replace(o, route=None) for o in self.orgs]
        if self.routing != STICKY:
            raise ValueError(f"unknown routing {self.routing!r}")
        table = self.sticky or {}
        out = []
        for i, o in enumerate(self.orgs):
            g = table.get(o.name, i)
            out.append(replace(o, route=None if g is None else g % self.gateways))
        return out

    def describe(self) -> str:
        state = "redis" if self.uses_redis else "memory"
        return (f"{self.gateways} gateway(s), {self.routing if self.gateways > 1 else 'one'}, {state}, "
                f"engines {'/'.join(f'{s:g}' for s in self.speeds)}")


@dataclass
class Report:
    """What one scenario's run measured (see the module docstring)."""

    scenario: str
    gateways: int
    routing: str
    state: str
    shares: dict[str, float]
    expected: dict[str, float]
    deviation: float  # the largest |share - expected| over the measured interval, in points
    window_shares: list[dict[str, float]]
    window_deviation: float  # the largest over the windows, in points
    jain: float
    service_units: float
    ttft: dict[str, dict[str, float]]  # interactive org -> {"p50", "p99", "n"} (seconds), after the warm-up
    sent: dict[str, int]
    completed: dict[str, int]
    errors: dict[str, list[str]]
    per_gateway: dict[str, list[int]]  # org -> requests sent to each gateway
    engines_served: list[int]
    problems: list[str] = field(default_factory=list)  # outcome problems (must be empty)
    #: each engine's most requests held at once (waiting for a slot included), and its slots
    engines_peak: list[int] = field(default_factory=list)
    slots: int = 0
    #: the gateways' ``/health`` (status code, ``status``) in the middle of a Redis outage
    health_in_outage: list[tuple[int, str]] = field(default_factory=list)
    #: a gateway killed: the requests it held at that moment (sent, not answered), and the
    #: requests a load balancer sent elsewhere because a gateway refused the connection
    killed_in_hands: int = 0
    killed_at: float = 0.0  # time.monotonic() when it was killed
    rerouted: int = 0
    #: request id -> when it was sent (time.monotonic())
    sent_at: dict[str, float] = field(default_factory=dict)
    #: request id -> (org, gateway index, status, message)
    outcomes: dict[str, tuple[str, int, int, str]] = field(default_factory=dict)
    #: Redis round trips of every gateway during the load, per request sent (shared state only)
    round_trips_per_request: float | None = None
    #: the same while the fleet is idle (one request at a time: the added-latency requests)
    idle_round_trips_per_request: float | None = None

    def deviation_from(self, other: Report) -> float:
        """The largest |share here - share there| over the backlogged orgs, in points."""
        return max(abs(self.shares[k] - other.shares.get(k, 0.0)) * 100 for k in self.shares)

    def outcome_problems(self) -> list[str]:
        return list(self.problems)

    def summary(self) -> str:
        sh = ", ".join(f"{k} {v:.1%} (want {self.expected[k]:.1%})" for k, v in self.shares.items())
        tt = "; ".join(f"{k} TTFT p99 {v['p99'] * 1000:.0f} ms (n={v['n']:.0f})" for k, v in self.ttft.items())
        errs = {k: len(v) for k, v in self.errors.items() if v}
        return (f"[{self.scenario}: {self.gateways} gw {self.routing} {self.state}] {sh}; max deviation "
                f"{self.deviation:.1f} pts (per {len(self.window_shares)} windows: {self.window_deviation:.1f}); "
                f"Jain {self.jain:.4f}; {tt}; completed {self.completed}; errors {errs or 'none'}"
                + ("" if self.round_trips_per_request is None else
                   f"; Redis round trips per request {self.round_trips_per_request:.2f}"))

    def as_dict(self) -> dict[str, Any]:
        """The report's figures (without the per-request outcomes and send times)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("outcomes", "sent_at")}


def _pct(xs: Sequence[float], p: float) -> float:
    ys = sorted(xs)
    if not ys:
        return math.nan
    return ys[min(len(ys) - 1, max(0, math.ceil(p / 100 * len(ys)) - 1))]


def expected_shares(orgs: Sequence[OrgLoad]) -> dict[str, float]:
    """Each backlogged org's weight over the backlogged orgs' weights; a team's, its part (its
    weight over its backlogged sibling teams') of its org's (weight 1)."""
    back = [o for o in orgs if o.backlogged]
    tops = {o.name: o.weight for o in back if o.team_of is None}
    tops.update({o.team_of: 1.0 for o in back if o.team_of is not None})
    total = sum(tops.values())
    out = {}
    for o in back:
        if o.team_of is None:
            out[o.name] = o.weight / total
        else:
            sib = sum(x.weight for x in back if x.team_of == o.team_of)
            out[o.name] = tops[o.team_of] / total * o.weight / sib
    return out


def weighted_jain(sh: dict[str, float], expected: dict[str, float]) -> float:
    return jain([sh[k] / expected[k] for k in expected if expected[k] > 0])


def measure(sc: Scenario, orgs: Sequence[OrgLoad], res: RunResult, fleet: Fleet, state: str) -> Report:
    """The report of one run (see the module docstring)."""
    back = [o.name for o in orgs if o.backlogged]
    expected = expected_shares(orgs)
    t0, t1 = res.start + sc.warmup, res.start + sc.warmup + sc.seconds
    svc = service(res.log, back, t0, t1)
    sh = shares(svc)
    windows = []
    n = max(1, int(round(sc.seconds / sc.window)))
    for i in range(n):
        w0 = t0 + i * sc.seconds / n
        windows.append(shares(service(res.log, back, w0, w0 + sc.seconds / n)))
    dev = max(abs(sh[k] - expected[k]) for k in back) * 100
    wdev = max(abs(w[k] - expected[k]) for w in windows for k in back) * 100
    ttft = {}
    for o in orgs:
        if o.backlogged:
            continue
        xs = [t for t, s in zip(res.ttft[o.name], res.ttft_sent[o.name]) if t0 <= s < t1]
        ttft[o.name] = {"p50": _pct(xs, 50), "p99": _pct(xs, 99), "n": float(len(xs))}
    per_gw = {o.name: [res.per_gateway.get((o.name, g), 0) for g in range(sc.gateways)] for o in orgs}
    return Report(sc.name, sc.gateways, sc.routing if sc.gateways > 1 else "-", state,
                  {k: round(v, 4) for k, v in sh.items()}, {k: round(v, 4) for k, v in expected.items()},
                  round(dev, 2), [{k: round(v, 4) for k, v in w.items()} for w in windows], round(wdev, 2),
                  round(weighted_jain(sh, expected), 4), round(sum(svc.values()), 1), ttft, dict(res.sent),
                  dict(res.ok), {k: list(v) for k, v in res.errors.items()}, per_gw,
                  [e.served for e in fleet.engines], outcome_problems(res, fleet),
                  [e.max_holding for e in fleet.engines], sc.slots)


def outcome_problems(res: RunResult, fleet: Fleet) -> list[str]:
    """Every request sent got exactly one outcome: status 200, or an HTTP error status with
    the gateway's message (an explained refusal); none with no answer (status 0), none
    twice; and the engines served every completed request exactly once and nothing that no
    client asked for."""
    out = []
    if res.duplicates:
        out.append(f"requests with two outcomes: {res.duplicates[:5]}")
    sent = sum(res.sent.values())
    if len(res.outcomes) != sent:
        out.append(f"{sent} requests sent, {len(res.outcomes)} outcomes")
    unexplained = [(rid, o) for rid, o in res.outcomes.items() if o[2] != 200 and (o[2] == 0 or not o[3])]
    if unexplained:
        out.append(f"{len(unexplained)} requests without an explained outcome, e.g. {unexplained[:3]}")
    served: dict[str, int] = {}
    for rid in fleet.served_ids:
        served[rid] = served.get(rid, 0) + 1
    twice = [rid for rid, c in served.items() if c > 1]
    if twice:
        out.append(f"{len(twice)} requests served twice by the engines, e.g. {twice[:5]}")
    ok = {rid for rid, o in res.outcomes.items() if o[2] == 200}
    missing = sorted(ok - served.keys())
    if missing:
        out.append(f"{len(missing)} requests answered 200 that no engine served to the end, e.g. {missing[:5]}")
    stray = sorted(served.keys() - res.outcomes.keys())
    if stray:
        out.append(f"{len(stray)} requests served that no client sent, e.g. {stray[:5]}")
    return out


async def _added_latency(direct: str, urls: Sequence[str], n: int) -> list[float]:
    """``n`` pairs of sequential one-token requests (one client, an idle fleet): straight to
    the engine, then through one of ``urls`` in turn; each pair's difference, seconds."""
    import openai

    eng = openai.AsyncOpenAI(base_url=direct + "/v1", api_key="none", max_retries=0, timeout=20)
    gws = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="sk-lat", max_retries=0, timeout=20) for u in urls]

    async def one(c: Any) -> float:
        t = time.perf_counter()
        await c.completions.create(model="m", prompt="org=lat use=1 |", max_tokens=1)
        return time.perf_counter() - t

    out = []
    try:
        for i in range(min(5, n)):  # warm the connections
            await one(eng)
            await one(gws[i % len(gws)])
        for i in range(n):
            d = await one(eng)
            out.append(await one(gws[i % len(gws)]) - d)
    finally:
        await eng.close()
        for c in gws:
            await c.close()
    return out


LATENCY_ORG = OrgLoad("lat", "sk-lat", backlogged=False)


def _faults(sc: Scenario, redis: RedisServer | None, gws: list[Gateway], cfg: Path, res: RunResult,
            seen: dict[str, Any]) -> list[threading.Timer]:
    """The scenario's faults, on timers from now (the load's start): Redis stopped, restarted
    empty, the gateways' ``/health`` read in the middle of the outage (``seen["health"]``); a
    gateway SIGKILLed and started again on its port (``seen["in_hands"]``: the requests it
    held when killed)."""
    timers = []
    if sc.redis_outage is not None:
        if redis is None:
            raise ValueError(f"{sc.name}: a Redis outage needs the gateways to share Redis")
        at, down = sc.redis_outage

        def read() -> None:
            for g in gws:
                code, body = g.health()
                seen["health"].append((code, str(body.get("status"))))

        timers += [threading.Timer(at, redis.stop), threading.Timer(at + down / 2, read),
                   threading.Timer(at + down, redis.start)]
    if sc.gateway_kill is not None:
        i, at, down = sc.gateway_kill

        def kill() -> None:
            seen["in_hands"] = res.in_hands.get(i, 0)  # (read first: those failing as it dies leave it)
            seen["read_at"] = time.monotonic()
            gws[i].kill()  # (SIGKILL, then waits for the process to be gone)
            # it died now: a request sent to it since the count above was in its hands too
            seen["killed_at"] = time.monotonic()

        def restart() -> None:
            port = int(gws[i].url.rsplit(":", 1)[1])
            gws[i] = Gateway(cfg, wait=False, grace=1.0, port=port)
            gws[i].listen()

        timers += [threading.Timer(at, kill), threading.Timer(at + down, restart)]
    for t in timers:
        t.daemon = True
        t.start()
    return timers


def run_scenario(sc: Scenario, *, redis: RedisServer | None = None, workdir: Path | None = None,
                 latency_requests: int = 0) -> Report:
    """Run ``sc`` (engines, Redis when it needs one and none is given, gateways, the load) and
    measure it. With ``latency_requests``, first measure the added latency on the idle fleet
    (``Report`` gains ``added_latency`` in its dict form, seconds; see :func:`_added_latency`)."""
    orgs = sc.routed()
    own_redis = None
    if sc.uses_redis and redis is None:
        if REDIS is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        redis = own_redis = RedisServer().start()
    tmp = tempfile.TemporaryDirectory(prefix="sfq-fleet-") if workdir is None else None
    where = Path(tmp.name) if tmp is not None else workdir
    assert where is not None
    fleet = Fleet(sc.speeds, slots=sc.slots, unit=sc.unit, chunk=sc.chunk).start()
    gws: list[Gateway] = []
    seen: dict[str, Any] = {"health": [], "in_hands": 0}
    try:
        cfg = where / f"{sc.name}-{uuid.uuid4().hex[:6]}.yaml"
        all_orgs = list(orgs) + ([LATENCY_ORG] if latency_requests else [])
        cfg.write_text(policy_text([e.url for e in fleet.engines], all_orgs, slots=sc.slots, charge=sc.charge,
                                   redis=redis.url if sc.uses_redis and redis is not None else None,
                                   prefix=f"fleet-{uuid.uuid4().hex[:8]}:", lease=sc.lease))
        gws = [Gateway(cfg, wait=False, grace=1.0) for _ in range(sc.gateways)]
        urls = [g.listen() for g in gws]
        added: list[float] = []
        if latency_requests:
            idle0 = sum(g.round_trips() for g in gws) if sc.uses_redis else 0
            added = asyncio.run(_added_latency(fleet.engines[0].url, urls, latency_requests))
            if sc.uses_redis:  # (the idle fleet: one request at a time, warm-up included)
                seen["idle_round_trips"] = (sum(g.round_trips() for g in gws) - idle0) / (latency_requests
                                                                                          + min(5, latency_requests))
            fleet.log.clear()
            fleet.done.clear()
            fleet.served_ids.clear()
            for e in fleet.engines:
                e.served = 0
        res = RunResult(0.0, 0.0, fleet.log)
        faults = _faults(sc, redis, gws, cfg, res, seen)
        trips0 = sum(g.round_trips() for g in gws)
        try:
            asyncio.run(run_workload(urls, orgs, sc.warmup + sc.seconds, fleet.log, result=res))
            if sc.uses_redis and sc.redis_outage is None and sc.gateway_kill is None:
                seen["round_trips"] = sum(g.round_trips() for g in gws) - trips0
                if os.environ.get("SFQ_FLEET_TRIPS"):  # (where the round trips go, by script and gateway)
                    print([(g.state_stats().get("round_trips_by_script"), g.state_stats().get("offers_by_content")) for g in gws], flush=True)
        finally:
            for t in faults:
                t.cancel()
            if redis is not None and sc.redis_outage is not None and not redis.ping():
                redis.start()
    finally:
        for g in gws:
            g.stop()
        fleet.stop()
        if own_redis is not None:
            own_redis.stop()
        if tmp is not None:
            tmp.cleanup()
    rep = measure(sc, orgs, res, fleet, "redis" if sc.uses_redis else "memory")
    rep.health_in_outage = seen["health"]
    rep.killed_in_hands = seen["in_hands"]
    if "read_at" in seen and sc.gateway_kill is not None:
        k = sc.gateway_kill[0]
        rep.killed_in_hands += sum(1 for rid, o in res.outcomes.items()
                                   if o[1] == k and seen["read_at"] < res.sent_at.get(rid, 0.0) <= seen["killed_at"])
    rep.rerouted = res.rerouted
    rep.killed_at = seen.get("killed_at", 0.0)
    rep.sent_at = dict(res.sent_at)
    rep.outcomes = dict(res.outcomes)
    if "round_trips" in seen and res.outcomes:
        rep.round_trips_per_request = round(seen["round_trips"] / len(res.outcomes), 3)
    if "idle_round_trips" in seen:
        rep.idle_round_trips_per_request = round(seen["idle_round_trips"], 3)
    if latency_requests:
        rep.added_latency = added  # type: ignore[attr-defined]
    return rep


# ---------------------------------------------------------------------- workloads
def interactive_org(interval: float = 0.25) -> OrgLoad:
    """An interactive org: an open loop, a short stream every ``interval`` seconds, in the
    interactive class; not backlogged (measured for its time to first token)."""
    return OrgLoad("I", "sk-I", mode="open", interval=interval, max_tokens=20, use=lambda t: 20, stream=True,
                   cls="interactive", backlogged=False)


def issue27_orgs(tokens: int = 200, clients: int = 4, over: bool = False) -> list[OrgLoad]:
    """Issue 27's workload: four equal orgs, A plain answers of ``tokens`` tokens, B and C
    streams, D mixed (streams and plain), all honest ``max_tokens`` (``over``: D declares 10x
    what it uses), plus the interactive org."""
    return [
        OrgLoad("A", "sk-A", clients=clients, max_tokens=tokens, use=lambda t: tokens, stream=False),
        OrgLoad("B", "sk-B", clients=clients, max_tokens=tokens, use=lambda t: tokens, stream=True),
        OrgLoad("C", "sk-C", clients=clients, max_tokens=tokens, use=lambda t: tokens, stream=True),
        OrgLoad("D", "sk-D", clients=clients, max_tokens=tokens * (10 if over else 1), use=lambda t: tokens,
                stream="mixed"),
        interactive_org(),
    ]


def over_declared_first_orgs(tokens: int = 200, clients: int = 4) -> list[OrgLoad]:
    """Issue 27's several-backends case: A sends plain requests declaring ``max_tokens`` 10x
    what it uses, B and C stream, D mixed, honest; plus the interactive org."""
    return [
        OrgLoad("A", "sk-A", clients=clients, max_tokens=tokens * 10, use=lambda t: tokens, stream=False),
        *issue27_orgs(tokens=tokens, clients=clients)[1:],
    ]


def weighted_orgs(tokens: int = 200, clients: int = 5) -> list[OrgLoad]:
    """Weights 2:1:1: A (weight 2) plain; B streams and declares ``max_tokens`` 10x what it
    uses (over-declared); C mixed, honest; plus the interactive org."""
    return [
        OrgLoad("A", "sk-A", clients=clients + 2, max_tokens=tokens, use=lambda t: tokens, stream=False, weight=2),
        OrgLoad("B", "sk-B", clients=clients, max_tokens=tokens * 10, use=lambda t: tokens, stream=True),
        OrgLoad("C", "sk-C", clients=clients, max_tokens=tokens, use=lambda t: tokens, stream="mixed"),
        interactive_org(),
    ]


def nested_orgs(tokens: int = 200, clients: int = 5) -> list[OrgLoad]:
    """Nested shares (org -> team): acme's teams research (weight 3, streams) and product
    (weight 1, plain, declaring ``max_tokens`` 10x what it uses) split acme's half 3:1, globex
    (mixed, honest) has the other half; plus the interactive org."""
    return [
        OrgLoad("research", "sk-research", clients=clients, max_tokens=tokens, use=lambda t: tokens, stream=True,
                weight=3, team_of="acme"),
        OrgLoad("product", "sk-product", clients=clients, max_tokens=tokens * 10, use=lambda t: tokens,
                stream=False, team_of="acme"),
        OrgLoad("globex", "sk-globex", clients=clients, max_tokens=tokens, use=lambda t: tokens, stream="mixed"),
        interactive_org(),
    ]


def four_to_one_orgs(tokens: int = 200, clients: int = 6) -> list[OrgLoad]:
    """Weights 4:1: A (weight 4) plain answers, B streams declaring ``max_tokens`` 10x what it
    uses; plus the interactive org."""
    return [
        OrgLoad("A", "sk-A", clients=clients + 2, max_tokens=tokens, use=lambda t: tokens, stream=False, weight=4),
        OrgLoad("B", "sk-B", clients=clients, max_tokens=tokens * 10, use=lambda t: tokens, stream=True),
        interactive_org(),
    ]
