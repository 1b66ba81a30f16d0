"""Status codes and OpenAI-shaped error bodies for what the policy layer raises.

One table, as docs/gateway.md ("Status codes") documents it: 400 malformed, 401 key,
403 class, 404 model, 429 (always with ``Retry-After`` in whole seconds) queue full or org
over its rate, 504 queue age or deadline ran out, 502 a backend answered with an error, 503
no backend could be reached, the retries ran out, or the gateway is shutting down.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

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
)

__all__ = ["HTTPError", "REFUSALS", "http_error_of", "error_body", "sse_error"]


class HTTPError(NamedTuple):
    """What the client gets: ``status``, OpenAI's ``type`` and ``code``, a message, and the
    ``Retry-After`` seconds (whole, >= 1) when trying later helps."""

    status: int
    type: str
    code: str
    message: str
    retry_after: int | None = None

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


#: a refusal's reason -> (status, type, code)
REFUSALS: dict[str, tuple[int, str, str]] = {
    "unauthenticated": (401, "authentication_error", "invalid_api_key"),
    "class_not_allowed": (403, "permission_error", "class_not_allowed"),
    "unknown_model": (404, "not_found_error", "model_not_found"),
    "bad_request": (400, "invalid_request_error", "bad_request"),
    "too_large": (400, "invalid_request_error", "context_length_exceeded"),
    "rate_limited": (429, "rate_limit_error", "rate_limited"),
    "queue_full": (429, "rate_limit_error", "queue_full"),
    "queue_timeout": (504, "timeout_error", "queue_timeout"),
    "deadline": (504, "timeout_error", "deadline_exceeded"),
    "closed": (503, "server_error", "shutting_down"),
}


def _whole_seconds(s: float | None) -> int:
    """``Retry-After`` as whole seconds, rounded up, at least 1 (a 0 invites a busy loop)."""
    if s is None or not math.isfinite(s):
        return 1
    return max(1, math.ceil(s - 1e-9))


def http_error_of(exc: BaseException) -> HTTPError:
    """The client's answer for an exception of the policy layer (or its backends)."""
    if isinstance(exc, Refused):
        status, typ, code = REFUSALS.get(exc.reason, (503, "server_error", exc.reason))
        ra = _whole_seconds(exc.retry_after) if status == 429 else None
        return HTTPError(status, typ, code, str(exc), ra)
    if isinstance(exc, DeadlineExceeded):
        return HTTPError(504, "timeout_error", "deadline_exceeded", str(exc))
    if isinstance(exc, BackendRateLimited):
        ra = None if exc.retry_after is None else _whole_seconds(exc.retry_after)
        return HTTPError(503, "server_error", "upstream_rate_limited",
                         f"the backends are rate limiting and the retries ran out: {exc}", ra)
    if isinstance(exc, BackendTimeout):
        return HTTPError(503, "server_error", "upstream_timeout",
                         f"no backend answered in time (after the retries allowed): {exc}")
    if isinstance(exc, BackendUnavailable):
        return HTTPError(503, "server_error", "upstream_unavailable",
                         f"no backend could be reached (after the retries allowed): {exc}")
    if isinstance(exc, (NoHealthyBackend, DispatcherClosed)):
        return HTTPError(503, "server_error", "upstream_unavailable", str(exc))
    if isinstance(exc, BackendHTTPError) and exc.status == 503:
        ra = None if exc.retry_after is None else _whole_seconds(exc.retry_after)
        return HTTPError(503, "server_error", "upstream_unavailable",
                         f"the backends are unavailable and the retries ran out: {exc}", ra)
    if isinstance(exc, BackendHTTPError):
        return HTTPError(502, "server_error", "upstream_error", f"a backend answered with an error: {exc}")
    if isinstance(exc, BackendError):
        return HTTPError(502, "server_error", "upstream_error", f"a backend failed: {exc}")
    return HTTPError(500, "server_error", "internal_error", f"{type(exc).__name__}: {exc}")


def error_body(err: HTTPError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "code": err.code, "param": None}}


def sse_error(err: HTTPError) -> bytes:
    """The event that ends a stream that failed after it started (never a silent cut)."""
    body = error_body(err)
    body["error"]["status"] = err.status
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
