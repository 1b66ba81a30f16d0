"""The errors sfq raises: one family, each error with the answer a gateway would give.

Every exception sfq raises for a request is an :class:`SFQError`: ``http_status`` is the HTTP
status a gateway answers for it (``sfq serve`` answers exactly that), ``retry_after`` the
seconds after which trying again may help (or ``None``), and ``to_openai()`` the OpenAI-shaped
error body, so one handler in an embedder's proxy maps them all::

    except sfq.SFQError as exc:
        headers = {} if exc.retry_after is None else {"Retry-After": str(math.ceil(exc.retry_after))}
        return web.json_response(exc.to_openai(), status=exc.http_status, headers=headers)

Bad input in a request body is :class:`BadRequest` (also a ``ValueError``); a request refused
before it reached a backend is :class:`Refused` (its ``reason`` says why); a backend's failure
is a :class:`BackendError` (the upstream's own status, when it answered, is its ``status``).
Errors in the arguments of the scheduler core itself are the builtin ``ValueError``,
``TypeError`` and ``OverflowError``, as for any Python container.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = [
    "SFQError",
    "BadRequest",
    "SchedulerBusy",
    "BackendError",
    "BackendUnavailable",
    "BackendTimeout",
    "BackendHTTPError",
    "BackendRateLimited",
    "StreamInterrupted",
    "NoHealthyBackend",
    "DispatcherClosed",
    "UnknownModel",
    "RequestTooLarge",
    "BadRequest",
    "InvalidCost",
    "InvalidCostType",
    "InvalidTimeout",
    "PolicyError",
    "Refused",
    "DeadlineExceeded",
    "REFUSALS",
    "whole_seconds",
]

#: a refusal's ``reason`` -> the gateway's answer: (HTTP status, OpenAI error ``type``, ``code``).
#: A reason not listed is answered (503, ``server_error``, the reason itself).
REFUSALS: dict[str, tuple[int, str, str]] = {
    "unauthenticated": (401, "authentication_error", "invalid_api_key"),
    "class_not_allowed": (403, "permission_error", "class_not_allowed"),
    "unknown_org": (403, "permission_error", "unknown_org"),
    "unknown_model": (404, "not_found_error", "model_not_found"),
    "bad_request": (400, "invalid_request_error", "bad_request"),
    "too_large": (400, "invalid_request_error", "context_length_exceeded"),
    "rate_limited": (429, "rate_limit_error", "rate_limited"),
    "queue_full": (429, "rate_limit_error", "queue_full"),
    # the org's spending budget (orgs.NAME.budget) cannot cover the request until the period ends
    "budget_exhausted": (429, "insufficient_quota", "budget_exhausted"),
    "too_many_users": (429, "rate_limit_error", "too_many_users"),
    "queue_timeout": (504, "timeout_error", "queue_timeout"),
    "deadline": (504, "timeout_error", "deadline_exceeded"),
    # answered at once: the request cannot start before its deadline at the pool's measured rate
    # (a class's refuse_unmeetable); 429, as for the other refusals of load, with a Retry-After
    "deadline_unmeetable": (429, "rate_limit_error", "deadline_unmeetable"),
    "closed": (503, "server_error", "shutting_down"),
    "state_unavailable": (503, "server_error", "state_unavailable"),
}


def whole_seconds(s: float | None) -> int:
    """``Retry-After`` as whole seconds: rounded up, at least 1 (a 0 invites a busy loop); 1 for
    ``None`` or a number that is not finite. The one rule of the gateway and ``sfq.asgi``."""
    if s is None or not math.isfinite(s):
        return 1
    return max(1, math.ceil(s - 1e-9))


def retry_after_ms(exc: BaseException) -> int | None:
    """``retry-after-ms`` (whole milliseconds, rounded up, at least 1) where the wait is known
    that closely: an org's rate (``rate_limited``: the refill); ``None`` otherwise. The
    official OpenAI clients read it before ``Retry-After``. The one rule of the gateway and
    ``sfq.asgi``."""
    after = getattr(exc, "retry_after", None)
    if getattr(exc, "reason", None) != "rate_limited" or not isinstance(after, (int, float)) or not math.isfinite(
            after):
        return None
    return max(1, math.ceil(after * 1000.0 - 1e-6))


class SFQError(Exception):
    """Base class of every error sfq raises, and what a gateway answers for it.

    ``http_status``: the HTTP status (400 bad input, 401 unknown key, 403 not allowed, 404
    unknown model, 429 over a limit, 502 a backend answered with an error, 503 no backend
    could serve it, 504 the deadline or the queue age ran out; 500 for an error that is not
    the request's). ``error_type`` and ``error_code``: OpenAI's ``type`` and ``code`` for it.
    ``retry_after``: seconds after which trying again may help, ``None`` when unknown or when
    it will not help. ``to_openai()``: the body ``{"error": {"message", "type", "code",
    "param"}}`` to send (its message never quotes a backend's URL or reply: ``str(exc)``,
    for your logs, does).
    """

    http_status: int = 500
    error_type: str = "server_error"
    error_code: str = "internal_error"
    retry_after: float | None = None
    #: the request field at fault (OpenAI's ``param``), when one is
    param: str | None = None

    def client_message(self) -> str:
        """The message for the client (``to_openai()``); ``str(exc)`` may say more."""
        return str(self)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI-shaped error body for this error."""
        return {"error": {"message": self.client_message(), "type": self.error_type, "code": self.error_code,
                          "param": self.param}}


class SchedulerBusy(SFQError, RuntimeError):
    """A scheduler method was called while another method of the same scheduler was running:
    re-entrantly (from a flow id's ``__hash__``/``__eq__``, a cost's ``__float__``, a payload's
    ``__del__``, ...) or from another thread. The call was refused and changed nothing; the
    running call goes on unharmed (the way a dict refuses to change during iteration)."""


# ---------------------------------------------------------------- dispatch adapter
class BackendError(SFQError):
    """A backend failed to serve a dispatched request.

    The request keeps what it was charged (no refund on failure): its estimate at dispatch,
    or in the ``served`` charge mode a stream's prompt and the tokens it delivered. ``backend``
    names the backend, ``status`` is the upstream's own HTTP status when it answered one,
    ``body`` the start of the response body when there was one. ``unhealthy`` says
    whether the failure counts against the backend's health (transport failures, 5xx) rather
    than only against the request (4xx, an error event in a stream); the dispatcher takes a
    backend out of rotation only when its transport or its error rate says it is down.
    """

    #: default for ``unhealthy``; subclasses override
    marks_unhealthy = True
    http_status = 502
    error_code = "upstream_error"
    _client = "a backend failed"

    def __init__(
        self,
        message: str,
        *,
        backend: str | None = None,
        status: int | None = None,
        body: str | None = None,
        unhealthy: bool | None = None,
        never_sent: bool = False,
    ) -> None:
        super().__init__(message)
        self.backend = backend
        self.status = status
        self.body = body
        self.unhealthy = self.marks_unhealthy if unhealthy is None else unhealthy
        #: True when the request provably never reached the server (it could not connect, or
        #: the connection failed before the request was written): resending it is safe
        self.never_sent = never_sent

    def client_message(self) -> str:
        return self._client if self.status is None else f"{self._client} (HTTP {self.status})"


class BackendUnavailable(BackendError, ConnectionError):
    """The backend could not be reached, or dropped the connection before a full reply
    (connection refused, reset, closed). Answered 503."""

    http_status = 503
    error_code = "upstream_unavailable"
    _client = "no backend could be reached"


class BackendTimeout(BackendError):
    """The backend did not connect, answer or send the next bytes within the configured time,
    or a stream outlived its total deadline. Deliberately not a ``TimeoutError``: an
    ``except TimeoutError`` around the caller's own ``asyncio.timeout()`` must not catch it.
    Answered 503."""

    http_status = 503
    error_code = "upstream_timeout"
    _client = "no backend answered in time"


class BackendHTTPError(BackendError):
    """The backend answered with an HTTP error status (``status``; ``headers``: the reply's
    headers; ``retry_after``: its ``Retry-After`` in seconds, or ``None``). The failure is the
    request's: a 5xx counts towards the backend's error rate (``unhealthy`` is True), a 4xx
    does not. Answered 502 (``upstream_error``), or 503 (``upstream_unavailable``) when the
    backend itself answered 503. A 4xx other than 401, 403, 407 and 429 is the client's to fix
    (:attr:`client_fault`): answered with the upstream's status and error object, redacted."""

    marks_unhealthy = False
    _client = "a backend answered with an error"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None,
                 retry_after: float | None = None, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.headers: dict[str, str] = dict(headers) if headers else {}
        self.retry_after = retry_after
        if self.status == 503 and not isinstance(self, BackendRateLimited):
            self.http_status = 503
            self.error_code = "upstream_unavailable"
        elif self.client_fault:
            self.http_status = self.status  # type: ignore[assignment]
            self.error_type = "invalid_request_error"
            p = _upstream_error(self.body).get("param")
            self.param = p if isinstance(p, str) else None

    @property
    def client_fault(self) -> bool:
        """An upstream 4xx other than 401, 403, 407 and 429 (a context-length error, an unknown
        parameter): the client's to fix, so a gateway answers it with the upstream's status and
        error object (:meth:`to_openai`, secrets redacted)."""
        s = self.status
        return s is not None and 400 <= s < 500 and s not in _NOT_PASSED

    def to_openai(self) -> dict[str, Any]:
        if not self.client_fault:
            return super().to_openai()
        up = _upstream_error(self.body)
        return {"error": {"message": up.get("message") or f"the backend refused the request (HTTP {self.status})",
                          "type": up.get("type", self.error_type), "code": up.get("code", self.error_code),
                          "param": self.param}}


#: upstream 4xx statuses that are the gateway's (its own key, its proxy, its rate), not the client's
_NOT_PASSED = frozenset((401, 403, 407, 429))
#: what is redacted from an upstream's error message before a client sees it: bearer and API
#: keys (``sk-...``, ``hf_...``, ``Bearer ...``, ``api_key=...``) and URLs (internal addresses)
_SECRET = re.compile(r"(?i)\bbearer\s+\S+|\b(?:sk|rk|pk|hf|key|gsk|xai)[-_][A-Za-z0-9_\-]{6,}"
                     r"|\b(?:api[_-]?key|token|secret|password)\s*[=:]\s*\S+|\bhttps?://[^\s\x22\x27<>()\[\]]*[^\s\x22\x27<>()\[\].,;:!?]")


def redact(text: str) -> str:
    """``text`` with keys, tokens and URLs replaced by ``[redacted]``."""
    return _SECRET.sub("[redacted]", text)


def _upstream_error(body: str | None) -> dict[str, Any]:
    """The error object of an upstream's error reply (OpenAI's ``{"error": {...}}``, vLLM's,
    TGI's ``{"error": "...", "error_type": ...}``, or plain text), its strings redacted."""
    err: dict[str, Any] = {}
    try:
        doc = json.loads(body) if body else None
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        e = doc.get("error", doc)
        if isinstance(e, dict):
            err = {k: e.get(k) for k in ("message", "type", "param", "code") if e.get(k) is not None}
        elif isinstance(e, str):
            err = {"message": e}
            if isinstance(doc.get("error_type"), str):
                err["type"] = doc["error_type"]
        if "message" not in err and isinstance(doc.get("message"), str):
            err["message"] = doc["message"]
        if "message" not in err and isinstance(doc.get("detail"), str):
            err["message"] = doc["detail"]
    elif body:
        err = {"message": body.strip()[:1000]}
    out: dict[str, Any] = {}
    for k, v in err.items():
        if isinstance(v, str):
            out[k] = redact(v)[:2000]
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
    return out


class BackendRateLimited(BackendHTTPError):
    """HTTP 429: the backend asks to slow down; ``retry_after`` (seconds) when it said when.
    The dispatcher sends that backend nothing new until then. Answered 503 (the fleet, not
    the client, is over its rate)."""

    http_status = 503
    error_code = "upstream_rate_limited"
    _client = "the backends are rate limiting"


class StreamInterrupted(BackendError):
    """A streamed reply ended before its end marker (``data: [DONE]``): the connection was cut
    or the server sent an error event mid-way. ``chunks`` counts the events received before.
    Answered 502."""

    _client = "the backend's stream ended before its end"

    def __init__(self, message: str, *, chunks: int = 0, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.chunks = chunks


class NoHealthyBackend(SFQError):
    """No backend of the request's pool was in rotation: it was refused at once, or removed from
    the queue after the dispatcher's ``unavailable_timeout`` (uncharged unless it had been
    selected). Answered 503; the request engine sets ``retry_after`` (seconds after which
    trying again may help) on the ones it raises."""

    http_status = 503
    error_code = "upstream_unavailable"




# ---------------------------------------------------------------- policy layer
class PolicyError(SFQError, ValueError):
    """A policy file (or mapping) is invalid. ``path`` is the dotted path of the bad field
    (``classes.batch.weight``); the message starts with it."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.path = path
        self.problem = problem


class Refused(SFQError):
    """A request refused before it reached a backend, or dropped while it waited.

    ``reason`` is one of ``unauthenticated``, ``class_not_allowed``, ``unknown_org``,
    ``unknown_model``, ``bad_request``, ``too_large``, ``rate_limited``, ``queue_full``,
    ``too_many_users`` (a team's ``max_users``),
    ``queue_timeout``, ``deadline``, ``closed``, ``unavailable``, ``state_unavailable``;
    ``http_status`` follows from it (``REFUSALS``: 401, 403, 404, 400, 429, 504, 503).
    ``retry_after`` is seconds after which trying again may succeed (``rate_limited``,
    ``queue_full``), else ``None``.
    """

    def __init__(self, reason: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after
        self.http_status, self.error_type, self.error_code = REFUSALS.get(reason, (503, "server_error", reason))


class DispatcherClosed(Refused):
    """The dispatcher is closed (or closing): the request was not accepted, or was removed
    from the queue uncharged before it could be dispatched. A ``Refused`` with reason
    ``closed`` (503)."""

    def __init__(self, message: str = "this dispatcher is closed") -> None:
        super().__init__("closed", message)


class BadRequest(Refused, ValueError):
    """The request body is malformed (``'max_tokens' must be an integer >= 1, got 'abc'``):
    nothing was queued. A ``Refused`` with reason ``bad_request`` (400), and a ``ValueError``.
    ``param`` names the field at fault when one is."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__("bad_request", message)
        self.param = param


class InvalidCost(BadRequest):
    """A request's ``cost=`` (``acquire``, ``submit``, ``open_stream``, ``stream``) is not a
    finite number > 0, or too large to charge: nothing was queued and nothing changed. A
    :class:`BadRequest` (400, reason ``bad_request``), so still a ``ValueError``; its message
    names the bad value, as the scheduler core's own check words it."""


class InvalidCostType(InvalidCost, TypeError):
    """A request's ``cost=`` is not a number (``"abc"``, ``True``): an :class:`InvalidCost`
    (400) that is also a ``TypeError``, as the scheduler core raises for it."""


class InvalidTimeout(BadRequest):
    """A request's ``timeout=`` or ``max_wait=`` (``acquire``, ``submit``, ``open_stream``,
    ``stream``, and ``PolicyDispatcher``'s ``submit_flow``, ``stream_flow``) is not a finite
    number of seconds > 0 (``0``, ``-1``, NaN, ``inf``, ``True``, ``"30"``): nothing was
    queued and nothing changed. A :class:`BadRequest` (400, reason ``bad_request``), so still
    a ``ValueError``; its message names the argument and the bad value
    (``timeout must be a finite number of seconds > 0, got 'abc'``)."""


class UnknownModel(Refused, LookupError):
    """No pool serves the request's ``model``: a ``Refused`` with reason ``unknown_model`` (404)."""

    def __init__(self, message: str) -> None:
        super().__init__("unknown_model", message)


class RequestTooLarge(Refused, ValueError):
    """No backend of the pool could ever take the request (its prompt plus ``max_tokens``
    exceed every backend's ``max_context``): a ``Refused`` with reason ``too_large`` (400)."""

    def __init__(self, message: str) -> None:
        super().__init__("too_large", message)


class DeadlineExceeded(SFQError):
    """A request's own deadline ran out while it was running (or between retries): the
    backend call was aborted. (One whose queue age or deadline ran out before it started is
    ``Refused`` with reason ``queue_timeout`` or ``deadline``.) Answered 504."""

    http_status = 504
    error_type = "timeout_error"
    error_code = "deadline_exceeded"
