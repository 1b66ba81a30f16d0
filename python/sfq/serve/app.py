"""The gateway: OpenAI-compatible HTTP in front of a :class:`~sfq.policy.PolicyDispatcher`.

The gateway is thin: it parses HTTP, takes the bearer key and the ``X-SFQ-*`` headers, and
turns what the policy layer answers into status codes. Every rule (who the flow is, limits,
retries, deadlines, ordering) lives in :mod:`sfq.policy`, so an embedder who never runs
``sfq serve`` gets the same behaviour from the library.

* ``POST /v1/chat/completions``, ``POST /v1/completions``: the body goes to the policy as
  it came (the client's headers do not: a backend gets only its own key); ``"stream": true``
  passes the backend's events through as they arrive, one write per event, each awaited, so
  a slow client slows the read from the backend instead of filling memory.
* ``GET /v1/models``, ``GET /health``, ``GET /metrics``.
* A client that goes away cancels its handler (the server runs with
  ``handler_cancellation=True``): before dispatch its request leaves the queue and never
  reaches a backend; after, the backend call is aborted.
* One access-log line per model request on the logger ``sfq.serve.access``: a JSON object
  (org, class, pool, model, wait, outcome, cost charged, actual tokens, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import PolicyError, Refused, SFQError
from ..policy import Policy, load_policy
from ..dispatch.policy_dispatcher import PolicyDispatcher
from ..engine import Request
from .errors import HTTPError, error_body, http_error_of, sse_error

__all__ = ["Gateway", "ACCESS_LOGGER"]

ACCESS_LOGGER = "sfq.serve.access"
log = logging.getLogger("sfq.serve")
access = logging.getLogger(ACCESS_LOGGER)

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _json(status: int, body: Any, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=_dumps(body).encode(), content_type="application/json",
                        headers=headers)


def _error(err: HTTPError, extra: Mapping[str, str] | None = None) -> web.Response:
    h = err.headers()
    if extra:
        h.update(extra)
    return _json(err.status, error_body(err), h)


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization")
    if not auth:
        return None
    scheme, _, key = auth.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


class _Entry:
    """What the access-log line of one request says."""

    __slots__ = ("t0", "path", "model", "stream", "flow", "r", "status", "outcome", "reason", "usage", "events")

    def __init__(self, t0: float, path: str) -> None:
        self.t0 = t0
        self.path = path
        self.model: Any = None
        self.stream = False
        self.flow: tuple[str, str, str] | None = None
        self.r: Request | None = None
        self.status = 0
        self.outcome: str | None = None
        self.reason: str | None = None
        self.usage: Any = None
        self.events = 0

    def admitted(self, r: Request) -> None:
        self.r = r


class Gateway:
    """``sfq serve``'s application.

    Parameters
    ----------
    policy:
        a policy file's path (what SIGHUP re-reads) or a :class:`Policy`.
    grace:
        seconds running requests get to finish at shutdown (the dispatcher's ``close_grace``).
    backends, dispatcher_options:
        passed to :class:`PolicyDispatcher` (``dispatcher_options``: its keyword arguments,
        e.g. ``health``; tests and embedders).
    client_max_size:
        the largest request body accepted, bytes (larger: 413).
    """

    def __init__(self, policy: Policy | str | Path, *, grace: float = 30.0, backends: Mapping[str, Any] | None = None,
                 dispatcher_options: Mapping[str, Any] | None = None, client_max_size: int = 32 << 20) -> None:
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not (math.isfinite(grace) and grace >= 0):
            raise ValueError(f"grace must be a finite number of seconds >= 0, got {grace!r}")
        self.path: Path | None = None
        if not isinstance(policy, Policy):
            self.path = Path(policy)
            policy = load_policy(self.path)
        opts = {"close_grace": float(grace), **(dispatcher_options or {})}
        self.pd = PolicyDispatcher(policy, backends=backends, **opts)
        self.grace = float(grace)
        self.draining = False
        self.started = int(time.time())
        self.app = web.Application(client_max_size=client_max_size)
        r = self.app.router
        r.add_post(_CHAT, self._completions)
        r.add_post(_COMPLETIONS, self._completions)
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self._health)
        r.add_get("/metrics", self._metrics)
        r.add_route("*", "/{tail:.*}", self._not_found)
        self.app.on_startup.append(self._on_startup)

    @property
    def policy(self) -> Policy:
        return self.pd.policy

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
    async def _not_found(self, request: web.Request) -> web.Response:
        return _error(HTTPError(404, "not_found_error", "unknown_route",
                                f"no route {request.method} {request.path} (routes: POST {_CHAT}, POST {_COMPLETIONS}, "
                                "GET /v1/models, GET /health, GET /metrics)"))

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self.pd.engine.classifier.org_of(_bearer(request))
        except Refused as exc:
            return _error(http_error_of(exc))
        data = [{"id": m, "object": "model", "created": self.started, "owned_by": p.name}
                for p in self.pd.policy.pools.values() for m in p.models]
        return _json(200, {"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        s = self.pd.stats()
        pools = {}
        for name, spec in self.pd.policy.pools.items():
            ps = dict(s["pools"][name])
            ps.pop("virtual_time", None)
            pools[name] = {"models": list(spec.models), **ps}
        backends = {name: {k: b[k] for k in ("healthy", "saturated", "in_flight", "max_in_flight") if k in b}
                    for name, b in s["backends"].items()}
        body: dict[str, Any] = {"status": "draining" if self.draining else "ok", "pools": pools, "backends": backends}
        st = self.pd.state
        if st.shared:  # several gateways, one queue: without the shared state nothing new is admitted
            body["state"] = s.get("state")
            if not st.available and not self.draining:
                body["status"] = "state_unavailable"
                body["reason"] = st.reason
                return _json(503, body)
        return _json(503 if self.draining else 200, body)

    async def _metrics(self, request: web.Request) -> web.Response:
        registry = self.pd.registry
        assert registry is not None  # (a policy engine always has one)
        resp = web.Response(body=generate_latest(registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        e = _Entry(loop.time(), request.path)
        try:
            return await self._serve(request, e)
        except asyncio.CancelledError:
            e.status = 499  # the client went away (nginx's code for it)
            raise
        finally:
            self._log(e, loop.time())

    async def _serve(self, request: web.Request, e: _Entry) -> web.StreamResponse:
        if self.draining:
            e.outcome, e.reason = "refused", "closed"
            return self._refuse(e, HTTPError(503, "server_error", "shutting_down", "the gateway is shutting down"),
                                {"Connection": "close"})
        key = _bearer(request)
        cls = request.headers.get("X-SFQ-Class") or None
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            return self._refuse(e, HTTPError(413, "invalid_request_error", "request_too_large", exc.text or
                                             "the request body is too large"))
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return self._bad_before_flow(e, key, f"the request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return self._bad_before_flow(e, key, f"the request body must be a JSON object, got {type(body).__name__}")
        e.model = body.get("model")
        try:
            flow = self.pd.classify(key, body, cls)
        except Refused as exc:
            return self._refuse(e, http_error_of(exc))
        e.flow = tuple(flow)  # type: ignore[assignment]
        problem = self._shape(request.path, body)
        timeout: float | None = None
        t = request.headers.get("X-SFQ-Timeout")
        if problem is None and t is not None:
            try:
                timeout = float(t)
            except ValueError:
                timeout = math.nan
            if not (math.isfinite(timeout) and timeout > 0):
                problem = f"X-SFQ-Timeout must be a number of seconds > 0, got {t!r}"
        if problem is not None:
            self.pd.engine.refuse(flow, "bad_request")
            return self._refuse(e, HTTPError(400, "invalid_request_error", "bad_request", problem))
        if timeout is not None:  # the deadline runs from arrival, reading the body included
            timeout = max(timeout - (asyncio.get_running_loop().time() - e.t0), 1e-9)
        e.stream = bool(body.get("stream"))
        if e.stream:
            return await self._stream(request, e, key, cls, body, timeout)
        try:
            reply = await self.pd.submit_flow(flow, body, timeout=timeout,
                                              idempotency_key=request.headers.get("Idempotency-Key") or None,
                                              on_admit=e.admitted)
        except SFQError as exc:
            return self._refuse(e, http_error_of(exc))
        except Exception as exc:  # a bug: answered, logged, never a hang
            log.exception("unexpected error serving %s", request.path)
            return self._refuse(e, http_error_of(exc))
        e.usage = reply.get("usage") if isinstance(reply, dict) else None
        e.status = 200
        return _json(200, reply)

    async def _stream(self, request: web.Request, e: _Entry, key: str | None, cls: str | None,
                      body: dict[str, Any], timeout: float | None) -> web.StreamResponse:
        so = body.get("stream_options")
        wants_usage = isinstance(so, dict) and bool(so.get("include_usage"))
        if not wants_usage:  # ask for it anyway (the access log's actual tokens), pass it on only if asked
            body = {**body, "stream_options": {**(so if isinstance(so, dict) else {}), "include_usage": True}}
        agen = self.pd.stream(key, body, cls=cls, timeout=timeout, on_admit=e.admitted)
        async with contextlib.aclosing(agen):
            try:
                first: dict[str, Any] | None = await agen.__anext__()
            except StopAsyncIteration:
                first = None
            except SFQError as exc:
                return self._refuse(e, http_error_of(exc))
            except Exception as exc:
                log.exception("unexpected error serving %s", request.path)
                return self._refuse(e, http_error_of(exc))
            resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
            await resp.prepare(request)
            e.status = 200
            try:
                ev = first
                while ev is not None:
                    u = ev.get("usage")
                    if u:
                        e.usage = u
                    if not (u and not wants_usage and not ev.get("choices")):
                        await resp.write(b"data: " + _dumps(ev).encode() + b"\n\n")
                        e.events += 1
                    try:
                        ev = await agen.__anext__()
                    except StopAsyncIteration:
                        ev = None
                await resp.write(_DONE)
            except SFQError as exc:  # after the stream started: an error event ends it, never a silent cut
                await self._stream_error(e, resp, http_error_of(exc))
            except ConnectionError:
                raise  # the client is gone (its handler is cancelled too): nothing to tell it
            except Exception as exc:
                log.exception("unexpected error streaming %s", request.path)
                await self._stream_error(e, resp, http_error_of(exc))
            with contextlib.suppress(ConnectionError):
                await resp.write_eof()
            return resp

    @staticmethod
    async def _stream_error(e: _Entry, resp: web.StreamResponse, err: HTTPError) -> None:
        e.reason = err.code
        e.status = err.status
        with contextlib.suppress(ConnectionError):
            await resp.write(sse_error(err))

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
        if s is not None and not isinstance(s, bool):
            return f"'stream' must be true or false, got {s!r}"
        return None

    def _bad_before_flow(self, e: _Entry, key: str | None, message: str) -> web.Response:
        """A malformed body: 401 first if the key is bad too (the policy records either)."""
        try:
            org = self.pd.engine.classifier.org_of(key)
        except Refused as exc:
            self.pd.engine.refuse(("", "", ""), exc.reason)
            return self._refuse(e, http_error_of(exc))
        e.flow = (org.name, "", "")
        self.pd.engine.refuse(e.flow, "bad_request")
        return self._refuse(e, HTTPError(400, "invalid_request_error", "bad_request", message))

    @staticmethod
    def _refuse(e: _Entry, err: HTTPError, extra: Mapping[str, str] | None = None) -> web.Response:
        e.status = err.status
        e.reason = e.reason or err.code
        return _error(err, extra)

    def _log(self, e: _Entry, now: float) -> None:
        if not access.isEnabledFor(logging.INFO):
            return
        r = e.r
        flow = tuple(r.flow) if r is not None else e.flow
        org, cls, pool = flow if flow is not None else ("", "", "")
        outcome = e.outcome
        reason = e.reason
        wait = None
        charged = 0.0
        backend = None
        tries = 0
        if r is not None:
            outcome = r.outcome or ("running" if e.status == 499 else None)
            reason = r.reason or (reason if outcome != "completed" else None)
            tries = r.tries
            charged = r.cost * r.tries
            backend = r.backend
            if r.started_at is not None:
                wait = round(r.started_at - r.arrival, 6)
        elif e.status == 200:
            outcome = "joined"  # an Idempotency-Key joined a running request
        elif outcome is None:
            outcome = "refused"
        u = e.usage if isinstance(e.usage, dict) else {}
        line = {"ts": round(time.time(), 3), "path": e.path, "status": e.status, "org": org, "class": cls,
                "pool": pool, "model": e.model if isinstance(e.model, str) else None, "stream": e.stream,
                "outcome": outcome, "reason": reason, "wait": wait, "tries": tries, "backend": backend,
                "cost_charged": charged, "prompt_tokens": u.get("prompt_tokens"),
                "completion_tokens": u.get("completion_tokens"), "duration": round(now - e.t0, 6)}
        if e.stream:
            line["events"] = e.events
        # makeRecord + handle: what access.info does, without looking up the caller's frame
        access.handle(access.makeRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, _dumps(line), (), None))
