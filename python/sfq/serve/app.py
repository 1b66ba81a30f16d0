"""The gateway: OpenAI-compatible HTTP in front of a :class:`~sfq.dispatch.PolicyDispatcher`.

The gateway is thin: it parses HTTP, takes the bearer key and the ``X-SFQ-*`` headers, and
turns what the policy layer answers into status codes. Every rule (who the flow is, limits,
retries, deadlines, ordering) lives in :mod:`sfq.policy`, so an embedder who never runs
``sfq serve`` gets the same behaviour from the library.

* ``POST /v1/chat/completions``, ``POST /v1/completions``: the key and the class are checked
  from the headers before a byte of the body is read (no key: 401, and the body is never
  read); the body is then read within the pool's size limit and the ``server:`` section's
  read deadline, parsed with a depth limit, and its numbers checked. It goes to the policy as
  it came (the client's headers do not: a backend gets only its own key); ``"stream": true``
  passes the backend's events through as they arrive, one write per event, each awaited, so
  a slow client slows the read from the backend instead of filling memory; a stream whose
  client stops reading is ended at its deadline (``X-SFQ-Timeout``), its slot freed.
* ``GET /v1/models``, ``GET /health`` (503 while a pool has no backend in rotation;
  ``?pool=NAME`` for one pool), ``GET /metrics``, ``GET /stats`` (the fair-share figures as JSON),
  ``GET /dashboard`` (a page that polls ``/stats``: :mod:`sfq.serve.dashboard`; not routed with
  ``dashboard=False``).
* A client that goes away cancels its handler (the server runs with
  ``handler_cancellation=True``): before dispatch its request leaves the queue and never
  reaches a backend; after, the backend call is aborted.
* Every model request is counted once in ``sfq_requests_total`` (refused before the policy
  saw it too) and gets one access-log line on the logger ``sfq.serve.access``: a JSON object
  (request id, status sent, org, class, pool, model, wait, queue wait, outcome, cost charged,
  actual tokens, ...). Every response names its request (``x-request-id``); what a backend
  said when it failed goes to the log under that id, never to the client.
* Every answer of a model route says how long its request waited in the queue
  (``X-SFQ-Queue-Wait``, whole milliseconds: from its admission to the start of the attempt
  that answered; for a request that never started, to its refusal; 0 for one refused before
  it was admitted). A stream carries it on its response's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest

from ..backends.base import JSONBody, JSONEvent
from ..dispatch.policy_dispatcher import PolicyDispatcher
from ..engine import Request
from ..policy.metrics import OBJECTIVE_MISSED, PolicyMetrics
from ..errors import REFUSALS, BackendError, BackendHTTPError, PolicyError, Refused, SFQError
from ..policy import Flow, Policy, load_policy
from . import dashboard as _dashboard
from ..policy.classify import check_user
from .accesslog import direct
from .edge import SERVER, Edge, fd_budget, new_request_id
from .errors import HTTPError, error_body, http_error_of, sse_error

__all__ = ["Gateway", "ACCESS_LOGGER", "MAX_OUTPUT_TOKENS", "MAX_N", "QUEUE_WAIT_HEADER"]

ACCESS_LOGGER = "sfq.serve.access"
log = logging.getLogger("sfq.serve")
access = logging.getLogger(ACCESS_LOGGER)

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
#: the header of every model route's answer: milliseconds its request waited in the queue
QUEUE_WAIT_HEADER = "X-SFQ-Queue-Wait"
_DONE = b"data: [DONE]\n\n"
_UNKNOWN = ("", "", "")
_std_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
#: what ends a request as a miss of its class's time-to-first-token objective, as the engine's
#: reasons and as the codes of the gateway's answers
_OBJECTIVE_MISSED = OBJECTIVE_MISSED | {REFUSALS[r][2] for r in OBJECTIVE_MISSED}

#: seconds a refusal of a body still coming goes on reading (and dropping) it before closing
LINGER_SECONDS = 2.0
#: characters of a request's ``model`` the access log keeps (the one field of a line a client
#: sets freely: a line stays far under ``PIPE_BUF``, which ``--workers`` relies on)
LOGGED_MODEL_CHARS = 256
#: the largest ``max_tokens`` (or ``max_completion_tokens``) a request may ask for
MAX_OUTPUT_TOKENS = 1 << 24
#: the largest ``n`` (and ``best_of``): OpenAI's own limit
MAX_N = 128
_INT_FIELDS = (("max_tokens", MAX_OUTPUT_TOKENS), ("max_completion_tokens", MAX_OUTPUT_TOKENS), ("n", MAX_N),
               ("best_of", MAX_N))


def _dumps(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj)
    except TypeError:  # what orjson does not take (an integer over 64 bits from a backend): the slow way
        return _std_dumps(obj).encode()


def _json(status: int, body: Any, headers: dict[str, str]) -> web.Response:
    return web.Response(status=status, body=_dumps(body), content_type="application/json", headers=headers)


def _bearer(auth: str | None) -> str | None:
    if not auth:
        return None
    scheme, _, key = auth.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


class _BodyTimeout(Exception):
    """The body did not arrive within the read deadline."""


class _BodyError(Exception):
    """The body could not be read (a malformed transfer or content encoding)."""


class _Entry:
    """What the access-log line of one request says, and what the gateway has recorded of it."""

    __slots__ = ("t0", "path", "rid", "model", "stream", "flow", "r", "status", "outcome", "reason", "usage",
                 "events", "counted", "writing", "stalled", "timer", "error_status", "joining", "waited", "first")

    def __init__(self, t0: float, path: str, rid: str) -> None:
        self.t0 = t0
        self.path = path
        self.rid = rid
        self.model: Any = None
        self.stream = False
        self.flow: tuple[str, str, str] | None = None
        self.r: Request | None = None
        self.status = 0
        self.outcome: str | None = None
        self.reason: str | None = None
        self.usage: Any = None
        self.events = 0
        self.counted = False  # its outcome is (or will be) in sfq_requests_total
        self.writing = False  # a stream's write is in progress (it may be blocked on the client)
        self.stalled = False  # its stream's client stopped reading past the deadline
        self.timer: asyncio.TimerHandle | None = None
        self.error_status: int | None = None
        self.joining = False  # it joins a running request of the same Idempotency-Key
        self.waited: float | None = None  # seconds in the queue, as its answer's X-SFQ-Queue-Wait said
        self.first: float | None = None  # loop time its answer's first body byte was sent (200s only)

    def admitted(self, r: Request) -> None:
        self.r = r
        self.counted = True

    def queue_wait(self, now: float) -> float:
        """Seconds its request waited in the queue: from its admission to the start of its
        current (or last) attempt; to ``now`` (the engine's clock) when it has not started; 0
        when it was never admitted (refused before the queue, or joined a running request)."""
        r = self.r
        if r is None:
            return 0.0
        start = r.started_at
        return max(0.0, (start if start is not None else now) - r.arrival)


class Gateway:
    """``sfq serve``'s application.

    Parameters
    ----------
    policy:
        a policy file's path (what SIGHUP re-reads) or a :class:`Policy`. Its ``server:``
        section sets the edge's limits (docs/gateway.md).
    grace:
        seconds running requests get to finish at shutdown (the dispatcher's ``close_grace``).
    backends, dispatcher_options:
        passed to :class:`PolicyDispatcher` (``dispatcher_options``: its keyword arguments,
        e.g. ``health``; tests and embedders).
    client_max_size:
        the largest request body accepted, bytes (larger: 413); default: the ``server:``
        section's ``max_body_bytes`` (a pool's own limit still applies to its requests).
    dashboard:
        serve ``GET /dashboard`` (no key, like ``/metrics``); ``False``: 404 there
        (``sfq serve --no-dashboard``).
    """

    def __init__(self, policy: Policy | str | Path, *, grace: float = 30.0, backends: Mapping[str, Any] | None = None,
                 dispatcher_options: Mapping[str, Any] | None = None, client_max_size: int | None = None,
                 dashboard: bool = True) -> None:
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not (math.isfinite(grace) and grace >= 0):
            raise ValueError(f"grace must be a finite number of seconds >= 0, got {grace!r}")
        if client_max_size is not None and (isinstance(client_max_size, bool) or not isinstance(client_max_size, int)
                                            or client_max_size < 1):
            raise ValueError(f"client_max_size must be an integer >= 1 (bytes), got {client_max_size!r}")
        self.path: Path | None = None
        if not isinstance(policy, Policy):
            self.path = Path(policy)
            policy = load_policy(self.path)
        opts = {"close_grace": float(grace), **(dispatcher_options or {})}
        self.pd = PolicyDispatcher(policy, backends=backends, **opts)
        self.grace = float(grace)
        self.draining = False
        self.started = int(time.time())
        self._client_max_size = client_max_size
        reg = self.pd.registry
        closed = Counter("sfq_gateway_connections_closed", "Client connections the gateway closed at its edge, by "
                         "cause (head_timeout, head_too_large, send_timeout, evicted, refused_full)", ("cause",),
                         registry=reg)
        self.edge = Edge(policy.server, max_connections=fd_budget(policy),
                         on_close=lambda why: closed.labels(why).inc())
        Gauge("sfq_gateway_connections", "Open client connections", registry=reg).set_function(
            self.edge.open_connections)
        self._secrets: tuple[str, ...] = ()
        self._limits(policy)
        self.app = web.Application(client_max_size=self._read_cap)
        r = self.app.router
        expect = self._expect
        r.add_post(_CHAT, self._completions, expect_handler=expect)
        r.add_post(_COMPLETIONS, self._completions, expect_handler=expect)
        r.add_get("/v1/models", self._models, expect_handler=expect)
        r.add_get("/health", self._health, expect_handler=expect)
        r.add_get("/metrics", self._metrics, expect_handler=expect)
        r.add_get("/stats", self._stats, expect_handler=expect)
        self._routes = ", GET /dashboard" if dashboard else ""  # (named in a 404's message)
        if dashboard:
            _dashboard.page()  # read now: a package without its page fails at start-up, not on a request
            r.add_get("/dashboard", self._dashboard, expect_handler=expect)
        r.add_route("*", "/{tail:.*}", self._not_found, expect_handler=expect)
        self.app.on_startup.append(self._on_startup)

    @property
    def policy(self) -> Policy:
        return self.pd.policy

    def _limits(self, policy: Policy) -> None:
        """The body limits and the provider keys to keep out of the log, from ``policy``."""
        sv = policy.server
        self._server = sv
        self._read_cap = self._client_max_size or max([sv.max_body_bytes, *sv.pool_max_body_bytes.values()])
        self._secrets = tuple(sorted({k for p in policy.pools.values() for b in p.backends if b.api_key_env
                                      for k in [os.environ.get(b.api_key_env)] if k}, key=len, reverse=True))

    def _body_limit(self, pool: str) -> int:
        if self._client_max_size is not None:
            return self._client_max_size
        return self._server.body_limit(pool)

    async def _on_startup(self, app: web.Application) -> None:
        await self.pd.start()

    # ------------------------------------------------------------ operations
    def reload(self) -> bool:
        """Re-read the policy file and put it in force (``PolicyDispatcher.reload``): no
        queued request is lost. A file that cannot be read, is invalid, or changes what needs a
        restart is refused (logged) and the policy in force stays. Returns whether it reloaded."""
        if self.path is None:
            log.error("reload refused: the gateway was started from a Policy object, not a file")
            return False
        try:
            ended = self.pd.reload(self.path)
        except (PolicyError, OSError, ValueError, Refused) as exc:
            log.error("reload refused, the policy in force stays: %s", exc)
            return False
        p = self.pd.policy
        self._limits(p)
        self.edge.apply(p.server)
        log.info("reloaded %s: %d pools, %d classes, %d orgs%s", self.path, len(p.pools), len(p.classes),
                 len(p.orgs), f"; {len(ended)} waiting requests of flows it no longer allows refused" if ended else "")
        return True

    async def drain(self) -> None:
        """The shutdown: refuse new requests (503), answer the waiting ones 503, let the
        running ones finish within ``grace`` seconds, then close the backends (aborting what
        is still running: those streams end with an error event)."""
        self.draining = True
        await self.pd.close()

    # ------------------------------------------------------------ routes
    @staticmethod
    def _headers(rid: str) -> dict[str, str]:
        return {"Server": SERVER, "x-request-id": rid}

    def _error(self, err: HTTPError, rid: str, extra: Mapping[str, str] | None = None) -> web.Response:
        h = self._headers(rid)
        h.update(err.headers())
        if extra:
            h.update(extra)
        return _json(err.status, error_body(err, rid), h)

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue`` is answered only once the key is checked (a model route
        sends it just before reading the body); any other expectation is refused."""
        if request.headers.get("Expect", "").lower() == "100-continue":
            return None
        return self._error(HTTPError(417, "invalid_request_error", "expectation_failed",
                                     "only 'Expect: 100-continue' is supported", None, False), new_request_id(),
                           {"Connection": "close"})

    async def _not_found(self, request: web.Request) -> web.Response:
        return self._error(HTTPError(404, "not_found_error", "unknown_route",
                                     f"no route {request.method} {request.path[:100]} (routes: POST {_CHAT}, "
                                     f"POST {_COMPLETIONS}, GET /v1/models, GET /health, GET /metrics, GET /stats{self._routes})"),
                           new_request_id())

    async def _models(self, request: web.Request) -> web.Response:
        rid = new_request_id()
        auths: Sequence[str] = request.headers.getall("Authorization", ())
        if len(auths) > 1:
            return self._error(_DUPLICATE_AUTH, rid)
        try:
            self.pd.engine.classifier.org_of(_bearer(auths[0] if auths else None))
        except Refused as exc:
            return self._error(http_error_of(exc), rid)
        data = [{"id": m, "object": "model", "created": self.started, "owned_by": p.name}
                for p in self.pd.policy.pools.values() for m in p.models]
        return _json(200, {"object": "list", "data": data}, self._headers(rid))

    async def _health(self, request: web.Request) -> web.Response:
        """200 while every pool (or the one of ``?pool=NAME``) has a backend in rotation
        (healthy and not paused); 503 with ``reason`` otherwise, while draining, or when the
        shared state is out of reach."""
        rid = new_request_id()
        s = self.pd.stats()
        names = list(self.pd.policy.pools)
        only = request.query.get("pool")
        if only is not None:
            if only not in self.pd.policy.pools:
                return self._error(HTTPError(404, "not_found_error", "unknown_pool",
                                             f"no pool {only[:100]!r} (pools: {', '.join(names)})"), rid)
            names = [only]
        dispatchers = s.get("backends", {})
        in_pool = {b.name for b in self.pd.policy.pools[names[0]].backends} if only is not None else set()
        pools: dict[str, Any] = {}
        down: list[str] = []
        for name in names:
            spec = self.pd.policy.pools[name]
            ps = dict(s["pools"].get(name, {}))
            ps.pop("virtual_time", None)
            pools[name] = {"models": list(spec.models), **ps}
            unhealthy = paused = up = 0
            for bname, b in ps.get("backends", {}).items():
                d = dispatchers.get(bname, {})
                if not (b.get("healthy", True) and d.get("healthy", True)):
                    unhealthy += 1
                elif (b.get("paused_for") or 0) > 0 or d.get("paused"):
                    paused += 1
                else:
                    up += 1
            if not up:
                why = " and ".join(f"{n} {what}" for n, what in ((unhealthy, "unhealthy"), (paused, "paused")) if n)
                down.append(f"pool {name!r} has no backend in rotation ({why or 'none'})")
        backends = {name: {k: b[k] for k in ("healthy", "saturated", "paused", "in_flight", "max_in_flight") if k in b}
                    for name, b in dispatchers.items() if only is None or name in in_pool}
        body: dict[str, Any] = {"status": "ok", "pools": pools, "backends": backends}
        status = 200
        st = self.pd.state
        if st.shared:  # several gateways, one queue: without the shared state nothing new is admitted
            body["state"] = s.get("state")
            if not st.available:
                body["status"], body["reason"], status = "state_unavailable", "the shared state cannot be reached", 503
            elif st.degraded:  # serving alone, within this gateway's slices of the limits
                body["status"], body["reason"] = "degraded", f"serving alone: {st.reason}"
        if down and status == 200:
            body["status"], body["reason"], status = "unavailable", "; ".join(down), 503
        if self.draining:
            body["status"], status = "draining", 503
        return _json(status, body, self._headers(rid))

    async def _metrics(self, request: web.Request) -> web.Response:
        registry = self.pd.registry
        assert registry is not None  # (a policy engine always has one)
        resp = web.Response(body=generate_latest(registry), headers={"Server": SERVER})
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def _dashboard(self, request: web.Request) -> web.Response:
        return web.Response(body=_dashboard.page(), headers={"Server": SERVER, **_dashboard.headers()})

    async def _stats(self, request: web.Request) -> web.Response:
        """The fair-share figures as JSON (docs/API.md, ``GET /stats``); ``?pool=NAME`` for one
        pool. No key needed; no key or request content in it."""
        rid = new_request_id()
        m = self.pd.engine.metrics
        only = request.query.get("pool")
        names = list(self.pd.policy.pools)
        if only is not None and only not in names:
            return self._error(HTTPError(404, "not_found_error", "unknown_pool",
                                         f"no pool {only[:100]!r} (pools: {', '.join(names)})"), rid)
        if not isinstance(m, PolicyMetrics):  # (a dispatcher that keeps no metrics)
            body: dict[str, Any] = {"time": time.time(), "window_seconds": None, "pools": {}}
        else:
            body = m.stats(only)
        return _json(200, body, self._headers(rid))

    # ------------------------------------------------------------ model requests
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        e = _Entry(loop.time(), request.path, new_request_id())
        try:
            return await self._serve(request, e)
        except asyncio.CancelledError:
            if e.stalled:  # the stall check's own cancellation, after the stream was ended (see _stream)
                raise
            if e.status in (0, 200):  # the client went away (nginx's code for it), not after an answer it got
                e.status = 499
            if not e.counted:  # it left before its request was complete, or before the policy took it
                self._count(e, e.flow or _UNKNOWN, "cancelled_before_start")
            raise
        except Exception:  # a bug: answered, logged, counted; never aiohttp's page, never a hang
            log.exception("request %s: unexpected error serving %s", e.rid, request.path)
            if not e.counted:
                self._count(e, e.flow or _UNKNOWN, "refused", "internal")
            if e.status == 200:  # the stream had started: nothing else can be sent
                raise
            return self._refuse(e, HTTPError(500, "server_error", "internal_error",
                                             "the gateway failed to serve this request"))
        finally:
            if e.timer is not None:
                e.timer.cancel()
            self._first_token(e)
            self._log(e, loop.time())

    def _count(self, e: _Entry, key: tuple[str, str, str], outcome: str, reason: str | None = None) -> None:
        """Record the outcome of a request the policy never took (once)."""
        e.counted = True
        eng = self.pd.engine
        if outcome == "refused":
            eng.refuse(key, reason or "bad_request")
        else:
            eng.submitted += 1
            eng.metrics.ended(key, outcome, reason)

    def _refused(self, e: _Entry, key: tuple[str, str, str], err: HTTPError, reason: str,
                 *, close: bool = False) -> web.Response:
        """A refusal the gateway decides (and records) before the policy sees the request."""
        self._count(e, key, "refused", reason)
        e.flow = key
        e.outcome = "refused"
        return self._refuse(e, err, {"Connection": "close"} if close else None)

    async def _serve(self, request: web.Request, e: _Entry) -> web.StreamResponse:
        h = request.headers
        if self.draining:
            return await self._linger(request, self._refused(
                e, _UNKNOWN, HTTPError(503, "server_error", "shutting_down", "the gateway is shutting down", None,
                                       True), "closed", close=True))
        payload = request.content
        unread = not payload.is_eof()  # a body still to come: refusing it closes the connection
        auths: Sequence[str] = h.getall("Authorization", ())
        if len(auths) > 1:
            return await self._linger(request, self._refused(e, _UNKNOWN, _DUPLICATE_AUTH, "bad_request",
                                                             close=unread))
        # who, and which class: from the headers, before a byte of the body is read
        cl = self.pd.engine.classifier
        try:
            org = cl.org_of(_bearer(auths[0] if auths else None))
        except Refused as exc:
            return await self._linger(request, self._refused(e, _UNKNOWN, http_error_of(exc), exc.reason,
                                                             close=unread))
        try:
            cls = cl.class_for(org, h.get("X-SFQ-Class") or None)
        except Refused as exc:
            return await self._linger(request, self._refused(e, (org.name, "", ""), http_error_of(exc), exc.reason,
                                                             close=unread))
        e.flow = (org.name, cls, "")
        member: tuple[str | None, str | None] = (None, None)  # nested shares: (team, user)
        stated_user = h.get("X-SFQ-User")
        if stated_user is not None:
            try:
                check_user(stated_user)
            except Refused as exc:
                bad = HTTPError(400, "invalid_request_error", "bad_request", str(exc), None, False, "X-SFQ-User")
                return await self._linger(request, self._refused(e, e.flow, bad, "bad_request", close=unread))
        if org.nested:
            member = cl.member(org, _bearer(auths[0]) or "", stated_user)
        timeout: float | None = None
        t = h.get("X-SFQ-Timeout")
        if t is not None:
            try:
                timeout = float(t)
            except ValueError:
                timeout = math.nan
            if not (math.isfinite(timeout) and timeout > 0):
                return await self._linger(request, self._refused(
                    e, e.flow, _bad(f"X-SFQ-Timeout must be a number of seconds > 0, got {t[:40]!r}"), "bad_request",
                    close=unread))
        # the body, within the largest limit of any pool (the request's own pool is checked below)
        try:
            raw = await self._read(request, payload, unread, e)
        except _TooLarge as exc:
            return await self._linger(request, self._refused(e, e.flow, _too_large(exc.limit), "too_large",
                                                             close=True))
        except _BodyError as exc:
            return self._refused(e, e.flow, _bad(str(exc)), "bad_request", close=True)
        except _BodyTimeout:
            return self._refused(e, e.flow, HTTPError(408, "invalid_request_error", "request_timeout",
                                                      f"the request body did not arrive within "
                                                      f"{self._server.body_timeout_seconds:g} s", None, True),
                                 "bad_request", close=True)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return self._refused(e, e.flow, _bad(f"the request body is not valid JSON: {exc}"), "bad_request")
        if type(body) is not dict:
            return self._refused(e, e.flow, _bad(f"the request body must be a JSON object, got {type(body).__name__}"),
                                 "bad_request")
        body = JSONBody(body, raw)  # sent upstream as it came (nothing in it changes)
        e.model = model = body.get("model")
        try:
            pool = cl.pool_for(model)
        except Refused as exc:
            return self._refused(e, e.flow, http_error_of(exc), exc.reason)
        flow = Flow(org.name, cls, pool, *member)
        e.flow = flow.flat  # (what is counted and logged: teams and users add no series)
        limit = self._body_limit(pool)
        if len(raw) > limit:
            return self._refused(e, e.flow, _too_large(limit, pool), "too_large")
        problem = self._shape(request.path, body)
        if problem is not None:
            return self._refused(e, e.flow, _bad(problem), "bad_request")
        if timeout is not None:  # the deadline runs from arrival, reading the body included
            timeout = max(timeout - (asyncio.get_running_loop().time() - e.t0), 1e-9)
        e.stream = body.get("stream") is True
        if e.stream:
            return await self._stream(request, e, auths[0], cls, body, timeout, flow)
        idem = h.get("Idempotency-Key") or None
        e.joining = idem is not None and self.pd.running_key(flow.org, idem)  # (no await until submit_flow's)
        try:
            reply = await self.pd.submit_flow(flow, body, timeout=timeout, idempotency_key=idem,
                                              on_admit=e.admitted)
        except SFQError as exc:
            return self._failed(e, exc)
        except OverflowError as exc:
            return self._overflow(e, exc)
        if not e.counted:  # an Idempotency-Key joined a running request
            self._joined(e)
        e.usage = reply.get("usage") if isinstance(reply, dict) else None
        e.status = 200
        resp = _json(200, reply, {**self._headers(e.rid), **self._waited(e)})
        e.first = asyncio.get_running_loop().time()  # (its body goes out as the handler returns)
        return resp

    async def _read(self, request: web.Request, payload: Any, unread: bool, e: _Entry) -> bytes:
        """The body, at most the read cap, within the body deadline (``_TooLarge``,
        ``_BodyTimeout``). A body that came with its head is taken as it is."""
        cap = self._read_cap
        n = request.content_length
        if n is not None and n > cap:
            raise _TooLarge(cap)
        if not unread:
            raw: bytes = payload.read_nowait(-1)
            if len(raw) > cap:
                raise _TooLarge(cap)
            return raw
        if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        loop = asyncio.get_running_loop()
        timer = loop.call_at(e.t0 + self._server.body_timeout_seconds, payload.set_exception, _BodyTimeout())
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                c = await payload.readany()
                if not c:
                    break
                size += len(c)
                if size > cap:
                    raise _TooLarge(cap)
                chunks.append(c)
        except (_TooLarge, _BodyTimeout, asyncio.CancelledError):
            raise
        except ConnectionError:  # the client went away mid-body (its handler is being cancelled too)
            raise asyncio.CancelledError() from None
        except Exception as exc:  # a malformed body encoding (chunked, compressed): the client's
            raise _BodyError(f"the request body could not be read: {exc}") from None
        finally:
            timer.cancel()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _linger(self, request: web.Request, resp: web.Response) -> web.Response:
        """Send a refusal of a body that is still coming now, then read and drop what the client
        goes on sending, for at most ``LINGER_SECONDS`` and the read cap, before the connection
        closes: closing a socket with unread data resets it, and the reset can destroy the
        answer before the client reads it."""
        payload = request.content
        if payload.is_eof():
            return resp
        try:
            await resp.prepare(request)
            await resp.write_eof()
        except ConnectionError:
            return resp
        if request.headers.get("Expect", "").lower() == "100-continue":
            return resp  # never told to continue: it sends nothing more
        loop = asyncio.get_running_loop()
        timer = loop.call_at(loop.time() + LINGER_SECONDS, payload.set_exception, _BodyTimeout())
        left = self._read_cap
        try:
            while left > 0:
                c = await payload.readany()
                if not c:
                    break
                left -= len(c)
        except Exception:  # the linger's own deadline, or the connection went
            pass
        finally:
            timer.cancel()
        return resp

    def _failed(self, e: _Entry, exc: SFQError) -> web.Response:
        """The policy (or a backend) refused or failed the request: its answer, and the
        backend's own words to the log."""
        if not e.counted:
            if e.joining:  # the running request it joined failed (it never ran on its own)
                self._joined(e)
            else:  # refused or failed before it was admitted: the policy recorded it
                e.counted = True
        err = http_error_of(exc)
        self._log_failure(e, exc, err)
        return self._refuse(e, err)

    def _overflow(self, e: _Entry, exc: OverflowError) -> web.Response:
        """The request's estimated cost is over what the scheduler can charge (huge ``max_tokens``
        times ``n`` times a batch of prompts): the client's mistake, a 400."""
        if e.counted:  # not from the estimate: a bug
            raise exc
        assert e.flow is not None
        return self._refused(e, e.flow, _bad(f"the request asks for too much output ({exc}); lower max_tokens or n"),
                             "bad_request")

    def _joined(self, e: _Entry) -> None:
        e.counted = True
        e.outcome = "joined"
        m = self.pd.engine.metrics
        if e.flow is not None and isinstance(m, PolicyMetrics):
            m.joined(e.flow)

    def _log_failure(self, e: _Entry, exc: BaseException, err: HTTPError) -> None:
        if not (isinstance(exc, BackendError) or err.status >= 500):
            return
        detail = str(exc)
        if isinstance(exc, BackendError) and exc.body and exc.body not in detail:
            detail += f" (body: {exc.body!r})"
        if isinstance(exc, BackendHTTPError) and exc.headers:
            detail += f" (headers: {exc.headers!r})"
        for k in self._secrets:
            detail = detail.replace(k, "[redacted]")
        log.warning("request %s: %s %s -> %d %s: %s", e.rid, e.path, "/".join(e.flow or _UNKNOWN), err.status,
                    type(exc).__name__, detail)

    async def _stream(self, request: web.Request, e: _Entry, auth: str, cls: str,
                      body: dict[str, Any], timeout: float | None, flow: Flow) -> web.StreamResponse:
        so = body.get("stream_options")
        wants_usage = isinstance(so, dict) and bool(so.get("include_usage"))
        if not wants_usage:  # ask for it anyway (the access log's actual tokens), pass it on only if asked
            body = body.streamed_with_usage() if type(body) is JSONBody else {
                **body, "stream_options": {**(so if isinstance(so, dict) else {}), "include_usage": True}}
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        agen = (self.pd.stream(_bearer(auth), body, cls=cls, timeout=timeout, on_admit=e.admitted) if len(flow) == 3
                else self.pd.stream_flow(flow, body, timeout=timeout, on_admit=e.admitted))  # (a team's or user's)
        async with contextlib.aclosing(agen):
            try:
                first: dict[str, Any] | None = await agen.__anext__()
            except StopAsyncIteration:
                first = None
            except SFQError as exc:
                return self._failed(e, exc)
            except OverflowError as exc:
                return self._overflow(e, exc)
            resp = web.StreamResponse(status=200, headers={**_SSE_HEADERS, "x-request-id": e.rid, **self._waited(e)})
            await resp.prepare(request)
            e.status = 200
            if deadline is not None:  # a client that stops reading is ended at its deadline, not left to hold a slot
                task = asyncio.current_task()
                assert task is not None
                e.timer = loop.call_at(deadline, self._stall_check, e, task)
            try:
                ev = first
                write = resp.write
                while ev is not None:
                    u = ev.get("usage")
                    if u:
                        e.usage = u
                    if not (u and not wants_usage and not ev.get("choices")):
                        # the upstream's bytes as they came, when the event has them
                        data = getattr(ev, "raw", None) if type(ev) is JSONEvent else None
                        if data is None:
                            data = _dumps(ev)
                        e.writing = True
                        if e.first is None:
                            e.first = loop.time()
                        try:
                            await write(b"data: %b\n\n" % data)
                        finally:
                            e.writing = False
                        e.events += 1
                    try:
                        ev = await agen.__anext__()
                    except StopAsyncIteration:
                        ev = None
                if e.first is None:  # (a stream without an event: its answer's first byte)
                    e.first = loop.time()
                await self._send(e, resp, _DONE)
            except SFQError as exc:  # after the stream started: an error event ends it, never a silent cut
                err = http_error_of(exc)
                self._log_failure(e, exc, err)
                await self._stream_error(e, resp, err)
            except ConnectionError:  # the client is gone: nothing more can reach it
                e.status = 499  # (nginx's code for it); leaving here cancels the request
                return resp
            except asyncio.CancelledError:
                if not e.stalled:
                    raise
                return await self._stalled(request, e, agen, resp)
            except Exception as exc:
                log.exception("request %s: unexpected error streaming %s", e.rid, request.path)
                await self._stream_error(e, resp, http_error_of(exc))
            try:
                e.writing = True
                await resp.write_eof()
            except ConnectionError:
                pass
            except asyncio.CancelledError:
                if not e.stalled:
                    raise
                return await self._stalled(request, e, agen, resp)
            finally:
                e.writing = False
            return resp

    @staticmethod
    async def _send(e: _Entry, resp: web.StreamResponse, data: bytes) -> None:
        e.writing = True
        try:
            await resp.write(data)
        finally:
            e.writing = False

    def _stall_check(self, e: _Entry, task: asyncio.Task[Any]) -> None:
        """The stream's deadline: if its handler is blocked writing to a client that does not
        read, stop it (``_stalled`` ends the request); otherwise the policy's own deadline ends
        it, and this looks again shortly in case ending it blocks on the client too."""
        if e.writing:
            e.stalled = True
            e.timer = None
            task.cancel()
        else:
            e.timer = asyncio.get_running_loop().call_later(_STALL_RECHECK, self._stall_check, e, task)

    async def _stalled(self, request: web.Request, e: _Entry, agen: Any, resp: web.StreamResponse
                       ) -> web.StreamResponse:
        """The client stopped reading and the deadline ran out: end the request as its deadline
        does (the backend call is aborted, the slot freed), and drop the connection (nothing
        more can reach that client)."""
        task = asyncio.current_task()
        if task is not None and hasattr(task, "uncancel"):
            task.uncancel()
        e.reason = "deadline"
        expire = getattr(agen, "expire", None)  # sfq's own stream: ended as its deadline ends it
        if expire is not None:
            expire()
        if request.transport is not None:
            request.transport.abort()
        log.info("request %s: the client stopped reading its stream; ended at its deadline", e.rid)
        return resp

    async def _stream_error(self, e: _Entry, resp: web.StreamResponse, err: HTTPError) -> None:
        e.reason = err.code
        e.error_status = err.status  # the client got 200 and then this, in the error event
        with contextlib.suppress(ConnectionError):
            await self._send(e, resp, sse_error(err, e.rid))

    # ------------------------------------------------------------ helpers
    @staticmethod
    def _shape(path: str, body: Mapping[str, Any]) -> str | None:
        """What is wrong with the body for its route (``None``: nothing the gateway checks)."""
        if path == _CHAT:
            m = body.get("messages")
            if not isinstance(m, list) or not m:
                return "/v1/chat/completions needs 'messages': a non-empty list"
        else:
            if "messages" in body:
                return "'messages' is for /v1/chat/completions; /v1/completions takes 'prompt'"
            if "prompt" not in body:
                return "/v1/completions needs 'prompt'"
        s = body.get("stream")
        if s is not None and type(s) is not bool:
            return f"'stream' must be true or false, got {_short(s)}"
        for name, most in _INT_FIELDS:
            v = body.get(name)
            if v is not None and (type(v) is not int or not 1 <= v <= most):
                return f"'{name}' must be an integer from 1 to {most}, got {_short(v)}"
        return None

    def _waited(self, e: _Entry) -> dict[str, str]:
        """The answer's ``X-SFQ-Queue-Wait`` (whole milliseconds); the seconds are kept for the
        access log, which says the same number."""
        w = e.waited = e.queue_wait(self.pd.engine.clock())
        return {QUEUE_WAIT_HEADER: str(round(w * 1000.0))}

    def _refuse(self, e: _Entry, err: HTTPError, extra: Mapping[str, str] | None = None) -> web.Response:
        e.status = err.status
        e.reason = e.reason or err.code
        h = self._waited(e)
        if extra:
            h.update(extra)
        return self._error(err, e.rid, h)

    def _first_token(self, e: _Entry) -> None:
        """Count the request for its class's time-to-first-token objective: the seconds from
        its arrival to the first byte of a 200's body, or a miss when it ended without an
        answer because its deadline or queue age ran out (or it could not start before its
        deadline); any other end is not counted (``PolicyMetrics.first_token``)."""
        r = e.r
        key = r.flow[:3] if r is not None else e.flow
        if key is None or not key[1] or not key[2]:
            return
        m = self.pd.engine.metrics
        if not isinstance(m, PolicyMetrics):
            return
        if e.first is not None:
            m.first_token(key, e.first - e.t0)
        elif (r is not None and r.reason in _OBJECTIVE_MISSED) or e.reason in _OBJECTIVE_MISSED:
            m.first_token(key, None)

    def _log(self, e: _Entry, now: float) -> None:
        if not access.isEnabledFor(logging.INFO):
            return
        r = e.r
        flow = r.flow[:3] if r is not None else e.flow
        org, cls, pool = flow if flow is not None else _UNKNOWN
        outcome = e.outcome
        reason = e.reason
        wait = None
        queue_wait = e.waited if e.waited is not None else e.queue_wait(self.pd.engine.clock())
        charged = 0.0
        backend = None
        tries = 0
        if r is not None:
            outcome = r.outcome or ("running" if e.status == 499 else None)
            reason = r.reason or (reason if outcome != "completed" else None)
            tries = r.tries
            charged = r.charged_total  # what the engine charged, every correction made
            backend = r.backend
            if r.started_at is not None:
                wait = round(r.started_at - r.arrival, 6)
        elif outcome is None:
            outcome = "cancelled_before_start" if e.status == 499 else "refused"
        u = e.usage if isinstance(e.usage, dict) else {}
        line = {"ts": round(time.time(), 3), "request_id": e.rid, "path": e.path, "status": e.status, "org": org,
                "class": cls, "pool": pool, "model": e.model[:LOGGED_MODEL_CHARS] if isinstance(e.model, str) else None,
                "stream": e.stream, "outcome": outcome, "reason": reason, "wait": wait,
                "queue_wait": round(queue_wait, 6), "tries": tries,
                "backend": backend, "cost_charged": charged, "prompt_tokens": u.get("prompt_tokens"),
                "completion_tokens": u.get("completion_tokens"), "duration": round(now - e.t0, 6)}
        if e.stream:
            line["events"] = e.events
            if e.error_status is not None:
                line["error_status"] = e.error_status
        w = direct(access)
        if w is not None:  # the handler configure_logging installed: the line's bytes to its buffer
            try:
                data = orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
            except TypeError:  # what orjson does not take (an integer over 64 bits from a backend)
                data = _std_dumps(line).encode() + b"\n"
            w.write(data)
            return
        # an embedder's own handlers: a record, as access.info makes it (without looking up the caller's frame)
        access.handle(access.makeRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, _dumps(line).decode(), (), None))


class _TooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


def _bad(message: str) -> HTTPError:
    return HTTPError(400, "invalid_request_error", "bad_request", message, None, False)


def _too_large(limit: int, pool: str | None = None) -> HTTPError:
    where = f" for pool {pool!r}" if pool is not None else ""
    return HTTPError(413, "invalid_request_error", "request_too_large",
                     f"the request body is over the limit of {limit} bytes{where}", None, False)


_DUPLICATE_AUTH = _bad("the request has more than one Authorization header")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                "Server": SERVER}
#: seconds between two looks at a stream past its deadline whose handler was not writing
_STALL_RECHECK = 0.25
