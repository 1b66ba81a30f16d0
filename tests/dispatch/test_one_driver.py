"""One table of cases, run through both faces of the one asyncio driver.

``sfq.Dispatcher([...])`` (flows are any hashable id) and ``sfq.PolicyDispatcher(policy,
backends={name: backend})`` (flows are ``sfq.Flow(org, cls, pool)`` under a small policy whose
``org_template`` allows any org) are one driver: API.md ("Embedding sfq in your own proxy")
says every primitive means the same in both. Each case below runs on both faces, through a
small adapter (:class:`Face`) that gives each its ``flow(name)`` and its calls, and says what
it saw (the exception's class, ``http_status``, ``param`` and refusal reason, where it was
raised, what the flow's row and the backend's health say), so that a difference between the
faces is a failing case named by its face. Both faces run on one loopback ``FakeServer``, one
backend ``up`` with one slot, one attempt per request (no retries), and health checks that
never run during a test (a backend the rule took out stays out).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import tracemalloc
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import prometheus_client
import pytest
from dispatch_helpers import FakeServer, settle, wait_until

import sfq
from sfq.backends import OpenAIBackend
from sfq.backends.health import HealthOptions
from sfq.errors import BackendHTTPError, BadRequest, DeadlineExceeded, InvalidTimeout, Refused
from sfq.policy import Policy, parse_policy

#: a backend out of rotation is not health-checked back during a test: it stays as the rule left it
HEALTH = HealthOptions(backoff=3600.0, max_backoff=3600.0)
BACKEND = "up"
BODY: dict[str, Any] = {"model": "m", "prompt": "hello", "max_tokens": 4}
SBODY: dict[str, Any] = {**BODY, "stream": True}
USAGE = {"prompt_tokens": 1, "completion_tokens": 4}
FACES = ("Dispatcher", "PolicyDispatcher")
CALLS = ("submit", "stream", "open_stream", "acquire")

CONTEXT_ERROR = {"error": {
    "message": "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 "
               "tokens (key sk-abcdefgh1234567, server http://10.0.0.5:8000).",
    "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}


#: the cost model of a Dispatcher's default estimator (``CostEstimator()``: tokens, in and out
#: alike); a policy file's default weighs output twice (docs/policy.md)
SAME_COST = "cost: {input_weight: 1, output_weight: 1}\n"


def _policy(url: str, *, template: bool = True, cost: str = SAME_COST) -> Policy:
    """One pool ``p`` (model ``m``, the backend ``up`` with one slot), one class, one attempt,
    ``cost`` (default: the Dispatcher's own); with ``template``, every org the embedder names is
    allowed; without, only ``acme``."""
    orgs = "org_template: {classes: [batch]}\n" if template else "orgs:\n  acme: {classes: [batch]}\n"
    return parse_policy(f"""\
pools:
  p:
    models: [m]
    backends: [{{url: "{url}", name: {BACKEND}, max_in_flight: 1}}]
classes:
  batch: {{weight: 1}}
retry: {{max_attempts: 1}}
""" + orgs + cost)


class Face:
    """One face of the driver, called the same way whatever it is: ``name`` is a tenant."""

    kind = ""

    def __init__(self, pd: sfq.PolicyDispatcher) -> None:
        self.pd = pd

    def flow(self, name: str) -> Hashable:
        raise NotImplementedError

    def submit(self, name: str, body: Any, **kw: Any) -> Any:
        raise NotImplementedError

    def stream(self, name: str, body: Any, **kw: Any) -> Any:
        raise NotImplementedError

    def open_stream(self, name: str, body: Any, **kw: Any) -> Any:
        return self.pd.open_stream(self.flow(name), body, **kw)  # type: ignore[arg-type]

    def acquire(self, name: str, body: Any = None, **kw: Any) -> Any:
        return self.pd.acquire(self.flow(name), body, **kw)  # type: ignore[arg-type]

    def row(self, name: str) -> dict[str, float] | None:
        """The flow's counters, in one vocabulary for both faces."""
        raise NotImplementedError

    def backend(self) -> dict[str, Any]:
        return self.pd.stats()["backends"][BACKEND]

    def waiting(self) -> int:
        return sum(len(q) for q in self.pd.engine.queues.values())

    def state(self) -> str:
        """What a request leaves behind in the driver: the per-flow counters, the refusal
        counters, the requests counted and live, the queues (``stats()`` minus its clocks)."""
        s = self.pd.stats()
        keep = {k: s[k] for k in ("flows", "submitted", "live", "refused_other", "unclassified") if k in s}
        keep["queued"] = self.waiting()
        keep["metrics"] = len(getattr(self.pd.engine.metrics, "flows", ()) or ())
        return json.dumps(keep, sort_keys=True, default=str)


class FleetFace(Face):
    kind = "Dispatcher"

    def flow(self, name: str) -> Hashable:
        return name

    def submit(self, name: str, body: Any, **kw: Any) -> Any:
        return self.pd.submit(name, body, **kw)  # type: ignore[arg-type]

    def stream(self, name: str, body: Any, **kw: Any) -> Any:
        return self.pd.stream(name, body, **kw)  # type: ignore[arg-type]

    def row(self, name: str) -> dict[str, float] | None:
        r = self.pd.stats()["flows"].get(name)
        if r is None:
            return None
        return {"completed": r["completed"], "failed": r["failed"], "cancelled": r["cancelled"],
                "aborted": r["aborted"], "refused": r["refused"] + r["expired"] + r["unavailable"] + r["rejected"],
                "charged": r["charged_cost"]}


class PolicyFace(Face):
    kind = "PolicyDispatcher"

    def flow(self, name: str) -> Hashable:
        return sfq.Flow(name, "batch", "p")

    def submit(self, name: str, body: Any, **kw: Any) -> Any:
        return self.pd.submit_flow(self.flow(name), body, **kw)  # type: ignore[arg-type]

    def stream(self, name: str, body: Any, **kw: Any) -> Any:
        return self.pd.stream_flow(self.flow(name), body, **kw)  # type: ignore[arg-type]

    def row(self, name: str) -> dict[str, float] | None:
        r = self.pd.stats()["flows"].get(f"{name}/batch/p")
        if r is None:
            return None
        return {"completed": r["completed"], "failed": r["failed"], "cancelled": r["cancelled_before_start"],
                "aborted": r["cancelled_during_execution"], "refused": r["refused"], "charged": r["charged_cost"]}


@contextlib.asynccontextmanager
async def open_face(kind: str, fake: FakeServer, cost: str = SAME_COST,
                    clock: Callable[[], float] | None = None) -> AsyncIterator[Face]:
    """``kind``'s face on ``fake`` (``cost``: the PolicyDispatcher's ``cost:`` section; the
    Dispatcher runs its default estimator; ``clock``: an injected clock, default the loop's)."""
    be = OpenAIBackend(fake.url, name=BACKEND, max_in_flight=1)
    face: Face
    kw: dict[str, Any] = {} if clock is None else {"clock": clock}
    if kind == "Dispatcher":
        face = FleetFace(sfq.Dispatcher([be], health=HEALTH, max_attempts=1, **kw))
    else:
        face = PolicyFace(sfq.PolicyDispatcher(_policy(fake.url, cost=cost), backends={BACKEND: be}, health=HEALTH,
                                               **kw))
    async with face.pd:
        yield face
        json.dumps(face.pd.stats())  # whatever the case did, stats() stays JSON


@pytest.fixture(params=FACES)
async def face(request: pytest.FixtureRequest, fake: FakeServer) -> AsyncIterator[Face]:
    async with open_face(request.param, fake) as f:
        yield f


def _summary(exc: BaseException) -> tuple[Any, ...]:
    return (type(exc).__name__, getattr(exc, "http_status", None), getattr(exc, "param", None),
            getattr(exc, "reason", None))


async def attempt(face: Face, call: str, name: str, body: Any, **kw: Any) -> tuple[Any, ...]:
    """Run one request through ``call`` to its end: ``("ok", n)`` (``n``: events, or 1), or the
    ``SFQError``'s summary and where it was raised (``call``: calling the primitive;
    ``enter``: awaiting, entering or iterating it, where the contract says refusals happen)."""
    try:
        cm = getattr(face, call)(name, body, **kw)
    except sfq.SFQError as exc:
        return (*_summary(exc), "call")
    try:
        if call == "submit":
            await cm
            return ("ok", 1)
        if call == "acquire":
            async with cm as grant:
                grant.finish(USAGE)
            return ("ok", 1)
        async with cm as events:
            return ("ok", len([e async for e in events]))
    except sfq.SFQError as exc:
        return (*_summary(exc), "enter")


async def served_at_once(face: Face, name: str) -> None:
    """A request of ``name`` is granted without waiting for anything (no timer, no other request)."""
    async def go() -> None:
        async with face.acquire(name, BODY) as grant:
            grant.finish(USAGE)

    t = asyncio.get_running_loop().create_task(go())
    await settle()
    assert t.done(), f"{name!r} was not served at once (backend: {face.backend()})"
    await t


def _body_for(call: str, **kw: Any) -> dict[str, Any]:
    return {**(SBODY if call in ("stream", "open_stream") else BODY), **kw}


# ------------------------------------------------------------------ timeout= is the request's deadline
async def test_a_deadline_that_runs_out_while_waiting_is_a_504_and_nothing_reaches_the_upstream(
        face: Face, fake: FakeServer) -> None:
    async with face.acquire("holder", BODY) as held:  # the only slot: the pool is full, only the timer ends them
        seen = [await asyncio.wait_for(attempt(face, call, "late", _body_for(call), timeout=0.3), 10)
                for call in CALLS]
        held.finish(USAGE)
    assert seen == [("Refused", 504, None, "deadline", "enter")] * len(CALLS)
    assert fake.requests == []
    row = face.row("late")
    assert row is not None and row["refused"] == len(CALLS) and row["charged"] == 0
    assert face.waiting() == 0 and face.backend()["in_flight"] == 0


@pytest.mark.parametrize("call", ["stream", "open_stream"])
async def test_a_deadline_that_runs_out_while_streaming_ends_the_stream(face: Face, fake: FakeServer,
                                                                        call: str) -> None:
    fake.mode, fake.delay = "slow", 0.1  # 20 events, one per 0.1 s: a 2-s stream
    events = getattr(face, call)("s", {**SBODY, "max_tokens": 20}, timeout=0.3)
    got = []
    with pytest.raises(DeadlineExceeded) as info:  # (on entry too, were the first event slower than 0.3 s)
        async with events:
            async for ev in events:
                got.append(ev)
    with pytest.raises(StopAsyncIteration):  # the stream ended with its error
        await events.__anext__()
    assert _summary(info.value) == ("DeadlineExceeded", 504, None, None)
    assert len(got) < 20
    await wait_until(lambda: fake.disconnects == 1, "the upstream call to be aborted")
    row = face.row("s")
    assert row is not None and row["failed"] == 1 and face.backend()["in_flight"] == 0
    assert face.backend()["healthy"] and face.backend()["errors"] == 0  # the request's deadline, not the backend's


async def test_a_deadline_that_runs_out_while_a_plain_request_runs(face: Face, fake: FakeServer) -> None:
    fake.mode, fake.delay = "slow", 2.0
    with pytest.raises(DeadlineExceeded) as info:
        await face.submit("s", BODY, timeout=0.3)
    assert _summary(info.value) == ("DeadlineExceeded", 504, None, None)
    await wait_until(lambda: fake.disconnects == 1, "the upstream call to be aborted")
    row = face.row("s")
    assert row is not None and row["failed"] == 1 and face.backend()["in_flight"] == 0


# ------------------------------------------------------------------ max_wait= bounds only the wait for the turn
class Clock:
    """A clock the test moves by hand (the dispatcher's: waits and deadlines are measured on it)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def _moved(face: Face, clock: Clock, dt: float) -> None:
    """Move the clock by ``dt`` and let the dispatcher look at its queue (what its timer does
    when the loop's own time gets there)."""
    clock.t += dt
    face.pd._pump()
    await settle()


@pytest.mark.parametrize("kind", FACES)
async def test_max_wait_refuses_a_request_that_waited_that_long_and_never_cuts_a_running_one(
        fake: FakeServer, kind: str) -> None:
    """``max_wait=`` bounds only the wait for the turn: a request waiting behind a full pool
    ends once, refused ``queue_timeout`` (504) naming its ``max_wait``, through every call; the
    one running with the same ``max_wait`` runs on past it. Injected clock: no sleeps."""
    clock = Clock()
    async with open_face(kind, fake, clock=clock) as face:
        async with face.acquire("holder", BODY, max_wait=5.0) as held:  # the only slot
            for call in CALLS:
                task = asyncio.get_running_loop().create_task(
                    attempt(face, call, "waiter", _body_for(call), max_wait=5))
                await wait_until(lambda: face.waiting() == 1, "the request to wait for the only slot")
                await _moved(face, clock, 4.5)
                assert not task.done() and face.waiting() == 1
                await _moved(face, clock, 0.5)
                assert await asyncio.wait_for(task, 10) == ("Refused", 504, None, "queue_timeout", "enter")
                assert face.waiting() == 0
            await _moved(face, clock, 100.0)  # the holder runs on, 120 s past its max_wait
            assert face.backend()["in_flight"] == 1
            held.finish(USAGE)
        row, holder = face.row("waiter"), face.row("holder")
        assert row is not None and row["refused"] == len(CALLS) and row["charged"] == 0
        assert holder is not None and holder["completed"] == 1 and holder["refused"] == 0
        assert fake.requests == [] and face.waiting() == 0 and face.backend()["in_flight"] == 0
        with pytest.raises(Refused, match=r"max_wait \(5 s\) ran out before it started"):
            async with face.acquire("holder", BODY):
                task = asyncio.get_running_loop().create_task(face.submit("late", BODY, max_wait=5.0))
                await wait_until(lambda: face.waiting() == 1, "the request to wait")
                await _moved(face, clock, 5.0)
                await task
        assert await attempt(face, "submit", "late", BODY, max_wait=5.0) == ("ok", 1)  # a free slot: no wait


@pytest.mark.parametrize("kind", FACES)
@pytest.mark.parametrize(("timeout", "max_wait", "after", "reason"), [
    (3.0, 5.0, 3.0, "deadline"),  # the deadline is the sooner: it ends the wait
    (10.0, 5.0, 5.0, "queue_timeout"),  # max_wait is the sooner
])
async def test_max_wait_with_a_timeout_the_sooner_ends_the_wait(fake: FakeServer, kind: str, timeout: float,
                                                                 max_wait: float, after: float, reason: str) -> None:
    clock = Clock()
    async with open_face(kind, fake, clock=clock) as face:
        async with face.acquire("holder", BODY) as held:
            for call in CALLS:
                task = asyncio.get_running_loop().create_task(
                    attempt(face, call, "waiter", _body_for(call), timeout=timeout, max_wait=max_wait))
                await wait_until(lambda: face.waiting() == 1, "the request to wait for the only slot")
                await _moved(face, clock, after - 0.01)
                assert not task.done()
                await _moved(face, clock, 0.01)
                assert await asyncio.wait_for(task, 10) == ("Refused", 504, None, reason, "enter")
            held.finish(USAGE)
        # started within its max_wait, a request runs until its timeout, not its max_wait
        fake.mode, fake.delay = "slow", 0.05
        assert await attempt(face, "submit", "runs", BODY, timeout=timeout, max_wait=0.001) == ("ok", 1)
        assert fake.requests == [BODY]


#: bad ``timeout=`` and ``max_wait=`` values, and how each is written in the message
BAD_SECONDS = [(0, "0"), (-1, "-1"), (float("nan"), "nan"), (float("inf"), "inf"), (True, "True"),
               ("30", "'30'"), (10 ** 400, str(10 ** 400))]


@pytest.mark.parametrize("call", ["submit", "stream", "open_stream", "acquire", "permit"])
@pytest.mark.parametrize("arg", ["timeout", "max_wait"])
@pytest.mark.parametrize(("value", "written"), BAD_SECONDS, ids=[w[:8] for _, w in BAD_SECONDS])
async def test_a_bad_timeout_or_max_wait_is_a_400_sfq_error_that_changes_nothing(
        face: Face, fake: FakeServer, call: str, arg: str, value: Any, written: str) -> None:
    """A bad ``timeout=`` or ``max_wait=`` is an ``sfq.errors.InvalidTimeout`` (400, a
    ``BadRequest``, so a ``ValueError``), as a bad ``cost=`` is: an sfq error handler answers
    400, not 500; the message names the argument and the value; nothing is counted or
    queued."""
    await face.submit("warm", BODY)
    before = face.state()
    body = None if call == "permit" else _body_for(call)
    kw: dict[str, Any] = {arg: value}
    if call == "permit":
        kw["cost"] = 2.0
    seen = await attempt(face, "acquire" if call == "permit" else call, "a", body, **kw)
    assert seen == ("InvalidTimeout", 400, None, "bad_request", "enter")
    with pytest.raises(InvalidTimeout) as info:
        if call == "submit":
            await face.submit("a", body, **kw)
        else:
            async with getattr(face, "acquire" if call == "permit" else call)("a", body, **kw):
                pytest.fail(f"entered with {arg}={value!r}")
    exc = info.value
    assert isinstance(exc, ValueError) and isinstance(exc, BadRequest) and isinstance(exc, sfq.SFQError)
    assert str(exc) == f"{arg} must be a finite number of seconds > 0, got {written}"
    assert exc.http_status == 400 and exc.to_openai()["error"]["code"] == "bad_request"
    assert face.state() == before and fake.requests == [BODY]


async def test_a_bad_timeout_or_max_wait_of_a_joining_request_is_refused_first(fake: FakeServer) -> None:
    """``PolicyDispatcher.submit_flow`` under an ``idempotency_key`` checks both before it
    joins or starts anything."""
    async with open_face("PolicyDispatcher", fake) as face:
        for kw in ({"timeout": 0}, {"max_wait": "5"}):
            with pytest.raises(InvalidTimeout):
                await face.pd.submit_flow(sfq.Flow("a", "batch", "p"), BODY, idempotency_key="k", **kw)
        assert fake.requests == [] and face.pd.stats()["submitted"] == 0


# ------------------------------------------------------------------ max_tokens: 10**9
async def _answers_to_a_billion(fake: FakeServer, cost: str) -> dict[str, list[tuple[Any, ...]]]:
    fake.output = lambda body: 2  # whatever is asked, the fake writes two tokens
    answers: dict[str, list[tuple[Any, ...]]] = {}
    for kind in FACES:
        async with open_face(kind, fake, cost) as face:
            answers[kind] = [await attempt(face, call, f"big-{call}", _body_for(call, max_tokens=10**9))
                             for call in CALLS]
            answers[kind].append(("healthy", face.backend()["healthy"], "waiting", face.waiting()))
    return answers


async def test_max_tokens_of_a_billion_gets_the_same_answer_on_both_faces(fake: FakeServer) -> None:
    answers = await _answers_to_a_billion(fake, SAME_COST)
    assert answers["Dispatcher"] == answers["PolicyDispatcher"], answers


async def test_max_tokens_of_a_billion_with_each_faces_default_cost_model(fake: FakeServer) -> None:
    """A token cap (``sfq.cost.MAX_OUTPUT_TOKENS``), not a cost cap: the same 400 under a
    Dispatcher's ``CostEstimator()`` (output weight 1) and a policy file's (2)."""
    answers = await _answers_to_a_billion(fake, "")
    assert answers["Dispatcher"] == answers["PolicyDispatcher"], answers


# ------------------------------------------------------------------ bodies that are not JSON objects
@pytest.mark.parametrize("bad", [[1, 2], "text", 42, None], ids=["list", "str", "int", "None"])
@pytest.mark.parametrize("call", CALLS)
async def test_a_body_that_is_not_an_object_is_a_400_that_leaves_nothing(face: Face, fake: FakeServer, call: str,
                                                                          bad: Any) -> None:
    await face.submit("warm", BODY)  # the flow rows exist: a refusal must not change them
    before = face.state()
    seen = await attempt(face, call, "bad", bad)
    assert seen == ("BadRequest", 400, None, "bad_request", "enter")
    assert face.state() == before and face.row("bad") is None
    assert len(fake.requests) == 1


@pytest.mark.parametrize("call, body", [
    ("submit", {**BODY, "stream": True}),
    ("stream", {**BODY, "stream": False}),
    ("open_stream", {**BODY, "stream": False}),
], ids=["submit-stream-true", "stream-stream-false", "open_stream-stream-false"])
async def test_a_body_for_the_other_kind_of_call_names_stream(face: Face, fake: FakeServer, call: str,
                                                              body: dict[str, Any]) -> None:
    before = face.state()
    assert await attempt(face, call, "x", body) == ("BadRequest", 400, "stream", "bad_request", "enter")
    assert face.state() == before and fake.requests == []


async def test_a_fleet_of_several_models_refuses_a_body_that_is_not_an_object_on_entry(fake: FakeServer) -> None:
    """No pool can be read from such a body: still a 400 on entry, not a 404 (``UnknownModel``)."""
    fleet = [OpenAIBackend(fake.url, name="one", model="m"), OpenAIBackend(fake.url, name="two", model="n")]
    async with sfq.Dispatcher(fleet) as d:
        for call in ("stream", "open_stream", "acquire"):
            cm = getattr(d, call)("a", [1, 2])
            with pytest.raises(BadRequest):
                async with cm:
                    pytest.fail("entered with a body that is not an object")
        assert d.stats()["flows"] == {} and fake.requests == []


# ------------------------------------------------------------------ a permit without a body
async def test_a_permit_with_cost_and_no_body(face: Face, fake: FakeServer) -> None:
    async with face.acquire("p", cost=300) as grant:
        assert grant.url == f"{fake.url}/v1" and grant.url.endswith("/v1")
        assert grant.backend.name == BACKEND
        grant.finish(None)
    row = face.row("p")
    assert row is not None and row["completed"] == 1 and row["charged"] == 300
    with pytest.raises(BadRequest) as info:
        async with face.acquire("p"):
            pytest.fail("a permit with neither a body nor a cost was granted")
    assert _summary(info.value) == ("BadRequest", 400, None, "bad_request")
    assert fake.requests == []


# ------------------------------------------------------------------ whose fault: the embedder's or the backend's
@pytest.mark.parametrize("error", [KeyError, ValueError, RuntimeError])
@pytest.mark.parametrize("times", [3, 5, 10])
async def test_the_embedders_own_exception_never_counts_against_the_backend(face: Face, fake: FakeServer,
                                                                            times: int, error: type) -> None:
    for i in range(times):  # two flows taking turns: what would take the backend out, were these 5xx
        with pytest.raises(error):
            async with face.acquire("ab"[i % 2], BODY):
                raise error("the embedder's own bug")
    b = face.backend()
    assert b["healthy"] is True and b["in_flight"] == 0
    assert b["errors"] == 0 and b["recent_5xx"] == 0 and b["down_reason"] is None
    rows = [face.row(f) for f in "ab"]
    assert [r["failed"] for r in rows if r] == [(times + 1) // 2, times // 2]
    await served_at_once(face, "c")
    assert fake.requests == []


#: the health rule (sfq.backends.health.ReplyWindow.verdict, defaults: window 20, rate 0.5): the
#: verdict is asked once 5 of the window's replies are 5xx; with two flows or more, the flow with
#: the most 5xx is left out and the others' must be at least 5 and half of their replies. Flows
#: a and b taking turns: 3 (a 2, b 1) and 5 (a 3, b 2) keep it; 10 (a 5, b 5) take it out.
KEPT = {3: True, 5: True, 10: False}


@pytest.mark.parametrize("how", ["fail", "raise"])
@pytest.mark.parametrize("times", [3, 5, 10])
async def test_reported_5xx_count_toward_the_backends_health(face: Face, fake: FakeServer, times: int,
                                                             how: str) -> None:
    for i in range(times):
        flow = "ab"[i % 2]
        if how == "fail":
            async with face.acquire(flow, BODY) as grant:
                grant.fail(status=502)
        else:
            with pytest.raises(BackendHTTPError):
                async with face.acquire(flow, BODY) as grant:
                    raise BackendHTTPError("the upstream answered 500", backend=grant.backend.name, status=500,
                                           unhealthy=True)
    b = face.backend()
    assert b["errors"] == times and b["recent_5xx"] == times and b["in_flight"] == 0
    assert b["healthy"] is KEPT[times], b
    rows = [face.row(f) for f in "ab"]
    assert [r["failed"] for r in rows if r] == [(times + 1) // 2, times // 2]
    if KEPT[times]:
        await served_at_once(face, "c")
    assert fake.requests == []


async def test_one_tenants_5xx_among_others_never_take_the_backend_out(face: Face) -> None:
    for _ in range(10):
        async with face.acquire("b", BODY) as grant:
            grant.finish(USAGE)
    for _ in range(10):
        async with face.acquire("a", BODY) as grant:
            grant.fail(status=502)
    b = face.backend()
    assert b["healthy"] is True and b["recent_5xx"] == 10
    await served_at_once(face, "c")


async def test_a_backend_only_one_tenant_uses_leaves_when_its_health_check_fails_too(face: Face,
                                                                                       fake: FakeServer) -> None:
    """The rule's other half: with no other flow to compare with, 10 of the last 20 replies as
    5xx make the dispatcher check the backend itself; it leaves only if that check fails too
    (a single-tenant deployment still loses a broken backend; one tenant's word alone never
    takes it out)."""
    monitor = face.pd.monitor_of(BACKEND)
    for _ in range(10):
        async with face.acquire("a", BODY) as grant:
            grant.fail(status=502)
    await wait_until(lambda: monitor._confirm is None and fake.health_calls, "the health check")
    assert face.backend()["healthy"] is True and monitor.confirmations == 1 and face.backend()["recent_5xx"] == 0
    fake.health_status = 500
    for _ in range(10):
        async with face.acquire("a", BODY) as grant:
            grant.fail(status=502)
    await wait_until(lambda: not face.backend()["healthy"], "the failed check to take it out")
    assert monitor.confirmations == 2 and "health check failed too" in face.backend()["down_reason"]


@pytest.mark.parametrize("how", ["fail", "raise"])
async def test_one_tenants_failures_without_a_status_never_eject_the_backend_for_the_others(
        face: Face, fake: FakeServer, how: str) -> None:
    """Three ``grant.fail()`` without a status in a row (no answer: a transport failure), all of
    one tenant, used to take the backend out for every tenant; now the dispatcher checks the
    backend, which answers, and the others are served at once. Two tenants' failures do take
    it out."""
    monitor = face.pd.monitor_of(BACKEND)

    async def fail(flow: str) -> None:
        if how == "fail":
            async with face.acquire(flow, BODY) as grant:
                grant.fail()
        else:
            with pytest.raises(sfq.errors.BackendUnavailable):
                async with face.acquire(flow, BODY) as grant:
                    raise sfq.errors.BackendUnavailable("reset", backend=grant.backend.name)

    for _ in range(3):
        await fail("a")
    await wait_until(lambda: monitor._confirm is None and fake.health_calls, "the health check")
    assert face.backend()["healthy"] is True and monitor.confirmations == 1
    for other in ("b", "c", "d"):
        await served_at_once(face, other)
    for flow in ("a", "b", "a"):  # three in a row again, from two tenants
        await fail(flow)
    assert face.backend()["healthy"] is False and monitor.confirmations == 1


async def test_a_429_pauses_the_backend_and_a_bad_report_leaves_the_grant_usable(face: Face) -> None:
    async with face.acquire("a", BODY) as grant:
        with pytest.raises(ValueError):
            grant.fail(status=99)
        with pytest.raises(ValueError):
            grant.fail(retry_after=-1)
        assert face.backend()["in_flight"] == 1  # still held: nothing was reported
        grant.delivered(2)
        grant.finish(USAGE)
    row = face.row("a")
    assert row is not None and row["completed"] == 1 and row["failed"] == 0
    async with face.acquire("b", BODY) as grant:
        grant.fail(status=429, retry_after=2)
    b = face.backend()
    assert b["paused"] is True and b["paused_for"] > 0 and b["rate_limited"] == 1
    assert b["healthy"] is True and b["in_flight"] == 0 and b["recent_5xx"] == 0


# ------------------------------------------------------------------ an upstream 4xx
CHAT = {"model": "m", "messages": [{"role": "user", "content": "a very long conversation"}], "max_tokens": 4}


@pytest.mark.parametrize("call", ["submit", "open_stream"])
async def test_an_upstream_context_length_error_reaches_the_caller_redacted(face: Face, fake: FakeServer,
                                                                            call: str) -> None:
    fake.mode, fake.error_body = "400", CONTEXT_ERROR
    body = {**CHAT, "stream": True} if call == "open_stream" else CHAT
    with pytest.raises(BackendHTTPError) as info:
        if call == "submit":
            await face.submit("a", body)
        else:
            async with face.open_stream("a", body):
                pytest.fail("a stream opened on an upstream 400")
    exc = info.value
    err = exc.to_openai()["error"]
    assert exc.http_status == 400 and exc.status == 400
    assert err["message"].startswith("This model's maximum context length is 8192 tokens.")
    assert "sk-abcdefgh1234567" not in err["message"] and "10.0.0.5" not in err["message"]
    assert "http://" not in err["message"] and "[redacted]" in err["message"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "messages", "context_length_exceeded")
    assert len(fake.requests) == 1  # a 400 is the client's to fix: never retried
    assert face.backend()["healthy"] and face.backend()["recent_5xx"] == 0


#: the upstream's status -> (the caller's status, OpenAI code); 401, 403 and 429 are the
#: gateway's own business (its key, its rate), never passed through
UPSTREAM_4XX = {"400": (400, None), "401": (502, "upstream_error"), "403": (502, "upstream_error"),
                "429": (503, "upstream_rate_limited")}


@pytest.mark.parametrize("call", ["submit", "open_stream"])
@pytest.mark.parametrize("mode", sorted(UPSTREAM_4XX))
async def test_which_upstream_4xx_pass_through(face: Face, fake: FakeServer, mode: str, call: str) -> None:
    fake.mode = mode
    fake.error_body = {"error": {"message": "invalid key sk-abcdefgh1234567 at http://10.0.0.5:8000",
                                 "type": "invalid_request_error", "code": "invalid_api_key"}}
    body = CHAT if call == "submit" else {**CHAT, "stream": True}
    seen = await attempt(face, call, "a", body)
    status, code = UPSTREAM_4XX[mode]
    assert seen[1:] == (status, None, None, "enter") and seen[0] in ("BackendHTTPError", "BackendRateLimited")
    with pytest.raises(BackendHTTPError) as info:
        await face.submit("a", CHAT)
    err = info.value.to_openai()["error"]
    assert info.value.http_status == status and info.value.status == int(mode)
    assert "sk-abcdefgh1234567" not in err["message"] and "10.0.0.5" not in err["message"]
    if code is not None:  # not the upstream's words: the gateway's own
        assert err["code"] == code and "invalid key" not in err["message"]
    else:
        assert err["code"] == "invalid_api_key" and err["message"].startswith("invalid key [redacted]")


# ------------------------------------------------------------------ stats()
async def test_stats_is_json_after_every_kind_of_ending(face: Face, fake: FakeServer) -> None:
    await face.submit("done", BODY)
    assert (await attempt(face, "open_stream", "streamed", SBODY))[0] == "ok"
    await attempt(face, "submit", "bad", [1, 2])
    await attempt(face, "submit", "bad-tokens", {**BODY, "max_tokens": "abc"})
    fake.mode = "500"
    await attempt(face, "submit", "failed", BODY)
    fake.mode = "ok"
    async with face.acquire("holder", BODY) as held:
        await attempt(face, "acquire", "late", BODY, timeout=0.05)
        held.finish(USAGE)
    text = json.dumps(face.pd.stats())
    assert json.loads(text)["backends"][BACKEND]["completed"] >= 2


# ------------------------------------------------------------------ cancelled while it waits
@pytest.mark.parametrize("call", ["submit", "open_stream", "acquire"])
async def test_a_request_cancelled_while_it_waits_is_removed_uncharged(face: Face, fake: FakeServer,
                                                                       call: str) -> None:
    async with face.acquire("holder", BODY) as held:
        t = asyncio.get_running_loop().create_task(attempt(face, call, "waiter", _body_for(call)))
        await wait_until(lambda: face.waiting() == 1, "the request to wait for the only slot")
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert face.waiting() == 0
        held.finish(USAGE)
    row = face.row("waiter")
    assert row is not None and row["cancelled"] == 1 and row["charged"] == 0 and row["completed"] == 0
    await face.submit("after", {**BODY, "prompt": "after"})  # it reaches the upstream; the cancelled one never did
    assert [b["prompt"] for b in fake.requests] == ["after"]


# ------------------------------------------------------------------ refused flows leave no state
def _shape(v: Any) -> Any:
    """``v`` with every number made 0: what a refusal may change (counts) and may not (keys)."""
    if isinstance(v, dict):
        return {k: _shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_shape(x) for x in v]
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return 0
    return v


async def _refuse_orgs(pd: sfq.PolicyDispatcher, prefix: str, n: int) -> None:
    for i in range(n):
        try:
            await pd.submit_flow(sfq.Flow(f"{prefix}-{i}", "batch", "p"), BODY)
        except Refused as exc:
            if exc.reason != "unknown_org" or exc.http_status != 403:
                raise
        else:
            raise AssertionError(f"org {prefix}-{i} was served")


async def test_refused_orgs_leave_no_state(fake: FakeServer) -> None:
    be = OpenAIBackend(fake.url, name=BACKEND, max_in_flight=1)
    async with sfq.PolicyDispatcher(_policy(fake.url, template=False), backends={BACKEND: be},
                                    health=HEALTH) as pd:
        await pd.submit_flow(sfq.Flow("acme", "batch", "p"), BODY)
        await _refuse_orgs(pd, "warm", 100)  # the one row of every made-up org exists
        flows0, shape0 = len(pd.engine.metrics.flows), _shape(pd.stats())
        lines0 = len(prometheus_client.generate_latest(pd.registry).splitlines())

        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            await _refuse_orgs(pd, "made-up", 20_000)
            gc.collect()
            growth = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        print(f"\ntracemalloc growth for 20,000 refused orgs: {growth} bytes")
        assert len(pd.engine.metrics.flows) == flows0
        assert _shape(pd.stats()) == shape0  # the same keys: only the counts grew
        other = [v for k, v in pd.stats()["flows"].items() if k.startswith("_other/")]
        assert len(other) == 1 and other[0]["refused"] == 20_100 and other[0]["reasons"] == {"unknown_org": 20_100}
        assert growth < 2 << 20

        await _refuse_orgs(pd, "scraped", 2_000)
        assert len(prometheus_client.generate_latest(pd.registry).splitlines()) == lines0
        assert fake.requests == [BODY]


async def test_names_refused_for_their_body_leave_no_state_on_either_face(face: Face,
                                                                          request: pytest.FixtureRequest) -> None:
    """Any name is allowed (a flow id; an org of the template), but its request is refused for
    its body: the names never grow the counters, the stats or the memory."""
    bad = {**BODY, "max_tokens": "abc"}

    async def refuse(prefix: str, n: int) -> None:
        for i in range(n):
            assert await attempt(face, "submit", f"{prefix}-{i}", bad) == ("BadRequest", 400, "max_tokens",
                                                                           "bad_request", "enter")

    await refuse("warm", 100)
    shape0, metrics0 = _shape(face.pd.stats()), len(getattr(face.pd.engine.metrics, "flows", None) or ())
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        await refuse("made-up", 20_000)
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    print(f"\n{face.kind}: tracemalloc growth for 20,000 names refused for their body: {growth} bytes")
    assert _shape(face.pd.stats()) == shape0
    assert len(getattr(face.pd.engine.metrics, "flows", None) or ()) == metrics0
    assert growth < 2 << 20


# ------------------------------------------------------------------ a bad cost= is the request's error
#: bad ``cost=`` values, the sfq error each is, and its message (the scheduler core's own check)
BAD_COSTS = [
    (0, "InvalidCost", "cost must be a finite number > 0, got 0"),
    (-1, "InvalidCost", "cost must be a finite number > 0, got -1"),
    (float("nan"), "InvalidCost", "cost must be a finite number > 0, got nan"),
    (float("inf"), "InvalidCost", "cost must be a finite number > 0, got inf"),
    ("abc", "InvalidCostType", "cost must be a real number, got 'abc' of type str"),
    (True, "InvalidCostType", "cost must be a real number, got True of type bool"),
    (2.0 ** 40, "InvalidCost", "cost 1099511627776.0 is too large: the largest cost whose charge can be represented is "
                               "1073741824"),
]


@pytest.mark.parametrize("call", ["submit", "open_stream", "acquire", "permit"])
@pytest.mark.parametrize(("cost", "kind", "message"), BAD_COSTS, ids=[repr(c) for c, _, _ in BAD_COSTS])
async def test_a_bad_cost_is_a_400_sfq_error_that_changes_nothing(face: Face, fake: FakeServer, call: str,
                                                                   cost: Any, kind: str, message: str) -> None:
    """A bad ``cost=`` is an ``sfq.errors.InvalidCost`` (400, a ``ValueError``; a non-number
    also a ``TypeError``), so an sfq error handler answers it 400, not 500; the message is
    the core's, the same on both engines; nothing is counted or queued."""
    await face.submit("warm", BODY)
    before = face.state()
    body = None if call == "permit" else SBODY if call == "open_stream" else BODY
    with pytest.raises(sfq.SFQError) as info:
        if call == "submit":
            await face.submit("a", body, cost=cost)
        else:
            async with (face.open_stream if call == "open_stream" else face.acquire)("a", body, cost=cost):
                pytest.fail("entered with a bad cost")
    exc = info.value
    assert type(exc).__name__ == kind and type(exc) is getattr(sfq.errors, kind)
    assert isinstance(exc, ValueError) and isinstance(exc, TypeError) is (kind == "InvalidCostType")
    assert str(exc) == message and exc.http_status == 400 and exc.to_openai()["error"]["code"] == "bad_request"
    assert face.state() == before and fake.requests == [BODY]


async def test_stats_has_string_keys_whatever_the_flow_ids(fake: FakeServer) -> None:
    """``stats()`` is JSON that ``orjson`` takes (string keys only): flow ids that are numbers,
    ``None`` or tuples, and a fleet's default pool (model ``None``), are keyed as ``json.dumps``
    writes them."""
    import orjson

    be = OpenAIBackend(fake.url, name=BACKEND, max_in_flight=1)
    async with sfq.Dispatcher([be], health=HEALTH) as d:
        for flow in ("a", 1, 2.5, None, False, ("t", 3)):
            async with d.acquire(flow, cost=2.0):
                pass
        s = d.stats()
        assert orjson.loads(orjson.dumps(s)) == json.loads(json.dumps(s))
        assert sorted(s["flows"]) == sorted(["a", "1", "2.5", "null", "false", "('t', 3)"])
        assert list(s["pools"]) == ["null"] and s["backends"][BACKEND]["completed"] == 6
    pd = sfq.PolicyDispatcher(_policy(fake.url), backends={BACKEND: OpenAIBackend(fake.url, name=BACKEND)},
                              health=HEALTH)
    async with pd:
        async with pd.acquire(sfq.Flow("acme", "batch", "p"), cost=2.0):
            pass
        orjson.dumps(pd.stats())


async def test_flows_served_once_cost_nothing_once_idle(fake: FakeServer) -> None:
    """20,000 made-up flow ids, each served once (a permit), then idle past the retry window
    and ``forget_idle_after``: the Dispatcher forgets them (retry budgets, stats rows, the
    core's meters, its memo of ids), measured with tracemalloc on an injected clock (it used
    to keep ~9 MB even with ``max_flow_stats=1000``, ~29 MB by default)."""
    now = [0.0]
    d = sfq.Dispatcher([OpenAIBackend(fake.url, name=BACKEND, max_in_flight=4)], health=HEALTH,
                       clock=lambda: now[0])
    async with d:
        for i in range(100):
            async with d.acquire(f"warm-{i}", cost=5.0):
                pass
        now[0] += 1000.0
        d.forget_idle()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(20_000):
                async with d.acquire(f"made-up-{i}", cost=5.0):
                    pass
                now[0] += 0.001
            assert len(d.stats()["flows"]) == 20_000  # recent: kept
            now[0] += 61.0  # idle past the window and forget_idle_after
            assert d.forget_idle() >= 40_000  # their retry budgets and their rows
            gc.collect()
            growth = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        print(f"\ntracemalloc growth for 20,000 flows served once, once idle: {growth} bytes")
        assert d.stats()["flows"] == {} and d.tally.forgotten >= 20_000
        assert d.scheduler_of(None).known_flows == 0
        assert growth < 2 << 20
        async with d.acquire("made-up-7", cost=5.0):  # a forgotten flow comes back as a fresh one
            pass
        assert d.flow_stats("made-up-7")["completed"] == 1


async def test_orgs_of_the_template_served_once_cost_nothing_once_idle(fake: FakeServer) -> None:
    """20,000 made-up orgs of a policy's ``org_template`` (with limits of their own), each
    served once (a permit), then idle past the retry window and the metrics' share window: the
    PolicyDispatcher forgets them (their specs, retry budgets, rate buckets, slots, counters
    and series), measured with tracemalloc on an injected clock (it used to keep 33.6 MB)."""
    now = [0.0]
    policy = parse_policy(f"""\
pools:
  p: {{models: [m], backends: [{{url: "{fake.url}", name: {BACKEND}, max_in_flight: 4}}]}}
classes:
  batch: {{weight: 1}}
orgs:
  acme: {{classes: [batch]}}
org_template: {{classes: [batch], requests_per_minute: 600, max_in_flight: 2}}
""")
    be = OpenAIBackend(fake.url, name=BACKEND, max_in_flight=4)
    pd = sfq.PolicyDispatcher(policy, backends={BACKEND: be}, health=HEALTH, clock=lambda: now[0])
    async with pd:
        for i in range(100):
            async with pd.acquire(sfq.Flow(f"warm-{i}", "batch", "p"), cost=5.0):
                pass
        async with pd.acquire(sfq.Flow("acme", "batch", "p"), cost=5.0):
            pass
        now[0] += 1000.0
        pd.forget_idle()
        lines0 = len(prometheus_client.generate_latest(pd.registry).splitlines())
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(20_000):
                async with pd.acquire(sfq.Flow(f"made-up-{i}", "batch", "p"), cost=5.0):
                    pass
                now[0] += 0.001
                if i % 5000 == 0:
                    prometheus_client.generate_latest(pd.registry)  # (scraped meanwhile: labels given out)
            assert len(pd.stats()["flows"]) == 20_001  # recent: kept
            now[0] += 61.0  # idle past the retry window and the share window
            assert pd.forget_idle() >= 60_000  # their specs, retry budgets and counters
            gc.collect()
            growth = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        print(f"\ntracemalloc growth for 20,000 template orgs served once, once idle: {growth} bytes")
        assert list(pd.stats()["flows"]) == ["acme/batch/p"]  # the org the file names is kept
        assert policy.made_orgs() == [] and pd.engine.org_rate == {} and pd.engine.shared.slots == {}
        assert pd.engine.queues["p"].sched.known_flows == 0
        assert len(prometheus_client.generate_latest(pd.registry).splitlines()) <= lines0
        assert growth < 2 << 20
        async with pd.acquire(sfq.Flow("made-up-7", "batch", "p"), cost=5.0):  # a fresh org again
            pass
        assert pd.stats()["flows"]["made-up-7/batch/p"]["completed"] == 1

