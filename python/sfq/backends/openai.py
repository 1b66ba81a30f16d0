"""``OpenAIBackend``: an OpenAI-compatible HTTP server (vLLM, SGLang, llama.cpp's
``llama-server``, TGI, ...) over aiohttp, with one pooled session per backend.

Speaks ``POST /v1/completions`` and ``POST /v1/chat/completions``, plain (one JSON reply)
and streaming (server-sent events, ``data: {...}`` up to ``data: [DONE]``). Streaming
requests ask the server for usage (``stream_options: {"include_usage": true}``); every
event is yielded, the final usage-only chunk included (the dispatcher hides it from callers
that had not asked for usage).

Every failure is raised as an ``sfq.errors.BackendError`` subclass:

=====================================  ==========================  ===========
what happened                          error                       unhealthy?
=====================================  ==========================  ===========
connection refused / reset / dropped   ``BackendUnavailable``      yes
no connection / reply / next bytes     ``BackendTimeout``          yes
  within the configured time
HTTP status >= 400                     ``BackendHTTPError``        5xx: yes, 4xx: no
stream cut before ``[DONE]``           ``StreamInterrupted``       yes
error event inside a stream            ``StreamInterrupted``       no
reply that is not JSON                 ``BackendError``            yes
=====================================  ==========================  ===========

Cancelling the calling task closes the connection, which llama.cpp, vLLM and SGLang all
take as "stop generating".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from ..errors import BackendError, BackendHTTPError, BackendTimeout, BackendUnavailable, StreamInterrupted
from .base import ENDPOINTS, Backend
from .probe import SaturationProbe

__all__ = ["OpenAIBackend"]

_BODY_SNIPPET = 2000  # characters of an error body kept on the exception
#: failures of session.post() that mean "a stale pooled connection", retried on a new one
_STALE_CONNECTION = (aiohttp.ClientConnectionResetError, aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)
_STALE_RETRIES = 2


class OpenAIBackend(Backend):
    """An OpenAI-compatible server at ``url`` (its root, e.g. ``http://10.0.0.5:8000``;
    a trailing ``/v1`` is accepted).

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
        seconds to establish a connection.
    read_timeout:
        seconds the server may stay silent: before the reply's headers (for a plain request
        that includes the whole generation) and between two reads of a stream; ``None`` = no limit.
    timeout:
        seconds for a whole plain request, or a stream's headers; ``None`` = no limit.
    health_path, metrics_path:
        where ``check_health`` (expects 2xx) and ``fetch_metrics`` look.
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
        connect_timeout: float = 5.0,
        read_timeout: float | None = None,
        timeout: float | None = 600.0,
        health_path: str = "/health",
        metrics_path: str = "/metrics",
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// URL, got {url!r}")
        base = url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        if probe is True:
            probe = SaturationProbe()
        elif probe is False:
            probe = None
        super().__init__(name or url, model=model, max_in_flight=max_in_flight, max_context=max_context,
                         probe=probe)
        for what, v in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout), ("timeout", timeout)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{what} must be a number > 0 or None, got {v!r}")
        self.url = base
        self._urls = {ep: f"{base}/v1/{ep}" for ep in ENDPOINTS}
        self._health_url = base + health_path
        self._metrics_url = base + metrics_path
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        if headers:
            self._headers.update(headers)
        self._timeout = aiohttp.ClientTimeout(total=timeout, connect=connect_timeout, sock_read=read_timeout)
        self._stream_timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=read_timeout)
        self._aux_timeout = aiohttp.ClientTimeout(total=max(connect_timeout, 5.0) + 5.0, connect=connect_timeout)
        self._session: aiohttp.ClientSession | None = None
        self._aux: aiohttp.ClientSession | None = None  # health checks and metrics: their own connection
        self._stream_deadline = timeout  # headers of a stream must come within this

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self._session is None or self._session.closed:
            # limit=0: the dispatcher already bounds what is in flight; connections are kept alive
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
                headers=self._headers,
                json_serialize=json.dumps,
            )
        if self._aux is None or self._aux.closed:
            # the probe's and health checks' own kept-alive connection: a burst of requests never
            # takes it, so a server that serves HTTP from a fixed thread pool (llama-server: np + 4
            # threads, a kept-alive connection holds one) cannot starve the probe of a connection
            self._aux = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), headers=self._headers)

    async def close(self) -> None:
        for s in (self._session, self._aux):
            if s is not None:
                await s.close()
        self._session = self._aux = None

    async def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            await self.start()
        assert self._session is not None
        return self._session

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

    async def _post(self, url: str, body: Mapping[str, Any], timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        """POST and return a response with a 2xx status; every failure mapped to an sfq error."""
        session = await self._sess()
        for attempt in range(_STALE_RETRIES + 1):
            try:
                resp = await session.post(url, json=body, timeout=timeout)
                break
            except aiohttp.ClientConnectorError as exc:  # refused, unreachable: not a stale connection
                raise self._map(exc, url, "POST") from exc
            except _STALE_CONNECTION as exc:
                # A pooled keep-alive connection that the server closed just as we reused it:
                # the request never got through (writing it failed, or the server hung up
                # before any reply), so sending it again on another connection is safe.
                if attempt == _STALE_RETRIES or session.closed:  # closed: we are shutting down
                    raise self._map(exc, url, "POST") from exc
            except Exception as exc:
                raise self._map(exc, url, "POST") from exc
        if resp.status >= 400:
            try:
                text = await resp.text(errors="replace")
            except Exception:
                text = ""
            finally:
                resp.close()
            raise BackendHTTPError(
                f"backend {self.name!r}: HTTP {resp.status} from POST {url}: {text[:200]}",
                backend=self.name, status=resp.status, body=text[:_BODY_SNIPPET], unhealthy=resp.status >= 500)
        return resp

    def _map(self, exc: BaseException, url: str, verb: str) -> BackendError:
        where = f"backend {self.name!r}: {verb} {url}"
        if isinstance(exc, BackendError):
            return exc
        if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
            return BackendTimeout(f"{where}: timed out ({type(exc).__name__}: {exc})", backend=self.name)
        if isinstance(exc, aiohttp.ClientConnectorError):
            return BackendUnavailable(f"{where}: cannot connect ({exc})", backend=self.name)
        if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError)):
            return BackendUnavailable(f"{where}: connection lost ({type(exc).__name__}: {exc})", backend=self.name)
        return BackendError(f"{where}: {type(exc).__name__}: {exc}", backend=self.name)

    async def complete(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        url = self._url(endpoint)
        resp = await self._post(url, body, self._timeout)
        ok = False
        try:
            raw = await resp.read()
            ok = True
        except Exception as exc:
            raise self._map(exc, url, "POST") from exc
        finally:
            if ok:
                resp.release()
            else:  # cancelled or failed mid-body: drop the connection so the server stops
                resp.close()
        try:
            reply = json.loads(raw)
        except ValueError:
            text = raw[:_BODY_SNIPPET].decode("utf-8", "replace")
            raise BackendError(f"backend {self.name!r}: the reply from POST {url} is not JSON: {text[:200]!r}",
                               backend=self.name, status=resp.status, body=text) from None
        if not isinstance(reply, dict):
            raise BackendError(f"backend {self.name!r}: the reply from POST {url} is not a JSON object",
                               backend=self.name, status=resp.status,
                               body=raw[:_BODY_SNIPPET].decode("utf-8", "replace"))
        return reply

    async def stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        url = self._url(endpoint)
        body = dict(body)
        body["stream"] = True
        so = body.get("stream_options")
        if not (isinstance(so, Mapping) and so.get("include_usage")):
            body["stream_options"] = {**(so if isinstance(so, Mapping) else {}), "include_usage": True}
        if self._stream_deadline is not None:
            try:
                resp = await asyncio.wait_for(self._post(url, body, self._stream_timeout), self._stream_deadline)
            except asyncio.TimeoutError as exc:
                raise BackendTimeout(f"backend {self.name!r}: POST {url}: no reply headers within "
                                     f"{self._stream_deadline:g} s", backend=self.name) from exc
        else:
            resp = await self._post(url, body, self._stream_timeout)
        done = False
        chunks = 0
        try:
            buf = b""
            data: list[bytes] = []
            it = resp.content.iter_any().__aiter__()
            while not done:
                try:
                    piece = await it.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    err = self._map(exc, url, "stream from")
                    raise StreamInterrupted(f"{err} after {chunks} events", backend=self.name, chunks=chunks,
                                            unhealthy=True) from exc
                buf = buf + piece if buf else piece
                start = 0
                while True:
                    nl = buf.find(b"\n", start)
                    if nl < 0:
                        break
                    line = buf[start:nl]
                    start = nl + 1
                    if line.endswith(b"\r"):
                        line = line[:-1]
                    if line:
                        if line.startswith(b"data:"):
                            data.append(line[6:] if line.startswith(b"data: ") else line[5:])
                        continue  # comments (":"), event:, id:, retry: carry nothing we need
                    if not data:
                        continue
                    payload = data[0] if len(data) == 1 else b"\n".join(data)
                    data = []
                    if payload == b"[DONE]":
                        done = True
                        break
                    event = self._event(payload, url, chunks)
                    chunks += 1
                    yield event
                buf = buf[start:]
            if not done:
                raise StreamInterrupted(
                    f"backend {self.name!r}: the stream from POST {url} ended after {chunks} events "
                    "without its end marker (data: [DONE])", backend=self.name, chunks=chunks, unhealthy=True)
        finally:
            if done:
                resp.release()
            else:  # an error, a cancellation or the consumer stopped early: drop the connection
                resp.close()

    def _event(self, payload: bytes, url: str, chunks: int) -> dict[str, Any]:
        try:
            event = json.loads(payload)
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
        return event

    # ---------------------------------------------------------------- probes
    async def check_health(self) -> bool:
        session = await self._aux_sess()
        try:
            async with session.get(self._health_url, timeout=self._aux_timeout) as resp:
                await resp.read()
                return 200 <= resp.status < 300
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

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
