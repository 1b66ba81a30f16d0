"""Errors raised by sfq. Argument errors use the builtin ValueError/TypeError/OverflowError."""

from __future__ import annotations

__all__ = [
    "SFQError",
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
    "PolicyError",
    "Refused",
    "DeadlineExceeded",
]


class SFQError(Exception):
    """Base class of every library error sfq raises."""


class SchedulerBusy(SFQError, RuntimeError):
    """A scheduler method was called while another method of the same scheduler was running:
    re-entrantly (from a flow id's ``__hash__``/``__eq__``, a cost's ``__float__``, a payload's
    ``__del__``, ...) or from another thread. The call was refused and changed nothing; the
    running call goes on unharmed (the way a dict refuses to change during iteration)."""


# ---------------------------------------------------------------- dispatch adapter
class BackendError(SFQError):
    """A backend failed to serve a dispatched request.

    The request keeps what it was charged (no refund on failure): its estimate at dispatch,
    or in the ``served`` charge mode a stream's prompt and the tokens it delivered. ``backend`` names the backend, ``status`` is the HTTP status when there
    was one, ``body`` the start of the response body when there was one. ``unhealthy`` says
    whether the failure counts against the backend's health (transport failures, 5xx) rather
    than only against the request (4xx, an error event in a stream); the dispatcher takes a
    backend out of rotation only when its transport or its error rate says it is down.
    """

    #: default for ``unhealthy``; subclasses override
    marks_unhealthy = True

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


class BackendUnavailable(BackendError, ConnectionError):
    """The backend could not be reached, or dropped the connection before a full reply
    (connection refused, reset, closed)."""


class BackendTimeout(BackendError):
    """The backend did not connect, answer or send the next bytes within the configured time,
    or a stream outlived its total deadline. Deliberately not a ``TimeoutError``: an
    ``except TimeoutError`` around the caller's own ``asyncio.timeout()`` must not catch it."""


class BackendHTTPError(BackendError):
    """The backend answered with an HTTP error status (``status``; ``headers``: the reply's
    headers; ``retry_after``: its ``Retry-After`` in seconds, or ``None``). The failure is the
    request's: a 5xx counts towards the backend's error rate (``unhealthy`` is True), a 4xx
    does not."""

    marks_unhealthy = False

    def __init__(self, message: str, *, headers: dict[str, str] | None = None,
                 retry_after: float | None = None, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.headers: dict[str, str] = dict(headers) if headers else {}
        self.retry_after = retry_after


class BackendRateLimited(BackendHTTPError):
    """HTTP 429: the backend asks to slow down; ``retry_after`` (seconds) when it said when.
    The dispatcher sends that backend nothing new until then."""


class StreamInterrupted(BackendError):
    """A streamed reply ended before its end marker (``data: [DONE]``): the connection was cut
    or the server sent an error event mid-way. ``chunks`` counts the events received before."""

    def __init__(self, message: str, *, chunks: int = 0, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.chunks = chunks


class NoHealthyBackend(SFQError):
    """No backend of the request's pool was in rotation: it was refused, or removed from the
    queue (uncharged unless it had been selected). The request engine sets ``retry_after``
    (seconds after which trying again may help) on the ones it raises."""


class DispatcherClosed(SFQError):
    """The dispatcher is closed (or closing): the request was not accepted, or was removed
    from the queue uncharged before it could be dispatched."""


class UnknownModel(SFQError, LookupError):
    """No pool of the dispatcher serves the request's ``model``."""


class RequestTooLarge(SFQError, ValueError):
    """No backend of the pool could ever take the request (its prompt plus ``max_tokens``
    exceed every backend's ``max_context``)."""


# ---------------------------------------------------------------- policy layer
class PolicyError(SFQError, ValueError):
    """A policy file (or mapping) is invalid. ``path`` is the dotted path of the bad field
    (``classes.batch.weight``); the message starts with it."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.path = path
        self.problem = problem


class Refused(SFQError):
    """The policy refused a request, or dropped it before it reached a backend.

    ``reason`` is one of ``unauthenticated``, ``class_not_allowed``, ``unknown_model``,
    ``bad_request``, ``too_large``, ``rate_limited``, ``queue_full``, ``queue_timeout``,
    ``deadline``, ``closed``.
    ``retry_after`` is seconds after which trying again may succeed (``rate_limited``,
    ``queue_full``), else ``None``.
    """

    def __init__(self, reason: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class BadRequest(Refused, ValueError):
    """The request's body is malformed or asks for something no backend can do (the message
    names the field): ``Refused`` with reason ``bad_request``, and a ``ValueError``. Nothing
    was queued or sent."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_request", message)


class DeadlineExceeded(SFQError):
    """A request's own deadline ran out while it was running (or between retries): the
    backend call was aborted. (One whose queue age or deadline ran out before it started is
    ``Refused`` with reason ``queue_timeout`` or ``deadline``.)"""
