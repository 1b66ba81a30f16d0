"""sfq.asgi driven through raw ASGI ``receive``/``send`` pairs (no server), with a real
PolicyDispatcher in front of the loopback upstream of tests/policy/fake_openai.py: a client that
leaves while its request waits withdraws it uncharged and logs nothing; every SFQError is the
OpenAI-shaped answer with its Retry-After; the stream responses frame server-sent events and
close what they hold when the body ends or the client leaves."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

import sfq  # noqa: E402
from sfq import asgi as sfq_asgi  # noqa: E402
from support.proxies import fake_openai, serving  # noqa: E402

FLOW = sfq.Flow(org="acme", cls="batch", pool="gpu")


class Client:
    """One request's ASGI ``receive``/``send`` pair: the body, then nothing until :meth:`leave`."""

    def __init__(self, body: bytes = b"") -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.inbox.put_nowait({"type": "http.request", "body": body, "more_body": False})
        self.sent: list[MutableMapping[str, Any]] = []
        self.receiving = 0  # receive() calls pending now

    async def receive(self) -> dict[str, Any]:
        self.receiving += 1
        try:
            return await self.inbox.get()
        finally:
            self.receiving -= 1

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(message)

    def leave(self) -> None:
        self.inbox.put_nowait({"type": "http.disconnect"})

    def request(self) -> Request:
        scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
        return Request(scope, self.receive)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.sent[0]["headers"]}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])

    @property
    def complete(self) -> bool:
        return bool(self.sent) and self.sent[-1]["type"] == "http.response.body" and not self.sent[-1]["more_body"]


SCOPE = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b"",
         "asgi": {"version": "3.0", "spec_version": "2.3"}}


async def _until(cond: Any, what: str, limit: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + limit
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def upstream() -> AsyncIterator[Any]:
    async with serving(fake_openai()()) as up:
        yield up


@pytest.fixture
async def pd(upstream: Any) -> AsyncIterator[sfq.PolicyDispatcher]:
    policy = sfq.parse_policy(textwrap.dedent(f"""\
        pools:
          gpu: {{models: [m], backends: [{{url: "{upstream.url}", max_in_flight: 1}}]}}
        classes:
          batch: {{weight: 1}}
        orgs:
          acme: {{classes: [batch]}}
        """))
    async with sfq.PolicyDispatcher(policy) as d:
        yield d


@pytest.fixture
def quiet(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every log record of every logger; the test asserts none is a warning or carries a traceback."""
    caplog.set_level(logging.DEBUG)
    yield caplog
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [f"{r.name}: {r.getMessage()}" for r in loud]


def _flow(pd: sfq.PolicyDispatcher) -> dict[str, Any]:
    out: dict[str, Any] = pd.stats()["flows"]["acme/batch/gpu"]
    return out


BODY = {"model": "m", "prompt": "hi", "max_tokens": 3}


# ---------------------------------------------------------------- waiting while the client may leave
async def test_a_client_that_leaves_while_waiting_withdraws_the_request_quietly(
        pd: sfq.PolicyDispatcher, upstream: Any, quiet: pytest.LogCaptureFixture) -> None:
    async with pd.acquire(FLOW, BODY) as holder:  # the only slot is taken
        client = Client(json.dumps(BODY).encode())
        request = client.request()
        assert await request.json() == BODY  # the handler read the body first

        async def handler() -> str:
            try:
                async with sfq_asgi.enter(request, pd.acquire(FLOW, BODY)):
                    return "served"
            except sfq_asgi.ClientDisconnected as exc:
                assert exc.http_status == 499 and isinstance(exc, sfq.SFQError)
                task = asyncio.current_task()
                assert task is not None and getattr(task, "cancelling", lambda: 0)() == 0  # not left cancelling
                await asyncio.sleep(0)  # the handler goes on
                return "left"

        task = asyncio.create_task(handler())
        await _until(lambda: _flow(pd)["waiting"] == 1, "the request to wait its turn")
        client.leave()
        assert await asyncio.wait_for(task, 5) == "left"
        assert _flow(pd)["waiting"] == 0 and _flow(pd)["cancelled_before_start"] == 1
        holder.finish({"prompt_tokens": 1, "completion_tokens": 1})
    assert upstream.requests == []  # nothing reached the upstream (the holder made no call)
    assert client.receiving == 0
    assert await request.json() == BODY


async def test_a_raw_receive_works_and_the_watch_ends_with_the_wait(pd: sfq.PolicyDispatcher) -> None:
    client = Client()
    await client.receive()  # the body, read by the app
    grant = await sfq_asgi.enter(client.receive, pd.acquire(FLOW, BODY))  # its turn at once
    assert grant.url.endswith("/v1/completions")
    await asyncio.sleep(0)
    assert client.receiving == 0  # the watch is over: the response may read receive itself
    assert _flow(pd)["in_flight"] == 1
    grant.finish({"prompt_tokens": 1, "completion_tokens": 1})


async def test_a_disconnect_cancels_a_wait_that_would_never_end(quiet: pytest.LogCaptureFixture) -> None:
    ended: list[str] = []

    class Forever:  # any async context manager: sfq.Dispatcher's, PolicyDispatcher's, yours
        async def __aenter__(self) -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                ended.append("cancelled")
                raise

        async def __aexit__(self, *exc: object) -> None:
            ended.append("exited")

    client = Client()
    await client.receive()
    task = asyncio.create_task(sfq_asgi.enter(client.receive, Forever()).__aenter__())
    await asyncio.sleep(0.05)
    client.leave()
    with pytest.raises(sfq_asgi.ClientDisconnected):
        await asyncio.wait_for(task, 5)
    assert ended == ["cancelled"]


async def test_a_receive_that_never_blocks_is_not_watched_forever(pd: sfq.PolicyDispatcher) -> None:
    async def receive() -> dict[str, Any]:  # a server that answers at once, whatever was read
        return {"type": "http.request", "body": b"", "more_body": False}

    async with pd.acquire(FLOW, BODY) as holder:
        turn = sfq_asgi.enter(receive, pd.acquire(FLOW, BODY))
        task = asyncio.create_task(turn.__aenter__())
        await _until(lambda: _flow(pd)["waiting"] == 1, "the request to wait its turn")  # the loop runs
        holder.finish({"prompt_tokens": 1, "completion_tokens": 1})
    grant = await asyncio.wait_for(task, 5)
    grant.finish({"prompt_tokens": 1, "completion_tokens": 1})
    await turn.aclose()
    assert _flow(pd)["completed"] == 2


async def test_a_cancel_from_elsewhere_stays_a_cancel(pd: sfq.PolicyDispatcher) -> None:
    async with pd.acquire(FLOW, BODY):
        client = Client()
        await client.receive()
        task = asyncio.create_task(sfq_asgi.enter(client.receive, pd.acquire(FLOW, BODY)).__aenter__())
        await _until(lambda: _flow(pd)["waiting"] == 1, "the request to wait its turn")
        task.cancel()  # the server's, say: not the client's leaving
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _flow(pd)["cancelled_before_start"] == 1


async def test_sfq_dispatcher_is_waited_for_the_same_way(upstream: Any, quiet: pytest.LogCaptureFixture) -> None:
    async with sfq.Dispatcher([sfq.OpenAIBackend(upstream.url, max_in_flight=1)]) as d:
        async with d.acquire("team-a", BODY):  # the only slot is taken
            client = Client()
            await client.receive()
            task = asyncio.create_task(sfq_asgi.enter(client.receive, d.acquire("team-b", BODY)).__aenter__())
            await _until(lambda: d.stats()["flows"].get("team-b", {}).get("waiting") == 1, "team-b to wait")
            client.leave()
            with pytest.raises(sfq_asgi.ClientDisconnected):
                await asyncio.wait_for(task, 5)
            assert d.stats()["flows"]["team-b"]["waiting"] == 0
        client = Client()
        await client.receive()
        events = await sfq_asgi.enter(client.receive, d.open_stream("team-b", {**BODY, "stream": True}))
        await sfq_asgi.EventStreamResponse(events)(SCOPE, client.receive, client.send)
        assert client.body.endswith(b"data: [DONE]\n\n") and client.body.count(b'"text":"t') == 3
        assert d.stats()["flows"]["team-b"]["completed"] == 1
    assert _prompts_of(upstream) == ["hi"]  # team-b's first request never reached it


def _prompts_of(upstream: Any) -> list[str]:
    return [str(b.get("prompt")) for b in upstream.requests]


# ---------------------------------------------------------------- errors
def _retry_after(exc: sfq.SFQError, seconds: float) -> sfq.SFQError:
    exc.retry_after = seconds
    return exc


@pytest.mark.parametrize("exc, status, retry_after", [
    (sfq.errors.BadRequest("'max_tokens' must be an integer", param="max_tokens"), 400, None),
    (sfq.Refused("rate_limited", "over the org's rate", retry_after=0.2), 429, "1"),
    (_retry_after(sfq.errors.NoHealthyBackend("no backend"), 2.1), 503, "3"),
    (sfq.Refused("queue_timeout", "waited too long"), 504, None),
    (sfq_asgi.ClientDisconnected(), 499, None),
])
async def test_every_sfq_error_is_the_openai_answer(exc: sfq.SFQError, status: int, retry_after: str | None) -> None:
    async def endpoint(request: Request) -> Response:
        raise exc

    app = Starlette(routes=[Route("/", endpoint, methods=["POST"])])
    app.add_exception_handler(sfq.SFQError, sfq_asgi.error_response_handler)
    client = Client()
    await app(SCOPE, client.receive, client.send)
    assert client.status == status == exc.http_status
    assert client.headers.get("retry-after") == retry_after
    # to the millisecond where the wait is known that closely (an org's rate), as sfq serve says it
    assert client.headers.get("retry-after-ms") == ("200" if getattr(exc, "reason", "") == "rate_limited" else None)
    assert client.headers["content-type"] == "application/json"
    assert json.loads(client.body) == exc.to_openai()
    direct = sfq_asgi.error_response(exc)
    assert direct.status_code == status and direct.headers.get("retry-after") == retry_after


async def test_max_wait_and_a_bad_timeout_are_answered_the_openai_way(upstream: Any) -> None:
    """Through ``sfq.asgi``: a request whose ``max_wait`` runs out while it waits its turn is
    answered 504 (``queue_timeout``), a bad ``timeout=`` or ``max_wait=`` 400 (an sfq error,
    not a plain ``ValueError`` answered 500), both by ``error_response_handler``. Injected
    clock: no sleeps."""
    now = [0.0]
    policy = sfq.parse_policy(textwrap.dedent(f"""\
        pools:
          gpu: {{models: [m], backends: [{{url: "{upstream.url}", max_in_flight: 1}}]}}
        classes:
          batch: {{weight: 1}}
        orgs:
          acme: {{classes: [batch]}}
        """))
    kw: dict[str, Any] = {}

    async def endpoint(request: Request) -> Response:
        body = await request.json()
        async with sfq_asgi.enter(request, pd.acquire(FLOW, body, **kw)) as grant:
            grant.finish({"prompt_tokens": 1, "completion_tokens": 1})
        return Response(b"{}", media_type="application/json")

    app = Starlette(routes=[Route("/", endpoint, methods=["POST"])])
    app.add_exception_handler(sfq.SFQError, sfq_asgi.error_response_handler)
    async with sfq.PolicyDispatcher(policy, clock=lambda: now[0]) as pd:
        for bad in ({"timeout": "30"}, {"max_wait": 0}):
            kw.clear()
            kw.update(bad)
            client = Client(json.dumps(BODY).encode())
            await app(SCOPE, client.receive, client.send)
            (arg, value), = bad.items()
            assert client.status == 400 and json.loads(client.body) == {"error": {
                "message": f"{arg} must be a finite number of seconds > 0, got {value!r}",
                "type": "invalid_request_error", "code": "bad_request", "param": None}}
        kw.clear()
        kw["max_wait"] = 5.0
        async with pd.acquire(FLOW, BODY) as holder:  # the only slot is taken
            client = Client(json.dumps(BODY).encode())
            task = asyncio.create_task(app(SCOPE, client.receive, client.send))
            await _until(lambda: _flow(pd)["waiting"] == 1, "the request to wait its turn")
            now[0] += 5.0
            pd._pump()  # (what the dispatcher's timer does when the loop's time gets there)
            await asyncio.wait_for(task, 5)
            holder.finish({"prompt_tokens": 1, "completion_tokens": 1})
        assert client.status == 504 and json.loads(client.body)["error"]["code"] == "queue_timeout"
        assert "max_wait (5 s)" in json.loads(client.body)["error"]["message"]
        assert _flow(pd)["refused"] == 1 and _flow(pd)["completed"] == 1  # (bad arguments: nothing counted)
    assert upstream.requests == []


# ---------------------------------------------------------------- the responses
async def test_an_event_stream_is_sent_as_sse_and_closed(pd: sfq.PolicyDispatcher, upstream: Any) -> None:
    client = Client()
    await client.receive()
    body = {**BODY, "stream": True}
    events = await sfq_asgi.enter(client.receive, pd.open_stream(FLOW, body))
    await sfq_asgi.EventStreamResponse(events)(SCOPE, client.receive, client.send)
    assert client.status == 200 and client.headers["content-type"].startswith("text/event-stream")
    assert client.headers["cache-control"] == "no-cache" and client.complete
    frames = client.body.decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    assert [json.loads(f.removeprefix("data: "))["choices"][0]["text"] for f in frames[:-2]] == ["t0", "t1", "t2"]
    assert _flow(pd)["completed"] == 1 and _flow(pd)["in_flight"] == 0
    await asyncio.sleep(0)
    assert client.receiving == 0  # the watch ended with the body


async def test_an_error_after_the_200_is_an_error_event() -> None:
    closed: list[bool] = []

    class Broken:  # an entered stream that fails after one event
        def __init__(self) -> None:
            self.n = 0

        def __aiter__(self) -> Broken:
            return self

        async def __anext__(self) -> dict[str, Any]:
            self.n += 1
            if self.n == 1:
                return {"choices": [{"text": "a"}]}
            raise sfq.errors.StreamInterrupted("cut", backend="b", chunks=1)

        async def __aenter__(self) -> Broken:
            return self

        async def __aexit__(self, *exc: object) -> None:
            closed.append(True)

    client = Client()
    await client.receive()
    await sfq_asgi.EventStreamResponse(Broken())(SCOPE, client.receive, client.send)
    frames = client.body.decode().split("\n\n")
    assert client.status == 200 and len(frames) == 3 and frames[2] == ""
    error = json.loads(frames[1].removeprefix("data: "))
    assert error == sfq.errors.StreamInterrupted("cut", backend="b", chunks=1).to_openai()
    assert b"[DONE]" not in client.body and closed == [True]


async def test_the_stream_is_closed_when_the_client_leaves(
        pd: sfq.PolicyDispatcher, upstream: Any, quiet: pytest.LogCaptureFixture) -> None:
    upstream.mode = "stall"  # one event, then nothing until the call is aborted
    client = Client()
    await client.receive()
    events = await sfq_asgi.enter(client.receive, pd.open_stream(FLOW, {**BODY, "stream": True}))
    response = asyncio.create_task(
        sfq_asgi.EventStreamResponse(events)(SCOPE, client.receive, client.send))
    await _until(lambda: b"t0" in client.body, "the first event to be sent")
    client.leave()
    await asyncio.wait_for(response, 5)  # ends quietly: no exception
    assert not client.complete
    await _until(lambda: upstream.disconnects == 1, "the upstream call to be aborted")
    flow = _flow(pd)
    assert flow["in_flight"] == 0 and flow["cancelled_during_execution"] == 1


async def test_a_streaming_response_exits_the_turn_it_holds(pd: sfq.PolicyDispatcher, upstream: Any) -> None:
    # done: the grant is finished by the body and exited after it
    client = Client()
    await client.receive()
    turn = sfq_asgi.enter(client.receive, pd.acquire(FLOW, BODY))
    grant = await turn

    async def body() -> AsyncIterator[str]:
        for word in ("a", "b"):
            grant.delivered(1)
            yield word
        grant.finish({"prompt_tokens": 1, "completion_tokens": 2})

    await sfq_asgi.StreamingResponse(body(), closing=turn, media_type="text/plain")(
        SCOPE, client.receive, client.send)
    assert client.body == b"ab" and client.complete and _flow(pd)["completed"] == 1

    # gone: the client leaves while the body waits; the turn is exited as cancelled
    client = Client()
    await client.receive()
    turn = sfq_asgi.enter(client.receive, pd.acquire(FLOW, BODY))
    await turn
    closed: list[str] = []

    async def slow() -> AsyncIterator[bytes]:
        try:
            yield b"x"
            await asyncio.Event().wait()
            yield b"never"
        finally:
            closed.append("body")

    response = asyncio.create_task(sfq_asgi.StreamingResponse(slow(), closing=turn)(
        SCOPE, client.receive, client.send))
    await _until(lambda: client.body == b"x", "the first chunk")
    client.leave()
    await asyncio.wait_for(response, 5)
    assert closed == ["body"] and not client.complete
    flow = _flow(pd)
    assert flow["in_flight"] == 0 and flow["cancelled_during_execution"] == 1


# ---------------------------------------------------------------- the base install
def test_import_sfq_does_not_import_starlette_and_sfq_asgi_names_its_extra() -> None:
    code = textwrap.dedent("""\
        import sys
        import sfq, sfq.dispatch
        assert "starlette" not in sys.modules and "fastapi" not in sys.modules
        sys.modules["starlette"] = None  # as if not installed
        try:
            import sfq.asgi
        except ImportError as exc:
            print(type(exc).__name__, exc)
        """)
    here = str(Path(sfq.__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": here, "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert "MissingExtra" in out.stdout and "pip install 'sfq-scheduler[asgi]'" in out.stdout
