"""The :class:`Permit` of :meth:`~sfq.dispatch.PolicyDispatcher.acquire`: an async context
manager that waits for the request's turn, yields its :class:`~sfq.dispatch.policy_calls.Grant`
and ends the request when left.

Compiled by mypyc with the engine (``sfq._compiled.MODULES``): every permit enters and
leaves here. Its arguments come checked from ``acquire`` (the driver checks ``cost``,
``timeout`` and ``max_wait``, with the twin's messages), so they are annotated ``object``:
mypyc would check and convert an annotated ``float`` itself, with a message of its own."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..engine.pool import RUNNING
from ..errors import BackendError
from .policy_calls import Grant, _endpoint

if TYPE_CHECKING:
    from .policy_dispatcher import PolicyDispatcher

__all__ = ["Permit"]


class Permit:
    """What :meth:`PolicyDispatcher.acquire` returns: an async context manager that waits for
    the request's turn when entered, yields its :class:`Grant`, and ends the request when left
    (see ``acquire``). Enter it once."""

    __slots__ = ("_pd", "_flow", "_body", "_cost", "_timeout", "_max_wait", "grant")

    def __init__(self, pd: PolicyDispatcher, flow: object, body: object, cost: object, timeout: object,
                 max_wait: object = None) -> None:
        # (as acquire() typed them: a Flow, a Mapping or None, float or None, float or None,
        # float or None; checked as the request is admitted, in __aenter__)
        self._pd = pd
        self._flow: Any = flow
        self._body: Any = body
        self._cost: Any = cost
        self._timeout: Any = timeout
        self._max_wait: Any = max_wait
        #: the grant, once entered
        self.grant: Grant | None = None

    async def __aenter__(self) -> Grant:
        if self.grant is not None:
            raise RuntimeError("this permit was already entered; call acquire() again")
        pd = self._pd
        body = self._body
        if pd._started and not pd._shared:  # nothing to await unless it must wait its turn
            r = pd._admit_now(self._flow, body, self._timeout, None, None, self._cost, self._max_wait)
            if r.state != RUNNING:
                await pd._turn(r)
        else:
            r = await pd._admit(self._flow, body, self._timeout, None, None, self._cost, self._max_wait)
            await pd._turn(r)
        assert r.backend is not None
        g = self.grant = Grant(pd, r, pd._addresses[r.backend], None if body is None else _endpoint(body))
        return g

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        g = self.grant
        if g is None or g._ended:
            return
        g._ended = True
        pd = self._pd
        r = g.request
        if exc is None:
            pd._completed(r, None, None)
        elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            pd._gave_up(r)
        elif isinstance(exc, BackendError):  # reported: counts toward the backend's health
            pd._attempt_failed(r, exc, retryable=False, reported=True)
        else:  # the embedder's own error: frees the slot, never the backend's fault
            pd._abort(r, exc)
