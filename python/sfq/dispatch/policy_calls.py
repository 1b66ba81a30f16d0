"""What a :class:`~sfq.dispatch.PolicyDispatcher` hands out for one request: the
:class:`Grant` of :meth:`~sfq.dispatch.PolicyDispatcher.acquire` (where to send it, and how
to report what it delivered; the ``Permit`` that waits for it is in ``permit``) and the
:class:`EventStream` of
:meth:`~sfq.dispatch.PolicyDispatcher.open_stream` and ``stream`` (its events, admitted and
answered by the upstream before the first one is handed out). Both report to the
dispatcher's request engine; neither decides anything."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from ..backends import CHAT_COMPLETIONS, COMPLETIONS
from ..backends.base import JSONBody
from ..engine.engine import text_counts
from ..engine.pool import RUNNING, Request
from ..errors import BackendError, BackendHTTPError, BackendRateLimited, BackendUnavailable, BadRequest, \
    DeadlineExceeded
from ..policy.classify import Flow
from .stream import EventStream

if TYPE_CHECKING:
    from ..policy.config import UpstreamTimeouts
    from .policy_dispatcher import PolicyDispatcher


__all__ = ["BackendAddress", "EventStream", "Grant", "PolicyEventStream"]

Reply = dict[str, Any]
Event = dict[str, Any]
T = TypeVar("T")


#: seconds a loop may run a timer before its time (its clock's resolution; uvloop's is 1 ms)
_EARLY = 0.001


class _Expired(Exception):
    """A bound of :func:`_within` ran out (not the awaited call's own timeout)."""


if sys.version_info >= (3, 11):
    async def _within(aw: Awaitable[T], limit: float | None) -> T:
        """``await aw`` within ``limit`` seconds (``None``: no bound), in the caller's task."""
        if limit is None:
            return await aw
        cm = asyncio.timeout(limit)
        try:
            async with cm:
                return await aw
        except TimeoutError:
            if cm.expired():
                raise _Expired() from None
            raise
else:  # pragma: no cover - Python 3.10
    async def _within(aw: Awaitable[T], limit: float | None) -> T:
        """``await aw`` within ``limit`` seconds (``None``: no bound)."""
        if limit is None:
            return await aw
        try:
            return await asyncio.wait_for(aw, limit)
        except asyncio.TimeoutError:
            raise _Expired() from None


def _endpoint(body: Mapping[str, Any]) -> str:
    return CHAT_COMPLETIONS if "messages" in body else COMPLETIONS


def _check_body(body: object) -> None:
    """A request body must be a JSON object: anything else is the client's error (400)."""
    if type(body) is not dict and not isinstance(body, Mapping):  # (the exact type first: an ABC check is slow)
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")


def _text_chars(choices: object) -> int:
    """Characters of text in an OpenAI reply's (or event's) ``choices`` (the engine's one walk)."""
    return text_counts(choices)[0]


class BackendAddress:
    """Where a granted request goes: the backend's ``name`` (as the policy names it), ``url``
    (the server's root, e.g. ``http://10.0.0.5:8000``) and ``headers`` (the backend's own,
    its upstream key included; never the client's)."""

    __slots__ = ("name", "url", "headers", "endpoints")

    def __init__(self, name: str, url: str, headers: Mapping[str, str]) -> None:
        self.name = name
        self.url = url
        self.headers: Mapping[str, str] = MappingProxyType(dict(headers))
        #: the URL of each endpoint a grant may name (``None``: a permit without a body, ``.../v1``)
        self.endpoints: Mapping[str | None, str] = MappingProxyType({
            None: f"{url}/v1", COMPLETIONS: f"{url}/v1/{COMPLETIONS}", CHAT_COMPLETIONS: f"{url}/v1/{CHAT_COMPLETIONS}"})

    def __repr__(self) -> str:  # never the headers: they hold the upstream key
        return f"BackendAddress({self.name!r}, {self.url!r})"


class Grant:
    """A request's turn on a backend: what ``acquire`` yields (``PolicyDispatcher.acquire``,
    ``Dispatcher.acquire``).

    ``backend`` says where to send it (:class:`BackendAddress`); ``url`` is the endpoint for
    its body (``.../v1/chat/completions`` or ``.../v1/completions``; ``.../v1`` for a permit
    without a body); ``request`` is the engine's record of it; ``deadline`` its deadline on
    the dispatcher's clock (``None``: none). Report what the call delivered with
    :meth:`delivered` (a stream's output tokens as they pass), and end it with :meth:`finish`
    (the reply's usage: settles the charge) or :meth:`fail` (the upstream failed)."""

    __slots__ = ("_pd", "request", "backend", "url", "_ended")

    def __init__(self, pd: PolicyDispatcher, r: Request, backend: BackendAddress, endpoint: str | None) -> None:
        self._pd = pd
        self.request = r
        self.backend = backend
        self.url = backend.endpoints[endpoint]
        self._ended = False

    @property
    def deadline(self) -> float | None:
        """The request's deadline on the dispatcher's clock (``None``: it has none)."""
        return self.request.deadline

    def delivered(self, tokens: float) -> float:
        """``tokens`` more output tokens reached the client; returns the tokens counted (the
        request's ``max_tokens`` caps the total). In the ``served`` charge mode a stream's flow
        is charged them now."""
        if self._ended:
            raise RuntimeError("delivered() after the grant ended")
        return self._pd.engine.delivered(self.request, tokens)

    def finish(self, usage: Mapping[str, Any] | None = None, *, output_text_chars: int | None = None) -> None:
        """The call succeeded: ``usage`` (the reply's OpenAI ``usage``) settles the charge; without
        one, the tokens :meth:`delivered` or ``output_text_chars`` (the returned text's length)
        do. Frees the slot at once; a second call is a ``RuntimeError``. Bad input raises and
        leaves the grant as it was (leaving the block still ends it)."""
        if self._ended:
            raise RuntimeError("finish() after the grant ended")
        self._pd._completed(self.request, usage, output_text_chars)  # (checks its input before it changes anything)
        self._ended = True

    def fail(self, status: int | None = None, retry_after: float | None = None) -> None:
        """The upstream failed: ``status`` its HTTP error status (``None``: no answer, the
        connection failed or timed out); ``retry_after`` its ``Retry-After`` in seconds. It
        counts toward the backend's health as the dispatcher's own calls do (a refused
        connection or 5xx against it, a 4xx against the request only; a 429 pauses the backend
        for ``retry_after``), and the request ends as failed, charged what it was (its estimate,
        or what :meth:`delivered` reported). Frees the slot at once; nobody retries it but you."""
        if self._ended:
            raise RuntimeError("fail() after the grant ended")
        if status is not None and (isinstance(status, bool) or not isinstance(status, int)
                                   or not 400 <= status <= 599):
            raise ValueError(f"status must be an HTTP error status (400-599) or None, got {status!r}")
        if retry_after is not None and (isinstance(retry_after, bool) or not isinstance(retry_after, (int, float))
                                        or not (retry_after >= 0 and retry_after < float("inf"))):
            raise ValueError(f"retry_after must be a finite number of seconds >= 0 or None, got {retry_after!r}")
        self._ended = True
        name = self.backend.name
        err: BackendError
        if status is None:
            err = BackendUnavailable(f"backend {name!r}: the embedder's call failed", backend=name)
        else:
            kind = BackendRateLimited if status == 429 else BackendHTTPError
            err = kind(f"backend {name!r}: HTTP {status} (reported by the embedder)", backend=name, status=status,
                       unhealthy=status >= 500, retry_after=retry_after)
        self._pd._attempt_failed(self.request, err, retryable=False, reported=True)


def _fire(ref: weakref.ReferenceType[PolicyEventStream]) -> None:
    stream = ref()
    if stream is not None:
        stream._on_watchdog()


class PolicyEventStream(EventStream):
    """A streamed request's events (parsed JSON objects), as :meth:`PolicyDispatcher.stream`,
    :meth:`~PolicyDispatcher.stream_flow` and :meth:`~PolicyDispatcher.open_stream` return it.

    An async context manager and a closeable async iterator. It opens (admission, the wait
    for its turn, the upstream's answer up to its first event) when entered or at the first
    iteration; every refusal raises there, as an ``SFQError``. Each event passed on counts as
    delivered service (``served``: charged as it passes); the upstream is always asked for
    usage, and a usage-only event is passed on only when the body asked for it
    (``stream_options.include_usage``). Closing it before the end (``aclose()``, leaving the
    ``async with``, cancelling the task) cancels the request and aborts the upstream call.
    When the request's deadline runs out while the consumer is busy elsewhere (a slow
    client), the upstream call is aborted and its slot freed at once; the next iteration
    raises ``DeadlineExceeded``.
    """

    def __init__(self, pd: PolicyDispatcher, flow: Flow | None, credential: str | None, cls: str | None,
                 body: Mapping[str, Any], timeout: float | None,
                 on_admit: Callable[[Request], None] | None, cost: float | None = None,
                 max_wait: float | None = None) -> None:
        self._pd = pd
        self._cost = cost
        self._max_wait = max_wait
        self._flow = flow
        self._credential = credential
        self._cls = cls
        self._body = body
        self._timeout = timeout
        self._on_admit = on_admit
        self.request: Request | None = None  # the engine's record, once admitted
        self._opened = False
        self._done = False  # ended (completed, failed, cancelled or closed): nothing more to read
        self._agen: AsyncIterator[Event] | None = None
        self._pending: deque[Event] = deque()
        self._passed = 0  # events passed to the consumer
        self._usage: Mapping[str, Any] | None = None
        self._chars = 0
        self._wants_usage = False
        self._send: dict[str, Any] = {}
        self._total_until: float | None = None
        self._first = True  # the next event is the first of its attempt
        self._reading = False  # inside _open or __anext__: the reads' own bounds apply
        self._expired: DeadlineExceeded | None = None
        # one timer per attempt for every bound (the request's deadline, the attempt's total, the
        # upstream's silence), armed for the earliest and moved only when it fires: an event
        # costs a clock read, not a timeout entered and left
        self._watchdog: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[Any] | None = None  # the task awaiting the upstream, while it does
        self._pull_at = 0.0  # clock time the current wait on the upstream began (while _task is set)
        self._step: float | None = None  # seconds that wait may last (first byte, or between events)
        self._cut: str | None = None  # why the watchdog cancelled that wait: deadline, total or step
        self._late: str | None = None  # a bound that ran out while nobody waited on the upstream
        self._due: float | None = None  # clock time the watchdog is armed for
        self._limits: UpstreamTimeouts | None = None  # the pool's upstream timeouts, read as the attempt starts
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the stream runs on

    # ---------------------------------------------------------------- the protocol
    def __aiter__(self) -> PolicyEventStream:
        return self

    async def __aenter__(self) -> PolicyEventStream:
        self._reading = True
        try:
            await self._open()
        finally:
            self._reading = False
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def __anext__(self) -> Event:
        self._reading = True
        try:
            if not self._opened:
                await self._open()
            pd = self._pd
            r = self.request
            assert r is not None
            while True:
                if self._expired is not None:
                    err, self._expired = self._expired, None
                    raise err
                if self._pending:
                    ev = self._pending.popleft()
                elif self._done:
                    raise StopAsyncIteration
                else:
                    try:
                        got = await self._pull()
                    except BackendError as exc:
                        await self._drop_agen()
                        if self._passed:  # an event reached the client: never retried
                            self._done = True
                            self._disarm()
                            pd._attempt_failed(r, exc, retryable=False)
                            raise
                        try:
                            await pd._retry(r, exc)
                            await self._attempt()
                        except BaseException:
                            self._done = True
                            self._disarm()
                            raise
                        continue
                    if got is None:
                        self._end()
                        raise StopAsyncIteration
                    ev = got
                if not self._wants_usage and ev.get("usage") and not ev.get("choices"):
                    continue  # the usage-only event the client did not ask for
                self._passed += 1
                self._chars += pd.engine.passed(r, ev)
                return ev
        except (asyncio.CancelledError, GeneratorExit):
            await self._abandon()
            raise
        finally:
            self._reading = False

    async def aclose(self) -> None:
        """End the stream; before its end, the request is cancelled (the upstream call aborted)."""
        if not self._done:
            await self._abandon()

    def __del__(self) -> None:
        # dropped unclosed while its request holds a slot (``break`` without closing): free it on
        # the loop's next step (not here: a finalizer may run in the middle of a pump)
        r = self.request
        if self._done or r is None or r.outcome is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_soon(self._pd._gave_up, r)

    # ---------------------------------------------------------------- opening
    async def _open(self) -> None:
        if self._opened:
            raise RuntimeError("the stream is already open (or opening)")
        self._opened = True
        pd = self._pd
        body = self._body
        try:
            flow = self._flow if self._flow is not None else pd.classify(self._credential, body, self._cls)
            so = body.get("stream_options") if type(body) is dict or isinstance(body, Mapping) else None
            self._wants_usage = so is not None and isinstance(so, Mapping) and bool(so.get("include_usage"))
            r = await pd._admit(flow, body, self._timeout, None, True, self._cost, self._max_wait)
        except BaseException:
            self._done = True
            raise
        self.request = r
        if self._on_admit is not None:
            self._on_admit(r)
        if type(body) is JSONBody:  # its bytes go upstream as they came, where nothing changes
            send: dict[str, Any] = body.streamed_with_usage()
        else:
            send = dict(body)
            send["stream"] = True
            send["stream_options"] = {**(so if isinstance(so, Mapping) else {}), "include_usage": True}
        self._send = send
        try:
            await self._attempt()
        except BaseException as exc:
            self._done = True
            self._disarm()
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                pd._gave_up(r)
            raise

    async def _attempt(self) -> None:
        """Wait for the turn and start an attempt, up to its first event; retried (the
        policy's rules) while the upstream fails before it."""
        pd = self._pd
        r = self.request
        assert r is not None
        failed: BackendError | None = None
        while True:
            await pd._turn(r, failed)
            assert r.backend is not None
            be = pd._backends[r.backend]
            self._first = True
            self._total_until = pd._total_until(r)
            self._arm()
            try:
                try:  # (a transport may refuse before it returns an iterator)
                    self._agen = (be.stream(_endpoint(self._send), self._send, idempotent=True)  # type: ignore[call-arg]
                                  if r.idempotency_key else be.stream(_endpoint(self._send), self._send))
                except Exception as exc:
                    raise pd._wrap(r, exc) from exc
                ev = await self._pull()
            except BackendError as exc:
                await self._drop_agen()
                await pd._retry(r, exc)
                failed = exc
                continue
            if ev is None:
                self._end()
            else:
                self._pending.append(ev)
            return

    # ---------------------------------------------------------------- reading
    async def _pull(self) -> Event | None:
        """The attempt's next event from the upstream (``None``: its end), within the pool's
        upstream timeouts and the deadline (the watchdog's bounds). Raises ``BackendError`` (a
        failure), ``DeadlineExceeded``."""
        pd = self._pd
        r = self.request
        agen = self._agen
        assert r is not None and agen is not None
        first = self._first
        t = self._limits
        assert t is not None
        step = self._step = t.first_byte if first else t.between_events
        why = self._late
        if why is None:
            task = self._task = asyncio.current_task(self._loop)  # (the loop given: no getpid per event)
            now = self._pull_at = pd.clock()
            if step is not None and (self._due is None or now + step < self._due):
                self._disarm()  # the silence allowed is shorter now (between events, not the first)
                self._rearm(now, now)
            try:
                ev = await agen.__anext__()
            except StopAsyncIteration:
                return None
            except asyncio.CancelledError:
                why, self._cut = self._cut, None
                if why is None:
                    raise
                if task is not None and hasattr(task, "uncancel"):
                    task.uncancel()
            except GeneratorExit:
                raise
            except Exception as exc:
                raise pd._wrap(r, exc) from exc
            else:
                self._first = False
                u = ev.get("usage")
                if u:
                    self._usage = u if type(u) is dict or isinstance(u, Mapping) else None
                return ev
            finally:
                self._task = None
        self._late = None
        if why == "deadline":
            self._done = True
            await self._drop_agen()
            raise pd._deadline_hit(r, "streaming") from None
        limit = step if why == "step" else t.total
        raise pd._upstream_timeout(r, why, "waiting for the first event" if first else
                                   "waiting for the next event", limit) from None

    # ---------------------------------------------------------------- endings
    def _end(self) -> None:
        """The upstream sent its end marker: the request completed."""
        self._done = True
        self._disarm()
        r = self.request
        assert r is not None
        self._pd._completed(r, self._usage, self._chars)

    async def _abandon(self) -> None:
        """The consumer stopped before the end: cancel the request, abort the upstream call."""
        self._done = True
        self._disarm()
        await self._drop_agen()
        if self.request is not None:
            self._pd._gave_up(self.request)

    async def _drop_agen(self) -> None:
        agen, self._agen = self._agen, None
        if agen is not None:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    def _arm(self) -> None:
        """The attempt's watchdog, at the earliest of its bounds: it aborts the upstream call at
        the request's deadline even while the consumer is busy elsewhere (a client that stopped
        reading must not keep its slot), and ends a wait on the upstream past its bound."""
        r = self.request
        if r is None:
            return
        self._disarm()
        self._late = None
        t = self._limits = self._pd._timeouts(r)  # the pool's, as the attempt starts
        self._loop = asyncio.get_running_loop()
        self._step = t.first_byte if self._first else t.between_events
        now = self._pd.clock()
        self._rearm(now, now)

    def _rearm(self, now: float, pull_at: float) -> None:
        r = self.request
        assert r is not None
        due = r.deadline
        total = self._total_until
        if total is not None and (due is None or total < due):
            due = total
        step = self._step
        if step is not None and (due is None or pull_at + step < due):
            due = pull_at + step
        self._due = due
        if due is not None:
            assert self._loop is not None  # (set by _arm, which every attempt starts with)
            # (through a weak reference: a stream dropped unclosed must still be collected, and free its slot)
            self._watchdog = self._loop.call_later(max(0.0, due - now), _fire, weakref.ref(self))

    def _disarm(self) -> None:
        self._due = None
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _on_watchdog(self) -> None:
        self._watchdog = None
        self._due = None
        r = self.request
        if self._done or r is None or r.state != RUNNING:
            return
        # the loop runs a timer up to its clock's resolution early (uvloop: a millisecond)
        now = self._pd.clock() + _EARLY
        reading = self._task is not None
        why = None
        if r.deadline is not None and now >= r.deadline:
            why = "deadline"
        elif self._total_until is not None and now >= self._total_until:
            why = "total"
        elif reading and self._step is not None and now >= self._pull_at + self._step:
            why = "step"
        if why is None:  # not yet (the upstream spoke since): the next bound
            now -= _EARLY
            self._rearm(now, self._pull_at if reading else now)
            return
        if reading:  # the wait on the upstream ends now, with what bounded it
            self._cut = why
            assert self._task is not None
            self._task.cancel()
            return
        if why == "total" or self._reading:  # nobody waits on the upstream: the next read fails at once
            self._late = why
            return
        self.expire()

    def expire(self) -> None:
        """End the running request now as its deadline does, while its consumer is busy
        elsewhere (a gateway blocked writing to a client that stopped reading): the upstream
        call is aborted and its slot freed; the next iteration raises ``DeadlineExceeded``."""
        r = self.request
        if self._done or r is None or r.state != RUNNING:
            return
        self._done = True
        self._disarm()
        self._pending.clear()
        self._expired = self._pd._deadline_hit(r, "streaming to a client that did not read")
        agen, self._agen = self._agen, None
        if agen is not None:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                asyncio.get_running_loop().create_task(aclose())
