"""Delivered service through real ``sfq serve`` processes: a loopback engine that reports
usage honestly, a workload of orgs with the official ``openai`` client, and the measures
(shares of delivered service, Jain's index, drift, the least share in any window).

Used by ``tests/serve/test_serve_delivered.py`` (through its old name,
``tests/serve/delivered_workload.py``, which re-exports this module), by the fleet harness
(``support.fleet``, ``tests/fleet``) and by ``benchmarks/bench_delivered.py`` and
``benchmarks/bench_fleet.py`` (longer runs, reported).

**The engine** (:class:`FakeEngine`): ``slots`` requests at a time per server; a request
takes ``(prompt + 2 x output) x unit / speed`` seconds (its service, the policy's cost with
``input_weight: 1, output_weight: 2``), its prompt first, then its output in chunks of
``chunk`` tokens (a stream's events). It generates what the prompt asks for
(``"use=N"``, at most ``max_tokens``) and reports it in ``usage``; it counts every org's
service *as it delivers it* (the prompt when prefilled, each chunk as it is sent), so the
shares measured are those of the work the fleet did, not of what the gateway charged. A
stream's first event (its role) goes out as the request starts: the client learns at once
that its request left the gateway's queue. Tokens are 4 characters (``"tok "``), as the
usage counts them.

**Prefix caching** (``cached_weight``): a prompt tagged ``"cache=P"`` has P % of its tokens
served from the engine's prefix cache, reported as ``usage.prompt_tokens_details.cached_tokens``
(as vLLM, SGLang and the providers do); the engine spends ``cached_weight`` of a token's prefill
on each (default 1: a cache saves nothing) and counts its service so. An org's ``cached``
(:class:`OrgLoad`) tags its prompts.

**The workload** (:class:`OrgLoad`, :func:`run_workload`; :func:`start_workload` runs it in a
thread while a test watches the gateway): each org is a set of clients. ``closed``: ``clients``
loops, each sends its next request when the last one ends; ``keep_one``: one request always
waiting at the gateway (the next is sent when the last one's first event arrives);
``open``: a request every ``interval`` seconds (an interactive org, measured for its time to
first token). ``use(t)`` is the output the org really uses at time ``t``; ``max_tokens`` what
it declares; ``stream``: ``True``, ``False`` or ``"mixed"`` (alternating); ``weight`` its
weight in the policy file (``orgs.X.weight``).

**Several gateways**: :func:`run_workload` takes one URL or a list; each request goes to the
gateway its org's ``route`` picks (``None``: round-robin over all of them, per request, the
org's own counter; an int: always that gateway, "sticky"). Every request carries an id
(``req=...`` in its prompt): the engines record which ids they served to the end
(``Fleet.served_ids``) and the result records each request's one outcome (``outcomes``:
status 200, an HTTP error status with the gateway's message, or status 0 and what the client
raised), so that a test can check that every request was answered exactly once.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

TOKEN = "tok "  # one token of output, as usage counts it
LIMIT = 30.0


class FakeEngine:
    """One OpenAI-compatible server (see the module docstring), on a loop run by :class:`Fleet`."""

    def __init__(self, name: str, speed: float, *, slots: int = 4, unit: float = 0.002, chunk: int = 8,
                 log: list[tuple[float, str, float]], done: list[tuple[float, str, int]],
                 ids: list[str] | None = None, cached_weight: float = 1.0) -> None:
        self.name = name
        self.cached_weight = cached_weight  # a cached prompt token's share of a prefilled one
        self.speed = speed
        self.unit = unit
        self.chunk = chunk
        self.log = log  # (time, org, service units delivered), shared by the fleet
        self.done = done  # (time, org, output tokens) of every request served to its end
        self.ids = [] if ids is None else ids  # the ``req=`` id of every request served to its end
        self.slots = asyncio.Semaphore(slots)
        self.running = 0
        self.max_running = 0
        #: requests the engine holds at once, waiting for one of its slots included: above
        #: ``slots``, the gateways sent more than the backend's ``max_in_flight``
        self.holding = 0
        self.max_holding = 0
        self.served = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._serve)
        app.router.add_post("/v1/chat/completions", self._serve)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _deliver(self, org: str, units: float) -> None:
        self.log.append((time.monotonic(), org, units))

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        self.holding += 1
        self.max_holding = max(self.max_holding, self.holding)
        try:
            return await self._serve_held(request)
        finally:
            self.holding -= 1

    async def _serve_held(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("chat/completions")
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        tags = dict(part.split("=", 1) for part in text.split("|", 1)[0].split() if "=" in part)
        org = tags.get("org", "?")
        out = min(int(tags.get("use", "1")), int(body.get("max_tokens") or 16))
        prompt_tokens = max(1, len(text) // len(TOKEN))
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": out,
                                 "total_tokens": prompt_tokens + out}
        prefill = float(prompt_tokens)
        if "cache" in tags:  # P % of the prompt from the prefix cache
            cached = prompt_tokens * int(tags["cache"]) // 100
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
            prefill = prompt_tokens - cached + self.cached_weight * cached
        stream = bool(body.get("stream"))
        async with self.slots:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            try:
                resp: web.StreamResponse | None = None
                if stream:
                    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                    await resp.prepare(request)
                    await self._event(resp, chat, body, "", role=True)
                await asyncio.sleep(prefill * self.unit / self.speed)
                self._deliver(org, prefill)
                left = out
                while left > 0:
                    n = min(self.chunk, left)
                    await asyncio.sleep(2 * n * self.unit / self.speed)
                    left -= n
                    if resp is not None:
                        await self._event(resp, chat, body, TOKEN * n)
                    self._deliver(org, 2 * n)
                self.served += 1
                self.done.append((time.monotonic(), org, out))
                if "req" in tags:
                    self.ids.append(tags["req"])
                if resp is not None:
                    if (body.get("stream_options") or {}).get("include_usage"):
                        await resp.write(b"data: " + json.dumps({"id": "e", "object": "chunk", "choices": [],
                                                                 "usage": usage}).encode() + b"\n\n")
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": TOKEN * out},
                                           "finish_reason": "stop"} if chat else
                                          {"index": 0, "text": TOKEN * out, "finish_reason": "stop"})
                return web.json_response({"id": "e", "object": "chat.completion" if chat else "text_completion",
                                          "created": 0, "model": body.get("model"), "choices": [choice],
                                          "usage": usage})
            finally:
                self.running -= 1

    @staticmethod
    async def _event(resp: web.StreamResponse, chat: bool, body: dict[str, Any], piece: str,
                     role: bool = False) -> None:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": piece}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
        else:
            choice = {"index": 0, "text": piece, "finish_reason": None}
        ev = {"id": "e", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
              "model": body.get("model"), "choices": [choice]}
        await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")


class Fleet:
    """Fake engines of the given speeds on one event loop in a thread; ``log`` records every
    org's service as delivered, ``done`` every request served to its end."""

    def __init__(self, speeds: Sequence[float], *, slots: int = 4, unit: float = 0.002, chunk: int = 8,
                 cached_weight: float = 1.0) -> None:
        self.log: list[tuple[float, str, float]] = []
        self.done: list[tuple[float, str, int]] = []
        self.served_ids: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleet", daemon=True)
        self.engines = [FakeEngine(f"e{i}", s, slots=slots, unit=unit, chunk=chunk, log=self.log, done=self.done,
                                   ids=self.served_ids, cached_weight=cached_weight)
                        for i, s in enumerate(speeds)]

    def start(self) -> Fleet:
        self._thread.start()
        for e in self.engines:
            asyncio.run_coroutine_threadsafe(e.start(), self._loop).result(LIMIT)
        return self

    def stop(self) -> None:
        for e in self.engines:
            asyncio.run_coroutine_threadsafe(e.stop(), self._loop).result(LIMIT)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(LIMIT)


@dataclass
class OrgLoad:
    """One org's clients (see the module docstring)."""

    name: str
    key: str
    mode: str = "closed"  # closed | keep_one | open
    clients: int = 8
    interval: float = 0.25  # open: seconds between requests
    max_tokens: int = 50
    use: Callable[[float], int] = lambda t: 50
    stream: bool | str = False  # True, False or "mixed"
    cls: str | None = None
    prompt_chars: int = 80
    backlogged: bool = True  # counted in the fairness measures
    weight: float = 1.0  # orgs.X.weight in the policy file
    route: int | None = None  # None: round-robin over the gateways, per request; i: always gateway i
    cached: int = 0  # percent of each prompt the engines serve from their prefix cache
    #: a team of an org with nested shares: the org's name (this load is its team ``name``, its
    #: key the team's, ``weight`` the team's weight; the org's own weight is 1)
    team_of: str | None = None


@dataclass
class RunResult:
    """What one run measured."""

    start: float
    end: float
    log: list[tuple[float, str, float]]
    sent: dict[str, int] = field(default_factory=dict)
    ok: dict[str, int] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=dict)
    ttft: dict[str, list[float]] = field(default_factory=dict)
    #: the send time of each of ``ttft``'s entries (same order), to keep those after a warm-up
    ttft_sent: dict[str, list[float]] = field(default_factory=dict)
    #: request id -> (org, gateway index, status, message): 200, an HTTP status, or 0 (no answer)
    outcomes: dict[str, tuple[str, int, int, str]] = field(default_factory=dict)
    #: request ids that got a second outcome (the harness's own check: must stay empty)
    duplicates: list[str] = field(default_factory=list)
    #: (org, gateway index) -> requests sent
    per_gateway: dict[tuple[str, int], int] = field(default_factory=dict)
    #: gateway index -> requests it holds now (sent, not answered): what a gateway killed now
    #: takes down with it
    in_hands: dict[int, int] = field(default_factory=dict)
    #: requests a load balancer sent to the next gateway: their own refused the connection
    rerouted: int = 0
    #: request id -> when it was sent (time.monotonic())
    sent_at: dict[str, float] = field(default_factory=dict)


def _prompt(org: OrgLoad, use: int, rid: str = "") -> str:
    head = (f"org={org.name} use={use}" + (f" req={rid}" if rid else "")
            + (f" cache={org.cached}" if org.cached else "") + " |")
    return head + " " + "p" * max(0, org.prompt_chars - len(head) - 1)


def _refused(exc: BaseException) -> bool:
    """Whether the gateway refused the connection (nothing was sent: a load balancer tries the
    next one), by the client library's exception chain (its HTTP library's ``ConnectError``)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError) or type(seen).__name__ == "ConnectError":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _outcome(exc: BaseException) -> tuple[int, str]:
    """An exception's status (0: no HTTP answer) and message."""
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        return status, str(getattr(exc, "message", "") or exc)
    return 0, f"{type(exc).__name__}: {exc}"


async def run_workload(base_url: str | Sequence[str], orgs: Sequence[OrgLoad], seconds: float,
                       log: list[tuple[float, str, float]], model: str = "m", *,
                       result: RunResult | None = None) -> RunResult:
    """Drive ``orgs`` against the gateway(s) at ``base_url`` (one URL or a list: see the module
    docstring for the routing) for ``seconds``, then wait (bounded) for what is still running.
    ``result``: the (empty) result to fill, for a caller that watches it while the load runs."""
    import openai

    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    res = RunResult(time.monotonic(), 0.0, log) if result is None else result
    res.start, res.log = time.monotonic(), log
    end = res.start + seconds
    clients = {(o.name, g): openai.AsyncOpenAI(base_url=u + "/v1", api_key=o.key, max_retries=0, timeout=LIMIT)
               for o in orgs for g, u in enumerate(urls)}
    turn = dict.fromkeys((o.name for o in orgs), 0)
    for o in orgs:
        res.sent[o.name] = res.ok[o.name] = 0
        res.errors[o.name] = []
        res.ttft[o.name] = []
        res.ttft_sent[o.name] = []
        for g in range(len(urls)):
            res.per_gateway[(o.name, g)] = 0

    def record(rid: str, outcome: tuple[str, int, int, str]) -> None:
        if rid in res.outcomes:
            res.duplicates.append(rid)
        res.outcomes[rid] = outcome

    async def one(o: OrgLoad, k: int, started: asyncio.Event | None = None) -> None:
        use = o.use(time.monotonic() - res.start)
        stream = o.stream if isinstance(o.stream, bool) else bool(k % 2)
        if o.route is None:
            g = turn[o.name] % len(urls)
            turn[o.name] += 1
        else:
            g = o.route % len(urls)
        rid = f"{o.name}.{res.sent[o.name]}"
        prompt = _prompt(o, use, rid)
        headers = {"X-SFQ-Class": o.cls} if o.cls else {}
        res.sent[o.name] += 1
        t0 = res.sent_at[rid] = time.monotonic()
        try:
            for tried in range(len(urls)):  # a load balancer: a gateway that refuses connections is skipped
                res.per_gateway[(o.name, g)] += 1
                res.in_hands[g] = res.in_hands.get(g, 0) + 1
                try:
                    await attempt(o, clients[(o.name, g)], k, stream, prompt, headers, t0, started)
                    res.ok[o.name] += 1
                    record(rid, (o.name, g, 200, ""))
                    return
                except openai.APIConnectionError as exc:
                    if _refused(exc) and tried + 1 < len(urls):
                        res.per_gateway[(o.name, g)] -= 1
                        res.rerouted += 1
                        g = (g + 1) % len(urls)
                        continue
                    fail(o, rid, g, exc)
                    return
                except Exception as exc:  # recorded: the tests assert on them
                    fail(o, rid, g, exc)
                    return
                finally:
                    res.in_hands[g] -= 1
        finally:
            if started is not None:
                started.set()

    def fail(o: OrgLoad, rid: str, g: int, exc: BaseException) -> None:
        res.errors[o.name].append(f"{type(exc).__name__}: {exc}")
        status, message = _outcome(exc)
        record(rid, (o.name, g, status, message))

    async def attempt(o: OrgLoad, c: Any, k: int, stream: bool, prompt: str, headers: dict[str, str], t0: float,
                      started: asyncio.Event | None) -> None:
        if not stream:
            await c.completions.create(model=model, prompt=prompt, max_tokens=o.max_tokens, extra_headers=headers)
            return
        if k % 4 < 2:
            s = await c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=o.max_tokens, stream=True, extra_headers=headers)
        else:
            s = await c.completions.create(model=model, prompt=prompt, max_tokens=o.max_tokens, stream=True,
                                           extra_headers=headers)
        first = True
        async for _ in s:
            if first:
                res.ttft[o.name].append(time.monotonic() - t0)
                res.ttft_sent[o.name].append(t0)
                if started is not None:
                    started.set()
                first = False

    async def closed(o: OrgLoad, i: int) -> None:
        k = i
        while time.monotonic() < end:
            await one(o, k)
            k += o.clients

    async def keep_one(o: OrgLoad) -> None:
        tasks: set[asyncio.Task[None]] = set()
        k = 0
        while time.monotonic() < end:
            started = asyncio.Event()
            t = asyncio.ensure_future(one(o, k, started))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            k += 1
            await started.wait()  # it left the queue: the next one waits in its place
        if tasks:
            await asyncio.gather(*tasks)

    async def open_loop(o: OrgLoad) -> None:
        tasks = []
        k = 0
        while time.monotonic() < end:
            tasks.append(asyncio.ensure_future(one(o, k)))
            k += 1
            await asyncio.sleep(o.interval)
        await asyncio.gather(*tasks)

    jobs = []
    for o in orgs:
        if o.mode == "closed":
            jobs += [closed(o, i) for i in range(o.clients)]
        elif o.mode == "keep_one":
            jobs.append(keep_one(o))
        elif o.mode == "open":
            jobs.append(open_loop(o))
        else:
            raise ValueError(f"unknown mode {o.mode!r}")
    await asyncio.wait_for(asyncio.gather(*jobs), seconds + LIMIT)
    res.end = time.monotonic()
    for c in clients.values():
        await c.close()
    return res


def start_workload(base_url: str | Sequence[str], orgs: Sequence[OrgLoad], seconds: float,
                   log: list[tuple[float, str, float]], model: str = "m") -> Future[RunResult]:
    """:func:`run_workload` on an event loop in a thread of its own, started now: the caller
    watches the gateway (``/stats``, ``/metrics``, a browser) while it runs, and reads the
    result with ``.result(timeout)`` (bounded). Several may run at once, e.g. orgs that stop at
    different times."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="workload")
    try:
        return pool.submit(asyncio.run, run_workload(base_url, orgs, seconds, log, model))
    finally:
        pool.shutdown(wait=False)


# ---------------------------------------------------------------------- measures
def service(log: Sequence[tuple[float, str, float]], orgs: Sequence[str], t0: float = -math.inf,
            t1: float = math.inf) -> dict[str, float]:
    """Each org's service delivered in ``[t0, t1)``."""
    out = dict.fromkeys(orgs, 0.0)
    for t, org, units in log:
        if t0 <= t < t1 and org in out:
            out[org] += units
    return out


def shares(svc: dict[str, float]) -> dict[str, float]:
    total = sum(svc.values())
    return {k: (v / total if total else 0.0) for k, v in svc.items()}


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index of equally weighted allocations (1: perfectly even)."""
    s = sum(values)
    q = sum(v * v for v in values)
    return s * s / (len(values) * q) if q else 1.0


def least_window_share(log: Sequence[tuple[float, str, float]], orgs: Sequence[str], org: str, window: float,
                       t0: float, t1: float) -> float:
    """The smallest share of ``org`` among ``orgs`` over windows of ``window`` units of their
    total delivered service (consecutive, from ``t0`` to ``t1``): how close it came to being
    starved, in a measure of work, not of time."""
    members = set(orgs)
    least = 1.0
    got = total = 0.0
    for t, o, units in log:
        if not (t0 <= t < t1) or o not in members:
            continue
        total += units
        if o == org:
            got += units
        if total >= window:
            least = min(least, got / total)
            got = total = 0.0
    return least


def drift(log: Sequence[tuple[float, str, float]], orgs: Sequence[str], t0: float, t1: float,
          step: float = 0.1) -> float:
    """The largest gap, in service units, that opened between two of ``orgs`` (equal weights)
    over any interval in ``[t0, t1)``: ``max over t < t' and i, j`` of
    ``(W_i(t') - W_i(t)) - (W_j(t') - W_j(t))``, sampled every ``step`` seconds."""
    n = max(1, int((t1 - t0) / step))
    cum = {o: [0.0] * (n + 1) for o in orgs}
    for t, o, units in log:
        if o in cum and t0 <= t < t1:
            k = min(n, int((t - t0) / step) + 1)
            cum[o][k] += units
    for o in orgs:
        c = cum[o]
        for k in range(1, n + 1):
            c[k] += c[k - 1]
    worst = 0.0
    names = list(orgs)
    for a in names:
        for b in names:
            if a == b:
                continue
            d = [cum[a][k] - cum[b][k] for k in range(n + 1)]
            lo = d[0]
            for x in d:  # max over k' > k of d[k'] - d[k]
                lo = min(lo, x)
                worst = max(worst, x - lo)
    return worst


def policy_text(urls: Sequence[str], orgs: Sequence[OrgLoad], *, slots: int = 4, charge: str = "served",
                redis: str | None = None, prefix: str = "sfq-fleet:", lease: float = 10.0,
                cached_input_weight: float | None = None, extra: str = "") -> str:
    """The gateway's policy: one pool over the fleet, each org's weight (``OrgLoad.weight``),
    the charge mode given (and ``cached_input_weight`` when given); with ``redis``, the section
    that shares the state through it; ``extra``: more top-level sections, as YAML text."""
    cw = "" if cached_input_weight is None else f", cached_input_weight: {cached_input_weight:g}"
    backends = "\n".join(f'      - {{url: "{u}", max_in_flight: {slots}}}' for u in urls)
    org_lines = "\n".join(f'  {o.name}: {{keys: ["{o.key}"], classes: [batch, interactive]'
                          + (f", weight: {o.weight:g}" if o.weight != 1 else "") + "}"
                          for o in orgs if o.team_of is None)
    parents = list(dict.fromkeys(o.team_of for o in orgs if o.team_of is not None))
    for parent in parents:  # nested shares: the org's teams, each with its key and weight
        teams = ", ".join(f'{o.name}: {{keys: ["{o.key}"], weight: {o.weight:g}}}' for o in orgs if o.team_of == parent)
        org_lines += f"\n  {parent}: {{classes: [batch, interactive], teams: {{{teams}}}}}"
    state = "" if redis is None else f'state: {{redis: "{redis}", prefix: "{prefix}", lease_seconds: {lease:g}}}\n'
    return f"""\
pools:
  main:
    models: [m]
    backends:
{backends}
classes:
  batch: {{weight: 1}}
  interactive: {{weight: 1}}
orgs:
{org_lines}
cost: {{input_weight: 1, output_weight: 2, charge: {charge}{cw}}}
{state}{extra}"""


def over_declared_orgs() -> list[OrgLoad]:
    """The first case: A plain, B interactive (open loop, streams), C keeps one request
    waiting (streams), D declares ``max_tokens`` 2000 and uses 50 (mixed)."""
    return [
        OrgLoad("A", "sk-A", clients=8, stream=False),
        OrgLoad("B", "sk-B", mode="open", interval=0.25, max_tokens=20, use=lambda t: 20, stream=True,
                cls="interactive", backlogged=False),
        OrgLoad("C", "sk-C", mode="keep_one", stream=True),
        OrgLoad("D", "sk-D", clients=8, max_tokens=2000, use=lambda t: 50, stream="mixed"),
    ]


def plain_over_declared_orgs() -> list[OrgLoad]:
    """The third case (issue 27): A sends plain requests declaring ``max_tokens`` 10x what it
    uses, and is listed first (its clients are the first to send); B interactive, C keeps
    one stream waiting, D honest (mixed)."""
    return [
        OrgLoad("A", "sk-A", clients=8, max_tokens=500, use=lambda t: 50, stream=False),
        OrgLoad("B", "sk-B", mode="open", interval=0.25, max_tokens=20, use=lambda t: 20, stream=True,
                cls="interactive", backlogged=False),
        OrgLoad("C", "sk-C", mode="keep_one", stream=True),
        OrgLoad("D", "sk-D", clients=8, stream="mixed"),
    ]


def trained_low_orgs(switch: float) -> list[OrgLoad]:
    """The second case: four backlogged orgs declaring 400 tokens; A, B, C use all of them;
    D uses 10 until ``switch`` seconds into the run (its estimate learns "small"), then 400."""
    return [
        OrgLoad("A", "sk-A", clients=6, max_tokens=400, use=lambda t: 400, stream=False),
        OrgLoad("B", "sk-B", clients=6, max_tokens=400, use=lambda t: 400, stream=True),
        OrgLoad("C", "sk-C", clients=6, max_tokens=400, use=lambda t: 400, stream="mixed"),
        OrgLoad("D", "sk-D", clients=6, max_tokens=400, use=lambda t: 10 if t < switch else 400, stream="mixed"),
    ]
