"""sfq in a Starlette or FastAPI app: wait a turn while the client may leave, hand the turn (or
the open stream) to the response, and answer every :class:`sfq.SFQError` the OpenAI way.

Needs Starlette (``pip install 'sfq-scheduler[asgi]'``; FastAPI brings it); ``import sfq`` never
imports it. Duck-typed over both dispatchers: anything ``acquire(...)`` or ``open_stream(...)``
returns (an async context manager) is waited for the same way::

    from sfq import asgi as sfq_asgi

    app.add_exception_handler(sfq.SFQError, sfq_asgi.error_response_handler)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        if body.get("stream"):
            events = await sfq_asgi.enter(request, pd.open_stream(flow, body, timeout=60))
            return sfq_asgi.EventStreamResponse(events)        # closes the stream when done or gone
        async with sfq_asgi.enter(request, pd.acquire(flow, body, timeout=60)) as grant:
            reply = ...                                        # your own call to grant.url
            grant.finish(reply["usage"])
        return JSONResponse(reply)

* :func:`enter` waits (enters the context manager) while it watches the ASGI ``receive``
  channel for ``http.disconnect``: a client that leaves cancels the wait (the request is
  withdrawn uncharged; nothing reaches an upstream) and the handler gets
  :class:`ClientDisconnected`, an ``SFQError`` answered with an empty 499 (nobody reads it; no
  traceback is logged). Awaited, it gives what the context manager yields and the caller owns
  its exit; in ``async with`` it exits at the end of the block.
* :class:`EventStreamResponse` sends an entered ``EventStream`` as server-sent events
  (``data: {...}``, then ``data: [DONE]``; an ``SFQError`` after the 200 is sent as an error
  event) and closes it when the body ends or the client leaves; :class:`StreamingResponse`
  does the same for your own body and an entered turn (``closing=``).
* :func:`error_response` / :func:`error_response_handler`: ``exc.to_openai()`` with status
  ``exc.http_status`` and, when ``exc.retry_after`` is set, ``Retry-After`` (whole seconds,
  rounded up, at least 1).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterable, AsyncIterator, Generator, Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import orjson

from ._optional import MissingExtra
from .errors import SFQError, retry_after_ms, whole_seconds

try:
    from starlette.background import BackgroundTask
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
    from starlette.types import Message, Receive, Scope, Send
except ImportError as _exc:  # pragma: no cover - the base install
    raise MissingExtra("starlette", "asgi", "sfq.asgi (the Starlette and FastAPI helpers)") from _exc

if TYPE_CHECKING:
    from .dispatch.stream import EventStream

__all__ = [
    "ClientDisconnected",
    "EventStreamResponse",
    "StreamingResponse",
    "Turn",
    "enter",
    "error_response",
    "error_response_handler",
]

T = TypeVar("T")

_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(SFQError):
    """The client left while its request waited its turn: the wait was cancelled and the
    request withdrawn (uncharged; nothing reached an upstream). Answered 499 (nginx's "client
    closed request"), which nobody reads; an expected end, not an error to log."""

    http_status = 499
    error_type = "invalid_request_error"
    error_code = "client_closed_request"

    def __init__(self, message: str = "the client closed the request while it waited its turn") -> None:
        super().__init__(message)


# ---------------------------------------------------------------- errors
def error_response(exc: SFQError) -> Response:
    """The OpenAI-shaped answer to ``exc``: ``exc.to_openai()`` as JSON, status
    ``exc.http_status``, ``Retry-After`` (whole seconds, rounded up, at least 1) when
    ``exc.retry_after`` is set, and ``retry-after-ms`` when the wait is known to the
    millisecond (an org's rate), as ``sfq serve`` answers."""
    headers = {}
    if exc.retry_after is not None and math.isfinite(exc.retry_after):
        headers["Retry-After"] = str(whole_seconds(exc.retry_after))
    ms = retry_after_ms(exc)
    if ms is not None:
        headers["retry-after-ms"] = str(ms)
    return JSONResponse(exc.to_openai(), status_code=exc.http_status, headers=headers)


async def error_response_handler(request: Request, exc: Exception) -> Response:
    """A Starlette/FastAPI exception handler for every ``sfq.SFQError`` (:class:`ClientDisconnected`
    included)::

        app.add_exception_handler(sfq.SFQError, sfq.asgi.error_response_handler)
    """
    if not isinstance(exc, SFQError):
        raise exc
    return error_response(exc)


# ---------------------------------------------------------------- the client's disconnect
class _Watch:
    """Watches ``receive`` for ``http.disconnect`` and, while armed, cancels the task that made
    it when one comes (the request body must have been read: other messages are dropped)."""

    __slots__ = ("gone", "_armed", "_cancelled", "_task", "_watcher")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - always inside a task under an ASGI server
            raise RuntimeError("sfq.asgi needs a running asyncio task")
        self._task = task
        self.gone = False
        self._armed = True
        self._cancelled = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))
        self._watcher.add_done_callback(_retrieve)

    async def _watch(self, receive: Receive) -> None:
        ends = 0
        while (message := await receive())["type"] != "http.disconnect":
            ends = 0 if message.get("more_body") else ends + 1
            if ends > 1:  # a body's end twice: this server does not block here, nothing to watch
                return
        self.gone = True
        if self._armed:
            self._cancelled = True
            self._task.cancel()

    def stop(self) -> None:
        """Nothing more to cancel (idempotent)."""
        self._armed = False
        self._watcher.cancel()

    def caught(self) -> bool:
        """Called on a ``CancelledError`` in the task: whether it was this watch's alone (then
        the task is no longer cancelling, on Python >= 3.11, and may go on)."""
        if not self._cancelled:
            return False
        self._cancelled = False
        uncancel = getattr(self._task, "uncancel", None)
        return uncancel is None or uncancel() == 0


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # a failing receive ends the watch; nothing to report twice


async def _receive_of(source: Request | Receive) -> Receive:
    if not isinstance(source, Request):
        return source
    try:
        await source.body()  # read (and kept: request.body() and request.json() still work)
    except RuntimeError:
        pass  # read by request.stream() already
    except ClientDisconnect:
        raise ClientDisconnected("the client closed the request while sending it") from None
    return source.receive


class Turn(Generic[T]):
    """An async context manager (what ``acquire`` or ``open_stream`` returns) entered while
    the client may leave: see :func:`enter`."""

    __slots__ = ("_source", "_cm", "_state")

    def __init__(self, source: Request | Receive, cm: AbstractAsyncContextManager[T]) -> None:
        self._source = source
        self._cm = cm
        self._state = 0  # 0 new, 1 entering, 2 entered, 3 exited

    def __await__(self) -> Generator[Any, None, T]:
        return self._enter().__await__()

    async def __aenter__(self) -> T:
        return await self._enter()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        """Exit the context manager (once; passing on the exception that ended its use)."""
        if self._state != 2:
            return None
        self._state = 3
        return await self._cm.__aexit__(exc_type, exc, tb)

    async def aclose(self) -> None:
        """Exit the context manager without an exception (once)."""
        await self.__aexit__(None, None, None)

    async def _enter(self) -> T:
        if self._state:
            raise RuntimeError("an sfq.asgi.Turn is entered once")
        self._state = 1
        watch = _Watch(await _receive_of(self._source))
        try:
            value = await self._cm.__aenter__()
        except asyncio.CancelledError:
            if watch.caught():  # the client left: the wait was withdrawn
                raise ClientDisconnected() from None
            raise
        finally:
            watch.stop()
        self._state = 2
        if watch.gone:  # it left as the turn came (and the context manager ignored the cancel)
            watch.caught()
            await self.__aexit__(asyncio.CancelledError, asyncio.CancelledError(), None)
            raise ClientDisconnected()
        return value


def enter(source: Request | Receive, cm: AbstractAsyncContextManager[T]) -> Turn[T]:
    """Enter ``cm`` (``pd.acquire(...)``, ``pd.open_stream(...)``, of either dispatcher) while
    watching the client: ``source`` is the Starlette/FastAPI ``Request`` (its body is read
    first, and kept) or the raw ASGI ``receive`` once the body was read.

    If the client disconnects before ``cm`` is entered, the wait is cancelled (the request is
    withdrawn, uncharged; nothing reaches an upstream) and :class:`ClientDisconnected` is
    raised: answered 499 by :func:`error_response_handler`, with nothing logged. Refusals
    raise here as ``cm`` raises them (``SFQError`` s).

    ``await enter(...)`` gives what ``cm`` yields, and the caller owns its exit: hand an
    ``EventStream`` to :class:`EventStreamResponse`, or keep the :class:`Turn` (``t =
    enter(...); grant = await t``) and pass it as :class:`StreamingResponse`'s ``closing``.
    ``async with enter(...) as grant:`` exits it at the end of the block."""
    return Turn(source, cm)


# ---------------------------------------------------------------- responses
class StreamingResponse(Response):
    """A streamed body (``bytes`` or ``str`` chunks) that owns an entered turn or stream:
    ``closing`` (a :class:`Turn`, an ``EventStream``: any entered async context manager) is
    exited when the body ends, fails, or the client leaves (then with a ``CancelledError``,
    as if its task were cancelled: an acquired request is settled from what was delivered).
    The client's disconnect is watched on ``receive`` while the body streams, and ends it
    quietly. ``background`` runs after a body sent whole."""

    media_type: str | None = None

    def __init__(self, content: AsyncIterable[bytes | str], *, closing: AbstractAsyncContextManager[Any] | None = None,
                 status_code: int = 200, headers: Mapping[str, str] | None = None, media_type: str | None = None,
                 background: BackgroundTask | None = None) -> None:
        self.body_iterator = content
        self.closing = closing
        self.status_code = status_code
        if media_type is not None:
            self.media_type = media_type
        self.background = background
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = _Watch(receive)
        ended: BaseException | None = None
        try:
            await _sent(send, {"type": "http.response.start", "status": self.status_code,
                               "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await _sent(send, {"type": "http.response.body", "more_body": True,
                                   "body": chunk.encode(self.charset) if isinstance(chunk, str) else chunk})
            watch.stop()  # (a server reports a response sent whole as a disconnect)
            await _sent(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except BaseException as exc:
            watch.stop()
            if isinstance(exc, asyncio.CancelledError) and watch.caught():
                ended = exc  # the client left: end quietly
            elif isinstance(exc, _SendFailed):  # ASGI 2.4 servers raise OSError sending to a client that left
                ended = asyncio.CancelledError()
                ended.__cause__ = exc.__cause__
            else:
                await self._close(exc)
                raise
        await self._close(ended)
        if ended is None and self.background is not None:
            await self.background()

    async def _close(self, exc: BaseException | None) -> None:
        it = self.body_iterator
        aclose = getattr(it, "aclose", None)
        try:
            if aclose is not None:
                await aclose()
        finally:
            cm, self.closing = self.closing, None
            if cm is not None:
                await cm.__aexit__(None if exc is None else type(exc), exc, None if exc is None else exc.__traceback__)


class _SendFailed(Exception):
    """``send`` raised ``OSError``: the client is gone (ASGI 2.4)."""


async def _sent(send: Send, message: Message) -> None:
    try:
        await send(message)
    except OSError as exc:
        raise _SendFailed() from exc


class EventStreamResponse(StreamingResponse):
    """An entered ``EventStream`` (``await enter(request, pd.open_stream(...))``) sent as
    server-sent events: ``data: {...}`` per event, ``data: [DONE]`` at the end; an ``SFQError``
    raised while it streams (after the 200 went out) is sent as its ``to_openai()`` event and
    ends the stream. The stream is closed when it ends or the client leaves (which aborts the
    upstream call)."""

    media_type = "text/event-stream"

    def __init__(self, events: EventStream | AsyncIterator[Mapping[str, Any]], *, status_code: int = 200,
                 headers: Mapping[str, str] | None = None, background: BackgroundTask | None = None) -> None:
        closing = events if isinstance(events, AbstractAsyncContextManager) else None
        super().__init__(_sse(events), closing=closing, status_code=status_code,
                         headers={**_SSE_HEADERS, **(headers or {})}, background=background)


async def _sse(events: AsyncIterator[Mapping[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield b"data: " + orjson.dumps(event) + b"\n\n"
    except SFQError as exc:
        yield b"data: " + orjson.dumps(exc.to_openai()) + b"\n\n"
        return
    yield _DONE
