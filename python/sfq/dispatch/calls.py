"""The calls: ``submit`` (one JSON reply) and ``stream`` (server-sent events), each from
admission through the backend call (and its retries) to exactly one outcome."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable, Mapping
from typing import Any

from ..engine import PolicyEngine, Request
from ..errors import BackendError, NoHealthyBackend
from ._state import ABORTED, FAILED, OK, PLACED, DispatcherBase, Job
from .policy_calls import BackendAddress, Grant, _text_chars
from .stream import EventStream


class _Slot:
    """Shared by a stream's generator and its ``EventStream``: the job once admitted."""

    __slots__ = ("job",)

    def __init__(self) -> None:
        self.job: Job | None = None


def text_chars(reply: Any) -> int | None:
    """The length of the text a JSON reply returned (its choices' ``text`` or message content),
    for settling a charge when the reply carries no ``usage``; ``None`` when it has none."""
    if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
        return None
    return _text_chars(reply["choices"])


_END: Any = object()  # the first event of a stream that had none


class DispatcherStream(EventStream):
    """The :class:`~sfq.EventStream` of ``Dispatcher.stream()`` and ``Dispatcher.open_stream()``.

    Entering it (``async with``) opens the request: admitted, placed, and the backend's first
    event read, so a refusal or a failure before the first event raises there. Iterating
    without entering opens it at the first iteration. Leaving early frees its slot and aborts
    the backend call: leave the ``async with`` block, ``await events.aclose()``, or ``break``
    out of ``async for event in d.stream(...)`` (the stream object is dropped at once). When
    you keep a reference to the stream, close it: a stream still referenced cannot know you
    are done with it.
    """

    __slots__ = ("_agen", "_slot", "_dispatcher", "_first")

    def __init__(self, dispatcher: DispatcherBase, agen: AsyncIterator[dict[str, Any]], slot: _Slot) -> None:
        self._dispatcher = dispatcher
        self._agen = agen
        self._slot = slot
        self._first: Any = None  # the event read when it was opened, until it is handed out

    def __aiter__(self) -> DispatcherStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        first = self._first
        if first is not None:
            self._first = None
            if first is _END:
                raise StopAsyncIteration
            return first  # type: ignore[no-any-return]
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        self._first = None
        await self._agen.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> DispatcherStream:
        if self._slot.job is None and self._first is None:  # not opened yet: up to its first event
            try:
                self._first = await self._agen.__anext__()
            except StopAsyncIteration:
                self._first = _END
        return self

    def __del__(self) -> None:
        # dropped while its request holds a slot (``break`` without aclosing): free the slot on
        # the loop's next step (not here: a finalizer may run in the middle of a pump), and
        # close the generator, which aborts the backend call
        job = self._slot.job
        if job is None or job.state != PLACED:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        d = self._dispatcher
        loop.call_soon(d._finish, job, ABORTED)


class Calls(DispatcherBase):
    async def submit(self, flow: Hashable, body: Mapping[str, Any], *, cost: float | None = None,
                     idempotent: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """Queue a non-streaming request of ``flow`` and return the backend's JSON reply.

        ``body`` is an OpenAI ``/v1/completions`` (``prompt``) or ``/v1/chat/completions``
        (``messages``) request; ``cost`` overrides the estimator's cost (cost units, a fixed
        charge). A failure before the reply (a connection error, an upstream 408, 409, 429 or
        5xx) is retried in the request's own flow, preferably on another backend, within
        ``max_attempts`` and the retry budget (``docs/policy.md``, retries).
        ``idempotent=True`` is the caller's promise that the server running the request twice
        is harmless: then every backend failure may be retried, and the backend may resend it
        after a lost connection.
        Every error is an ``sfq.SFQError`` (``http_status``, ``to_openai()``): ``BackendError``
        subclasses for backend failures (after the retries), ``NoHealthyBackend``,
        ``DispatcherClosed``, and, with nothing queued, ``sfq.errors.BadRequest`` (a
        ``ValueError``) for a malformed body, ``UnknownModel``, ``RequestTooLarge``; ``TypeError``
        for arguments of the wrong type (a body that is not a mapping, an unhashable flow, a
        ``cost`` that is not a number).
        """
        if not self._started:
            await self.start()
        job = self._admit(flow, body, cost, False, idempotent, timeout=timeout)
        while True:
            if job.state != PLACED:
                await self._wait_placed(job)
            bs = job.bs
            assert bs is not None
            try:
                if idempotent:
                    reply = await bs.backend.complete(job.endpoint, job.body, idempotent=True)  # type: ignore[call-arg]
                else:
                    reply = await bs.backend.complete(job.endpoint, job.body)
            except asyncio.CancelledError:
                self._finish(job, ABORTED)
                raise
            except BackendError as exc:
                delay = self._finish(job, FAILED, exc)
                if delay is None:
                    raise
                try:
                    await self._retry(job, delay)
                except NoHealthyBackend:  # no backend to retry on: the failure stands
                    raise exc from None
                continue
            except Exception as exc:
                err = BackendError(f"backend {bs.name!r} raised {type(exc).__name__}: {exc}", backend=bs.name)
                self._finish(job, FAILED, err, retryable=False)
                raise err from exc
            self._finish(job, OK, None, reply.get("usage") if isinstance(reply, dict) else None, text_chars(reply))
            return reply

    def stream(self, flow: Hashable, body: Mapping[str, Any], *, cost: float | None = None,
               idempotent: bool = False, timeout: float | None = None) -> EventStream:
        """Queue a streaming request of ``flow``; iterate the result for the backend's events
        (JSON objects). See ``EventStream`` for stopping early (``break`` frees the slot).

        Usage is always asked of the backend; the usage-only final chunk is passed on only
        when the body asked for it (``stream_options.include_usage``). A failure before the
        first event is retried as in ``submit``; once an event has been passed on, never.
        ``idempotent``: as in ``submit``.
        """
        slot = _Slot()
        return DispatcherStream(self, self._stream(flow, body, cost, idempotent, slot, timeout), slot)

    def open_stream(self, flow: Hashable, body: Mapping[str, Any], *, timeout: float | None = None) -> EventStream:
        """A stream to enter with ``async with``: entering waits for ``flow``'s turn and for the
        backend's first event, so every refusal (``BadRequest``, ``timeout``, no healthy
        backend, the backend's own error status) raises there, before an embedder's server
        has sent its client a status line::

            async with d.open_stream("team-b", body, timeout=30) as events:
                async for event in events:
                    ...

        ``timeout``: the request's deadline in seconds from now; if it runs out while the
        request waits, entering raises (``Refused``, 504) and nothing reaches a backend."""
        return self.stream(flow, body, timeout=timeout)

    def acquire(self, flow: Hashable, body: Mapping[str, Any], *,
                timeout: float | None = None) -> contextlib.AbstractAsyncContextManager[Grant]:
        """Wait for ``flow``'s turn for ``body`` and learn where to send it, for an embedder who
        makes the call with its own HTTP client::

            async with d.acquire("team-a", body, timeout=30) as grant:
                reply = await my_client.post(grant.url, json=body, headers=dict(grant.backend.headers))
                grant.finish(reply["usage"])

        Entering is where everything that can refuse the request happens (``BadRequest``, the
        ``timeout`` while it waits, ``NoHealthyBackend``); cancelling the task while it waits
        there removes the request uncharged and nothing reaches a backend. Leaving without
        :meth:`Grant.finish` settles the charge from the estimate (or from what
        :meth:`Grant.delivered` reported); an exception inside the block is a failure that
        frees the slot and counts toward the backend's health; nobody retries it but you."""
        return self._acquire(flow, body, timeout)

    @contextlib.asynccontextmanager
    async def _acquire(self, flow: Hashable, body: Mapping[str, Any], timeout: float | None) -> AsyncIterator[Grant]:
        if not self._started:
            await self.start()
        streaming = isinstance(body, Mapping) and body.get("stream") is True
        job = self._admit(flow, body, None, streaming, False, timeout=timeout)
        if job.state != PLACED:
            await self._wait_placed(job)
        bs = job.bs
        assert bs is not None
        be = bs.backend
        address = BackendAddress(bs.name, getattr(be, "url", ""), getattr(be, "headers", {}))
        grant = Grant(self, job.req, address, job.endpoint)
        try:
            yield grant
        except (asyncio.CancelledError, GeneratorExit):
            grant._ended = True
            self._finish(job, ABORTED)
            raise
        except BaseException as exc:
            grant._ended = True
            err = exc if isinstance(exc, BackendError) else BackendError(
                f"the call to backend {bs.name!r} failed: {type(exc).__name__}: {exc}", backend=bs.name)
            self._finish(job, FAILED, err, retryable=False)
            raise
        if not grant._ended:
            grant._ended = True
            self._finish(job, OK)

    @property
    def engine(self) -> PolicyEngine:
        """The request engine that decides for this dispatcher (its state is read-only to you)."""
        return self._engine

    def _completed(self, r: Request, usage: Mapping[str, Any] | None, text_chars: int | None) -> None:
        """A grant's call succeeded (``Grant.finish``)."""
        self._finish(r.item, OK, None, usage if isinstance(usage, Mapping) else None, text_chars)

    async def _stream(self, flow: Hashable, body: Mapping[str, Any], cost: float | None, idempotent: bool,
                      slot: _Slot, timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
        if not self._started:
            await self.start()
        job = self._admit(flow, body, cost, True, idempotent, timeout=timeout)
        slot.job = job
        so = job.body.get("stream_options")
        wants_usage = isinstance(so, Mapping) and bool(so.get("include_usage"))
        e = self._engine
        r = job.req
        events = 0
        while True:
            if job.state != PLACED:
                await self._wait_placed(job)
            bs = job.bs
            assert bs is not None
            usage = None
            outcome, err = ABORTED, None
            agen = None
            wrapped = False  # not a backend error: never retried
            try:
                # may raise before returning an iterator
                if idempotent:
                    agen = bs.backend.stream(job.endpoint, job.body, idempotent=True)  # type: ignore[call-arg]
                else:
                    agen = bs.backend.stream(job.endpoint, job.body)
                async for event in agen:
                    e.passed(r, event)  # served: the output is charged as it passes
                    u = event.get("usage")
                    if u:
                        usage = u
                        if not wants_usage and not event.get("choices"):
                            continue
                    events += 1
                    yield event
                outcome = OK
            except BackendError as exc:
                outcome, err = FAILED, exc
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:
                outcome = FAILED
                err = BackendError(f"backend {bs.name!r} raised {type(exc).__name__}: {exc}", backend=bs.name)
                err.__cause__ = exc
                wrapped = True
            finally:
                aclose = getattr(agen, "aclose", None)
                try:
                    if aclose is not None:
                        await aclose()
                finally:
                    delay = self._finish(job, outcome, err, usage, retryable=events == 0 and not wrapped)
            if outcome == OK:
                return
            assert err is not None
            if delay is None:
                raise err
            try:
                await self._retry(job, delay)
            except NoHealthyBackend:  # no backend to retry on: the failure stands
                raise err from None
