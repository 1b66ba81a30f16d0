"""The one public type of a streamed request's events, whichever dispatcher streams it."""

from __future__ import annotations

import abc
from typing import Any

__all__ = ["EventStream"]


class EventStream(abc.ABC):
    """A streamed request's events (each the backend's server-sent event as a parsed JSON
    object, an OpenAI chunk): what ``Dispatcher.stream``/``open_stream`` and
    ``PolicyDispatcher.stream``/``stream_flow``/``open_stream`` return.

    An async context manager and a closeable async iterator::

        async with dispatcher.open_stream(flow, body) as events:   # admitted, upstream answered
            async for event in events:
                ...

    Entering it opens the request: admission, the wait for its turn and the upstream's answer
    up to its first event, so every refusal still raises there as an ``sfq.SFQError`` with
    an ``http_status``. Iterating without entering opens it at the first iteration. Leaving
    early (``aclose()``, leaving the ``async with``, cancelling the task) cancels the request
    and aborts the upstream call. The upstream is always asked for usage; a usage-only event
    is passed on only when the body asked for it (``stream_options.include_usage``).
    """

    __slots__ = ()

    def __aiter__(self) -> EventStream:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> dict[str, Any]:
        """The next event; ``StopAsyncIteration`` at the end."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """End the stream: a request still running is cancelled and its upstream call aborted."""

    @abc.abstractmethod
    async def __aenter__(self) -> EventStream:
        """Open the stream (admitted, its turn, the upstream's first event) and return it."""

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
