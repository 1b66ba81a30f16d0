"""The small interface between the dispatcher and a transport to one inference server.

A backend knows how to send one OpenAI-shaped request and nothing about flows, costs or
queues. The dispatcher owns everything else: how many requests each backend has in flight,
whether it is healthy, when to probe it. Adding a transport (an in-process engine, another
HTTP dialect) means subclassing ``Backend`` and implementing ``complete`` and ``stream``.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Any

from .probe import SaturationProbe

__all__ = ["Backend", "COMPLETIONS", "CHAT_COMPLETIONS", "ENDPOINTS", "JSONBody", "JSONEvent"]

#: endpoint names, relative to the OpenAI API root ``/v1/``
COMPLETIONS = "completions"
CHAT_COMPLETIONS = "chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)


class JSONBody(dict[str, Any]):
    """A request body parsed from JSON, with the bytes it was parsed from (``raw``): a backend
    that speaks JSON may send ``raw`` as it is instead of encoding the dict again (a gateway
    forwards its client's body unchanged). Whoever changes the dict must drop ``raw``
    (:meth:`changed`); every other backend reads it as the plain dict it is."""

    __slots__ = ("raw",)

    def __init__(self, parsed: dict[str, Any], raw: bytes | None) -> None:
        super().__init__(parsed)
        self.raw = raw

    def changed(self) -> dict[str, Any]:
        """A plain copy to change (its bytes would no longer say the same)."""
        return dict(self)

    def streamed_with_usage(self) -> JSONBody:
        """This body as a stream that asks the server for usage (``"stream": true`` and
        ``stream_options.include_usage``): itself when it already does; when it has no
        ``stream_options`` at all, the key is written before the others in ``raw`` (no
        re-encoding); otherwise a copy without ``raw``."""
        so = self.get("stream_options")
        if self.get("stream") is True and type(so) is dict and so.get("include_usage") is True:
            return self
        usage = {**(so if isinstance(so, dict) else {}), "include_usage": True}
        out = JSONBody({**self, "stream": True, "stream_options": usage}, None)
        raw = self.raw
        if raw is not None and "stream_options" not in self and self.get("stream") is True:
            head = raw.lstrip()
            if head[:1] == b"{" and head[1:].lstrip()[:1] not in (b"}", b""):
                out.raw = b'{"stream_options":{"include_usage":true},' + head[1:]
        return out


class JSONEvent(dict[str, Any]):
    """A streamed event parsed from JSON, with the bytes it was parsed from (``raw``: the
    event's ``data`` as the server sent it, in one ``data: `` line; not set for an event that
    came in several lines, or ``data:`` without its space: ``getattr(ev, "raw", None)``). A
    gateway writes ``raw`` to its client instead of encoding the dict again, so the client gets
    the upstream's bytes unchanged; everyone else reads it as the plain dict it is. Made as
    ``ev = JSONEvent(parsed); ev.raw = data`` (the dict's own constructor, no Python frame per
    event; no ``__getattr__`` either, which would slow every method call on it). Whoever
    changes the dict must not pass ``raw`` on."""

    __slots__ = ("raw",)
    raw: bytes


def body_bytes(body: object) -> bytes | None:
    """The JSON bytes ``body`` was parsed from, when it is a :class:`JSONBody` that has them."""
    return body.raw if type(body) is JSONBody else None


class Backend(abc.ABC):
    """One inference server as the dispatcher sees it.

    Attributes the dispatcher reads (set them in ``__init__``):

    ``name``           unique within a dispatcher; names the backend in stats and errors.
    ``model``          the model (pool) it serves; ``None`` serves any model name (the default pool).
    ``max_in_flight``  requests the dispatcher keeps in flight here at most (>= 1).
    ``max_context``    tokens (prompt + max_tokens) one request may need here; ``None`` = no limit.
    ``probe``          a ``SaturationProbe`` (then ``fetch_metrics`` must work) or ``None``.

    Contract of the coroutines: failures are raised as ``sfq.errors.BackendError`` subclasses
    (with ``unhealthy`` set when the failure points at the server); cancelling the calling
    task aborts the request (the server sees the connection close).
    """

    name: str
    model: str | None
    max_in_flight: int
    max_context: int | None
    probe: SaturationProbe | None

    def __init__(self, name: str, *, model: str | None = None, max_in_flight: int = 8,
                 max_context: int | None = None, probe: SaturationProbe | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"backend name must be a non-empty string, got {name!r}")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"model must be a string or None, got {model!r}")
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                        or max_context < 1):
            raise ValueError(f"max_context must be an integer >= 1 or None, got {max_context!r}")
        if probe is not None and not isinstance(probe, SaturationProbe):
            raise TypeError(f"probe must be a SaturationProbe or None, got {probe!r}")
        self.name = name
        self.model = model
        self.max_in_flight = max_in_flight
        self.max_context = max_context
        self.probe = probe

    async def start(self) -> None:
        """Acquire resources (sessions, connections). Called once by the dispatcher before use."""

    async def close(self) -> None:
        """Release resources. Requests still running are aborted."""

    @abc.abstractmethod
    async def complete(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """Send a non-streaming request to ``endpoint`` (``COMPLETIONS`` or ``CHAT_COMPLETIONS``)
        and return the server's JSON reply (with ``usage`` when the server reports it).

        The dispatcher passes ``idempotent=True`` (a keyword) only for requests the caller marked
        so: a backend may then resend after a lost connection. Without it, resend only what
        provably never reached the server (and set ``never_sent`` on errors where that holds)."""

    @abc.abstractmethod
    def stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Send a streaming request and yield each event's JSON object until the server's end
        marker. Ask the server for usage (the last chunk carries ``usage``). Raise
        ``StreamInterrupted`` when the stream ends without its end marker."""

    async def check_health(self) -> bool:
        """True when the server can take traffic again (called after failures, with backoff)."""
        return True

    async def fetch_metrics(self) -> str:
        """The server's Prometheus text exposition (for the saturation probe)."""
        raise NotImplementedError(f"backend {self.name!r} cannot fetch metrics")

    async def __aenter__(self) -> Backend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, model={self.model!r}, max_in_flight={self.max_in_flight})"
