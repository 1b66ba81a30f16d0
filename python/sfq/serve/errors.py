"""Status codes and OpenAI-shaped error bodies for what the policy layer raises.

One table, as docs/gateway.md ("Status codes") documents it: 400 malformed, 401 key,
403 class, 404 model, 408 the body came too slowly, 413 body too large, 429 (always with
``Retry-After`` in whole seconds) queue full or org over its rate, 504 queue age or deadline
ran out, 502 a backend answered with an error, 503 no backend could be reached, the retries
ran out, or the gateway is shutting down.

Every error carries ``x-should-retry`` (the header the official OpenAI clients obey): ``false``
where sending the same request again cannot help (a malformed request, a bad key, a deadline
that ran out), ``true`` where it can (429, 503, a backend's 5xx).

Nothing a backend said reaches a client: a backend's URL, its error body and its headers
(which may echo the gateway's own provider key) go to the operator's log under the
request's id; the client gets a fixed message naming what failed, and the same id
(``x-request-id``, and ``request_id`` in the body) to quote.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from .. import errors as _errors
from ..errors import (
    BackendError,
    BackendHTTPError,
    BackendRateLimited,
    BackendTimeout,
    BackendUnavailable,
    DeadlineExceeded,
    DispatcherClosed,
    NoHealthyBackend,
    Refused,
    StreamInterrupted,
    whole_seconds,
)

__all__ = ["HTTPError", "REFUSALS", "http_error_of", "error_body", "sse_error", "should_retry"]

#: statuses a retry of the same request can help (RFC 9110's transient ones, and 429)
_RETRYABLE = frozenset((408, 409, 429, 500, 502, 503))


def should_retry(status: int) -> bool:
    """The default ``x-should-retry`` of a status: True for 408, 409, 429, 500, 502, 503."""
    return status in _RETRYABLE


class HTTPError(NamedTuple):
    """What the client gets: ``status``, OpenAI's ``type`` and ``code``, a message, the
    ``Retry-After`` seconds (whole, >= 1) when trying later helps, and whether a retry can
    help at all (``retry``; ``None``: :func:`should_retry` of the status)."""

    status: int
    type: str
    code: str
    message: str
    retry_after: int | None = None
    retry: bool | None = None
    #: the request field at fault (OpenAI's ``param``), when known
    param: str | None = None
    #: ``retry-after-ms``: the same wait in whole milliseconds (rounded up), where the gateway
    #: knows it that closely (an org's rate: the refill); the official OpenAI clients read it
    #: before ``Retry-After``
    retry_after_ms: int | None = None

    def headers(self) -> dict[str, str]:
        again = should_retry(self.status) if self.retry is None else self.retry
        h = {"x-should-retry": "true" if again else "false"}
        if self.retry_after is not None:
            h["Retry-After"] = str(self.retry_after)
        if self.retry_after_ms is not None:
            h["retry-after-ms"] = str(self.retry_after_ms)
        return h


#: a refusal's reason -> (status, type, code): the library's one table (``sfq.errors.REFUSALS``),
#: less the reasons only an embedder's own flows meet (an org the policy does not know)
REFUSALS: dict[str, tuple[int, str, str]] = {k: v for k, v in _errors.REFUSALS.items() if k != "unknown_org"}

#: refusals whose text may carry what the operator's setup looks like (a Redis address):
#: the client gets this instead, the log the original
_REFUSAL_TEXT = {"state_unavailable": "the gateways' shared state cannot be reached; try again shortly"}


def http_error_of(exc: BaseException) -> HTTPError:
    """The client's answer for an exception of the policy layer (or its backends). The
    message never quotes a backend: see the module's docstring."""
    if isinstance(exc, Refused):
        status, typ, code = REFUSALS.get(exc.reason, (503, "server_error", exc.reason))
        ra = whole_seconds(exc.retry_after) if status == 429 or exc.retry_after is not None else None
        # a deadline or queue age that ran out: the same request would wait as long again
        # (a spent budget: no retry helps before the period ends, hours or days away)
        ms = _errors.retry_after_ms(exc)  # (an org's rate: the refill, to the millisecond)
        return HTTPError(status, typ, code, _REFUSAL_TEXT.get(exc.reason) or str(exc), ra,
                         False if status == 504 or exc.reason == "budget_exhausted" else None, None, ms)
    if isinstance(exc, DeadlineExceeded):
        return HTTPError(504, "timeout_error", "deadline_exceeded", str(exc), None, False)
    if isinstance(exc, BackendRateLimited):
        ra = None if exc.retry_after is None else whole_seconds(exc.retry_after)
        return HTTPError(503, "server_error", "upstream_rate_limited",
                         "the backends are rate limiting and the retries allowed ran out", ra, True)
    if isinstance(exc, BackendTimeout):
        return HTTPError(503, "server_error", "upstream_timeout",
                         "no backend answered in time (after the retries allowed)", None, True)
    if isinstance(exc, BackendUnavailable):
        return HTTPError(503, "server_error", "upstream_unavailable",
                         "no backend could be reached (after the retries allowed)", None, True)
    if isinstance(exc, NoHealthyBackend):
        after: object = getattr(exc, "retry_after", None)  # set by the request engine
        ra = whole_seconds(float(after)) if isinstance(after, (int, float)) else 1
        return HTTPError(503, "server_error", "upstream_unavailable",
                         "no backend of this model's pool is in rotation", ra, True)
    if isinstance(exc, DispatcherClosed):
        return HTTPError(503, "server_error", "shutting_down", "the gateway is shutting down", None, True)
    if isinstance(exc, BackendHTTPError) and exc.status == 503:
        ra = None if exc.retry_after is None else whole_seconds(exc.retry_after)
        return HTTPError(503, "server_error", "upstream_unavailable",
                         "the backends are unavailable and the retries allowed ran out", ra, True)
    if isinstance(exc, BackendHTTPError) and exc.client_fault:
        # the client's to fix (a context-length error, an unknown parameter): the upstream's own
        # status and words, secrets and addresses redacted
        e = exc.to_openai()["error"]
        param = e.get("param")
        return HTTPError(int(exc.status or 400), str(e["type"]), str(e["code"]), str(e["message"]), None, None,
                         param if isinstance(param, str) else None)
    if isinstance(exc, BackendHTTPError):
        st = exc.status
        return HTTPError(502, "server_error", "upstream_error",
                         f"a backend answered with an error (HTTP {st})" if st else "a backend answered with an error",
                         None, st is None or should_retry(st))
    if isinstance(exc, StreamInterrupted) and exc.status is None and not exc.unhealthy:
        # an error event inside the backend's stream: the request's, not the backend's
        return HTTPError(502, "server_error", "upstream_error", "a backend failed: it reported an error mid-stream")
    if isinstance(exc, BackendError):
        return HTTPError(502, "server_error", "upstream_error", "a backend failed")
    return HTTPError(500, "server_error", "internal_error", "the gateway failed to serve this request")


def error_body(err: HTTPError, request_id: str | None = None) -> dict[str, Any]:
    e: dict[str, Any] = {"message": err.message, "type": err.type, "code": err.code, "param": err.param}
    if request_id is not None:
        e["request_id"] = request_id
    return {"error": e}


def sse_error(err: HTTPError, request_id: str | None = None) -> bytes:
    """The event that ends a stream that failed after it started (never a silent cut)."""
    body = error_body(err, request_id)
    body["error"]["status"] = err.status
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
