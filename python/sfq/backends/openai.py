"""``OpenAIBackend``: an OpenAI-compatible HTTP server (vLLM, SGLang, llama.cpp's
``llama-server``, TGI, ...), with one pool of kept-alive connections per backend.

Requests go through the lean HTTP/1.1 client of ``_http.py`` (asyncio transports, replies
parsed by httptools); health checks and metrics fetches through an aiohttp session of their
own (one connection, so that a burst of requests never starves them).

Speaks ``POST /v1/completions`` and ``POST /v1/chat/completions``, plain (one JSON reply)
and streaming (server-sent events, ``data: {...}`` up to ``data: [DONE]``). Streaming
requests ask the server for usage (``stream_options: {"include_usage": true}``); every
event is yielded, the final usage-only chunk included (the dispatcher hides it from callers
that had not asked for usage).

Every failure is raised as an ``sfq.errors.BackendError`` subclass; ``unhealthy`` says
whether it counts against the backend (the dispatcher decides when the backend is down):

=====================================  ==========================  ===========
what happened                          error                       unhealthy?
=====================================  ==========================  ===========
connection refused / unreachable       ``BackendUnavailable``      yes (``never_sent``)
connection reset / dropped             ``BackendUnavailable``      yes
no connection / reply / next bytes     ``BackendTimeout``          yes
  within the configured time
a stream past its ``stream_timeout``   ``BackendTimeout``          no
HTTP 429                               ``BackendRateLimited``      no (``retry_after``)
other HTTP status >= 400               ``BackendHTTPError``        5xx: yes, 4xx: no
stream cut before ``[DONE]``           ``StreamInterrupted``       yes
error event inside a stream            ``StreamInterrupted``       no
reply that is not JSON                 ``BackendError``            yes
=====================================  ==========================  ===========

Resending: a request is sent again (on another connection, at most twice) only when it
provably never reached the server: the connection came from the keep-alive pool and was found
closed (or with bytes of the server's waiting on it) the moment before the request would have
been written, so nothing was. With ``idempotent=True`` (the caller's promise that a duplicate
is harmless) a connection that failed before any reply is also resent. A connection that drops
once the request was written (with no reply byte, fresh or reused), a timeout or an HTTP error
is never resent here. Idle pooled connections are dropped after ``keepalive_timeout`` seconds
(below the 5 s most servers use), which keeps stale connections rare in the first place.

Cancelling the calling task closes the connection, which llama.cpp, vLLM and SGLang all
take as "stop generating".
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import json
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import aiohttp
import orjson

from ..errors import (
    BackendError,
    BackendHTTPError,
    BackendRateLimited,
    BackendTimeout,
    BackendUnavailable,
    StreamInterrupted,
)
from ._http import (
    ConnectFailed,
    Disconnected,
    HTTPPool,
    NotWritten,
    Origin,
    ProtocolError,
    Reply,
    Timeout,
    header_lines,
)
from .base import ENDPOINTS, Backend, JSONBody, JSONEvent, body_bytes
from .probe import SaturationProbe
from .sse import DONE, Payload, SSEParser

__all__ = ["OpenAIBackend"]

_BODY_SNIPPET = 2000  # characters of an error body kept on the exception
#: bytes of an error reply read for its message; the rest is not waited for (the connection is dropped)
_ERROR_READ = 64 << 10
_RESENDS = 2
#: headers the client itself writes (a request's framing): not accepted in ``headers``
_FRAMING = ("content-length", "transfer-encoding")
#: event payloads larger than this are decoded in a worker thread (the GIL's switch interval
#: lets the event loop run meanwhile), so one huge event does not stall every other request
_BIG_EVENT = 1 << 20
_PROBE_BODY = {"prompt": "", "max_tokens": 1}


#: request bodies as sent upstream: compact, ASCII-only (so encoding them cannot fail)
_encode = json.JSONEncoder(separators=(",", ":")).encode


#: every digit to "0", every other byte to " ": after it, a run of 19 zeros may be an integer
#: orjson would read as a float (past 64 bits) where ``json`` keeps it exact
_DIGITS = bytes(0x30 if 0x30 <= i <= 0x39 else 0x20 for i in range(256))
_LONG_NUMBER = b"0" * 19


def _loads(raw: bytes) -> Any:
    """A reply or an event as ``json.loads`` reads it, at orjson's speed (about 1 us for an
    event where ``json`` takes 4): orjson, unless the text has a run of 19 digits or more,
    and ``json`` for what orjson refuses (``NaN``, ``Infinity``, UTF-16, ...), so that the same
    documents parse to the same values and the same ones fail (``ValueError``)."""
    # (find, not ``in``: a bytes ``in`` tries the operand as an int first, and makes and clears
    # a TypeError for it, every time)
    if raw.translate(_DIGITS).find(_LONG_NUMBER) < 0:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` in seconds (>= 0): delta-seconds or an HTTP-date; ``None`` when absent
    or unparsable. ``now``: the wall-clock time for HTTP-dates (default ``time.time()``)."""
    if value is None:
        return None
    v = value.strip()
    try:
        secs = float(v)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(v)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        secs = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(secs):
        return None
    return max(0.0, secs)


class OpenAIBackend(Backend):
    """One OpenAI-compatible inference server (vLLM, SGLang, llama.cpp's ``llama-server``, TGI,
    a hosted API) as :class:`sfq.Dispatcher` drives it: ``/v1/completions`` and
    ``/v1/chat/completions``, plain and streamed, with timeouts, health checks, its own API
    key and an optional saturation probe. ``url`` is the server's root (e.g.
    ``http://10.0.0.5:8000``; a trailing ``/v1`` is accepted). Its failures are
    :class:`sfq.BackendError` s that keep the server's own status in ``status``.

    Parameters
    ----------
    url:
        the server's base URL.
    model:
        the model it serves (its pool in the dispatcher); ``None`` = any model name.
    name:
        the backend's name in stats and errors (default: ``url``).
    max_in_flight:
        requests the dispatcher keeps in flight here at most.
    max_context:
        tokens (prompt + max_tokens) a request may need here; ``None`` = no limit.
    probe:
        ``True`` for a default ``SaturationProbe``, a probe, or ``None``/``False`` for none.
    api_key:
        sent as ``Authorization: Bearer ...``.
    headers:
        extra headers for every request.
    connect_timeout:
        seconds to establish a connection; ``None`` = no limit (health checks still give up after 5).
    read_timeout:
        seconds the server may stay silent: before the reply's headers (for a plain request
        that includes the whole generation) and between two reads of a stream; ``None`` = no limit.
    timeout:
        seconds for a whole plain request, or a stream's headers; ``None`` = no limit.
    stream_timeout:
        seconds a whole stream may take, headers to ``[DONE]`` (default 1800); past it the
        stream ends with ``BackendTimeout`` however busily the server keeps sending tokens or
        keep-alive comments; ``None`` = no limit.
    keepalive_timeout:
        seconds an idle pooled connection is kept for reuse (default 2; keep it below the
        server's own keep-alive timeout).
    health_path, metrics_path:
        where ``check_health`` and ``fetch_metrics`` look. ``check_health`` asks
        ``health_path`` and, when the server has no such route (404/405), ``/v1/models``, then
        a one-token completion (or chat completion): it works on any OpenAI-compatible server,
        and remembers which route answered.
    trace_configs:
        ``aiohttp.TraceConfig`` objects for the aiohttp session of the health checks and
        metrics fetches (tracing, tests). Requests do not go through aiohttp.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        name: str | None = None,
        max_in_flight: int = 8,
        max_context: int | None = None,
        probe: SaturationProbe | bool | None = None,
        api_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        connect_timeout: float | None = 5.0,
        read_timeout: float | None = None,
        timeout: float | None = 600.0,
        stream_timeout: float | None = 1800.0,
        keepalive_timeout: float = 2.0,
        health_path: str = "/health",
        metrics_path: str = "/metrics",
        trace_configs: Sequence[aiohttp.TraceConfig] = (),
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// URL, got {url!r}")
        base = url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        origin = Origin(base)
        if probe is True:
            probe = SaturationProbe()
        elif probe is False:
            probe = None
        super().__init__(name or url, model=model, max_in_flight=max_in_flight, max_context=max_context,
                         probe=probe)
        for what, v in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout), ("timeout", timeout),
                        ("stream_timeout", stream_timeout), ("keepalive_timeout", keepalive_timeout)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{what} must be a number > 0 or None, got {v!r}")
        self.url = base
        self._urls = {ep: f"{base}/v1/{ep}" for ep in ENDPOINTS}
        self._health_url = base + health_path
        self._models_url = base + "/v1/models"
        self._health_route = "health"  # which check answers here: health, models or completion
        self._metrics_url = base + metrics_path
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        if headers:
            self._headers.update(headers)
        for hk, hv in self._headers.items():
            if not isinstance(hk, str) or not isinstance(hv, str):
                raise ValueError(f"header names and values must be strings, got {hk!r}: {hv!r}")
            if hk.lower() in _FRAMING:
                raise ValueError(f"header {hk!r} cannot be set: the client writes a request's framing itself")
        # each endpoint's request head, made once: request line, Host, the headers, and the
        # Content-Length's name (its value and the body follow per request)
        merged: dict[str, tuple[str, str]] = {"host": ("Host", origin.authority), "user-agent": ("User-Agent", "sfq")}
        if origin.credentials is not None:  # http://user:password@host
            token = base64.b64encode(":".join(origin.credentials).encode()).decode()
            merged["authorization"] = ("Authorization", f"Basic {token}")
        for hk, hv in self._headers.items():  # one line per name whatever its case: the last one given
            merged[hk.lower()] = (hk, hv)
        lines = header_lines(dict(merged.values()))
        self._origin = origin
        self._heads = {ep: f"POST {origin.path}/v1/{ep} HTTP/1.1\r\n".encode("latin-1") + lines + b"Content-Length: "
                       for ep in ENDPOINTS}
        self.connect_timeout = None if connect_timeout is None else float(connect_timeout)
        self.read_timeout = None if read_timeout is None else float(read_timeout)
        self.timeout = None if timeout is None else float(timeout)
        self.stream_total = None if stream_timeout is None else float(stream_timeout)
        self.keepalive_timeout = float(keepalive_timeout)
        self._trace_configs = list(trace_configs)
        self.resent = 0  # requests sent again because they provably never got through
        self._aux_timeout = aiohttp.ClientTimeout(total=max(connect_timeout or 0.0, 5.0) + 5.0,
                                                  connect=connect_timeout or 5.0)
        self._pool: HTTPPool | None = None
        self._aux: aiohttp.ClientSession | None = None  # health checks and metrics: their own connection

    @property
    def headers(self) -> dict[str, str]:
        """The headers sent with every request (its ``Authorization`` included): a copy."""
        return dict(self._headers)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self._pool is None or self._pool.closed:
            # no connection limit of its own: the dispatcher already bounds what is in flight
            self._pool = HTTPPool(self._origin, connect_timeout=self.connect_timeout,
                                  keepalive_timeout=self.keepalive_timeout)
        if self._aux is None or self._aux.closed:
            # the probe's and health checks' own kept-alive connection: a burst of requests never
            # takes it, so a server that serves HTTP from a fixed thread pool (llama-server: np + 4
            # threads, a kept-alive connection holds one) cannot starve the probe of a connection
            self._aux = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), headers=self._headers,
                                              trace_configs=self._trace_configs or None)

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()  # every connection aborted: a request still running fails
        aux, self._aux = self._aux, None
        if aux is not None:
            await aux.close()

    async def _aux_sess(self) -> aiohttp.ClientSession:
        if self._aux is None or self._aux.closed:
            await self.start()
        assert self._aux is not None
        return self._aux

    # ---------------------------------------------------------------- requests
    def _url(self, endpoint: str) -> str:
        try:
            return self._urls[endpoint]
        except KeyError:
            raise ValueError(f"unknown endpoint {endpoint!r}; expected one of {ENDPOINTS}") from None

    async def _post(self, endpoint: str, url: str, body: Mapping[str, Any], stream: bool,
                    idempotent: bool = False) -> Reply:
        """POST and return a reply with a 2xx status whose head has come; every failure mapped
        to an sfq error. The bound of a plain request (``timeout``) covers its body too; a
        stream's bound here is its head's (the caller moves it to the stream's total)."""
        pool = self._pool
        if pool is None or pool.closed:
            await self.start()
            pool = self._pool
            assert pool is not None
        data = body_bytes(body)  # a client's body, unchanged: sent as it came
        if data is None:
            try:  # once, whatever the resends; the head says JSON
                data = _encode(body).encode()
            except Exception as exc:  # not JSON-serialisable
                raise self._map(exc, url, "POST") from exc
        msg = b"%b%d\r\n\r\n%b" % (self._heads[endpoint], len(data), data)
        now = pool.loop.time()
        t = self.timeout
        if stream and self.stream_total is not None and (t is None or self.stream_total < t):
            t, kind = self.stream_total, "stream"
        else:
            kind = "headers" if stream else "timeout"
        deadline = math.inf if t is None else now + t
        for attempt in range(_RESENDS + 1):
            try:
                reply = await pool.send(msg, deadline=deadline, kind=kind, seconds=t, silence=self.read_timeout)
                break
            except NotWritten as exc:
                # a kept-alive connection found closed before anything was written: the request
                # provably never left
                if attempt == _RESENDS or pool.closed:
                    raise self._map(exc, url, "POST", never_sent=True) from exc
                self.resent += 1
            except Disconnected as exc:
                # written, then the connection ended before a reply: resent only when the caller
                # said a duplicate is harmless
                if not idempotent or attempt == _RESENDS or pool.closed:
                    raise self._map(exc, url, "POST") from exc
                self.resent += 1
            except Timeout as exc:
                if kind != "timeout" and exc.kind in ("headers", "stream"):
                    raise BackendTimeout(f"backend {self.name!r}: POST {url}: no reply headers within {t:g} s",
                                         backend=self.name, never_sent=exc.never_sent) from exc
                raise self._map(exc, url, "POST") from exc
            except Exception as exc:
                raise self._map(exc, url, "POST") from exc
        status = reply.status
        if status >= 400:
            headers = dict(reply.header_items())
            retry_after = parse_retry_after(reply.header("retry-after"))
            try:
                text = (await reply.read_some(_ERROR_READ)).decode("utf-8", "replace")
            except Exception:
                text = ""
            finally:
                reply.close()
            cls = BackendRateLimited if status == 429 else BackendHTTPError
            raise cls(
                f"backend {self.name!r}: HTTP {status} from POST {url}: {text[:200]}",
                backend=self.name, status=status, body=text[:_BODY_SNIPPET], unhealthy=status >= 500,
                headers=headers, retry_after=retry_after)
        return reply

    def _map(self, exc: BaseException, url: str, verb: str, never_sent: bool = False) -> BackendError:
        where = f"backend {self.name!r}: {verb} {url}"
        if isinstance(exc, BackendError):
            return exc
        if isinstance(exc, Timeout):
            s = exc.seconds
            what = ("the server sent nothing for" if exc.kind == "silence" else
                    "no connection within" if exc.kind == "connect" else
                    "no complete reply within" if exc.kind == "timeout" else f"the {exc.kind} bound of")
            return BackendTimeout(f"{where}: timed out ({what} {s:g} s)" if s is not None else f"{where}: timed out",
                                  backend=self.name, never_sent=never_sent or exc.never_sent)
        if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
            return BackendTimeout(f"{where}: timed out ({type(exc).__name__}: {exc})", backend=self.name,
                                  never_sent=never_sent or isinstance(exc, aiohttp.ClientConnectorError))
        if isinstance(exc, (ConnectFailed, aiohttp.ClientConnectorError)):
            return BackendUnavailable(f"{where}: cannot connect ({exc})", backend=self.name, never_sent=True)
        if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError)):
            return BackendUnavailable(f"{where}: connection lost ({type(exc).__name__}: {exc})", backend=self.name,
                                      never_sent=never_sent)
        if isinstance(exc, ProtocolError):
            return BackendError(f"{where}: the reply is not HTTP this client reads ({exc})", backend=self.name)
        return BackendError(f"{where}: {type(exc).__name__}: {exc}", backend=self.name)

    async def complete(self, endpoint: str, body: dict[str, Any], *, idempotent: bool = False) -> dict[str, Any]:
        url = self._url(endpoint)
        reply = await self._post(endpoint, url, body, False, idempotent)
        raw = reply.body()  # most often it all came with the head
        if raw is None:
            try:
                raw = await reply.read()  # a failure or a cancellation drops the connection: the server stops
            except Exception as exc:
                raise self._map(exc, url, "POST") from exc
        try:
            out = _loads(raw)
        except ValueError:
            text = raw[:_BODY_SNIPPET].decode("utf-8", "replace")
            raise BackendError(f"backend {self.name!r}: the reply from POST {url} is not JSON: {text[:200]!r}",
                               backend=self.name, status=reply.status, body=text) from None
        if not isinstance(out, dict):
            raise BackendError(f"backend {self.name!r}: the reply from POST {url} is not a JSON object",
                               backend=self.name, status=reply.status,
                               body=raw[:_BODY_SNIPPET].decode("utf-8", "replace"))
        return out

    async def stream(self, endpoint: str, body: dict[str, Any], *,
                     idempotent: bool = False) -> AsyncIterator[dict[str, Any]]:
        url = self._url(endpoint)
        if type(body) is JSONBody:
            body = body.streamed_with_usage()
        else:
            body = dict(body)
            body["stream"] = True
            so = body.get("stream_options")
            if not (isinstance(so, Mapping) and so.get("include_usage")):
                body["stream_options"] = {**(so if isinstance(so, Mapping) else {}), "include_usage": True}
        pool = self._pool
        t0 = (pool.loop if pool is not None else asyncio.get_running_loop()).time()
        reply = await self._post(endpoint, url, body, True, idempotent)
        total = self.stream_total
        # the head came: from here the stream's whole length is bounded (from its start)
        reply.set_deadline(math.inf if total is None else t0 + total, "stream", total)
        done = False
        chunks = 0
        parser = SSEParser()
        take = reply.take
        more = reply.more
        try:
            while not done:
                try:
                    await more()  # at once when a piece is waiting
                    piece = take()
                    if not piece:
                        if piece is None:
                            break
                        continue
                except Exception as exc:
                    if isinstance(exc, Timeout) and exc.kind == "stream":
                        raise BackendTimeout(
                            f"backend {self.name!r}: the stream from POST {url} passed its total deadline of "
                            f"{total:g} s after {chunks} events", backend=self.name, unhealthy=False) from exc
                    err = self._map(exc, url, "stream from")
                    raise StreamInterrupted(f"{err} after {chunks} events", backend=self.name, chunks=chunks,
                                            unhealthy=True) from exc
                for payload in parser.feed(piece):
                    if isinstance(payload, bytes):  # a whole one-line event (the common shape)
                        if payload == DONE:
                            done = True
                            break
                        if len(payload) <= _BIG_EVENT and payload.translate(_DIGITS).find(_LONG_NUMBER) < 0:
                            # the common event, decoded here (as _loads and _event would: anything
                            # else, an error event included, takes the path below)
                            try:
                                parsed = orjson.loads(payload)
                            except orjson.JSONDecodeError:
                                parsed = None
                            if type(parsed) is dict and "error" not in parsed:
                                event = JSONEvent(parsed)
                                event.raw = payload
                                chunks += 1
                                yield event
                                continue
                        if len(payload) > _BIG_EVENT:  # decoded off the loop
                            event = await asyncio.to_thread(self._event, payload, url, chunks, True)
                        else:
                            event = self._event(payload, url, chunks, True)
                    elif payload.size > _BIG_EVENT:  # joined and decoded off the loop
                        event = await asyncio.to_thread(self._big_event, payload, url, chunks)
                    else:
                        data = payload.join()
                        if data == DONE:
                            done = True
                            break
                        event = self._event(data, url, chunks)
                    chunks += 1
                    yield event
            if not done:
                raise StreamInterrupted(
                    f"backend {self.name!r}: the stream from POST {url} ended after {chunks} events "
                    "without its end marker (data: [DONE])", backend=self.name, chunks=chunks, unhealthy=True)
        finally:
            if done:
                reply.release()  # back to the pool once the reply's last bytes come
            else:  # an error, a cancellation or the consumer stopped early: drop the connection
                reply.close()

    def _big_event(self, payload: Payload, url: str, chunks: int) -> JSONEvent:
        return self._event(payload.join(), url, chunks)

    def _event(self, payload: bytes, url: str, chunks: int, whole: bool = False) -> JSONEvent:
        """The event ``payload`` as a :class:`JSONEvent`; ``whole``: the payload is the event's
        one ``data: `` line as the server sent it, so it is kept as ``raw`` (an event of several
        data lines, or without the space, keeps none: written out as one line it would not
        be the same event)."""
        try:
            event = _loads(payload)
        except ValueError:
            raise StreamInterrupted(
                f"backend {self.name!r}: event {chunks + 1} of the stream from POST {url} is not JSON: "
                f"{payload[:200]!r}", backend=self.name, chunks=chunks, unhealthy=True) from None
        if not isinstance(event, dict):
            raise StreamInterrupted(f"backend {self.name!r}: event {chunks + 1} of the stream from POST {url} "
                                    "is not a JSON object", backend=self.name, chunks=chunks, unhealthy=True)
        if "error" in event and not event.get("choices"):
            err = event["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            raise StreamInterrupted(
                f"backend {self.name!r}: the server reported an error after {chunks} events of the stream from "
                f"POST {url}: {msg}", backend=self.name, chunks=chunks, unhealthy=False,
                body=json.dumps(err)[:_BODY_SNIPPET])
        ev = JSONEvent(event)
        if whole:
            ev.raw = payload
        return ev

    # ---------------------------------------------------------------- probes
    async def check_health(self) -> bool:
        """True when the server answers: ``health_path`` (2xx), else (no such route: 404/405)
        ``GET /v1/models``, else a one-token completion (``/v1/completions``, then
        ``/v1/chat/completions``). The route that answered is used first next time. Any other
        status, or no answer, is False."""
        routes = ("health", "models", "completion", "chat")
        start = routes.index(self._health_route)
        for route in routes[start:]:
            status = await self._probe_route(route)
            if status is None:
                return False
            if 200 <= status < 300:
                self._health_route = route
                return True
            if status not in (404, 405):
                return False
        return False

    async def _probe_route(self, route: str) -> int | None:
        session = await self._aux_sess()
        try:
            if route in ("completion", "chat"):
                body: dict[str, Any] = dict(_PROBE_BODY)
                if route == "chat":
                    del body["prompt"]
                    body["messages"] = [{"role": "user", "content": "hi"}]
                if self.model is not None:
                    body["model"] = self.model
                ctx = session.post(self._urls["completions" if route == "completion" else "chat/completions"],
                                   json=body, timeout=self._aux_timeout)
            else:
                ctx = session.get(self._health_url if route == "health" else self._models_url,
                                  timeout=self._aux_timeout)
            async with ctx as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None

    async def fetch_metrics(self) -> str:
        session = await self._aux_sess()
        try:
            async with session.get(self._metrics_url, timeout=self._aux_timeout) as resp:
                text = await resp.text(errors="replace")
        except Exception as exc:
            raise self._map(exc, self._metrics_url, "GET") from exc
        if resp.status >= 400:
            raise BackendHTTPError(f"backend {self.name!r}: HTTP {resp.status} from GET {self._metrics_url}",
                                   backend=self.name, status=resp.status, body=text[:_BODY_SNIPPET])
        return text
