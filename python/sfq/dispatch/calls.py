"""The calls: ``submit`` (one JSON reply) and ``stream`` (server-sent events), each from
admission through the backend call to exactly one outcome."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable, Mapping
from typing import Any

from ..errors import BackendError
from ._state import ABORTED, FAILED, OK, PLACED, DispatcherBase


class Calls(DispatcherBase):
    async def submit(self, flow: Hashable, body: Mapping[str, Any], *, cost: float | None = None) -> dict[str, Any]:
        """Queue a non-streaming request of ``flow`` and return the backend's JSON reply.

        ``body`` is an OpenAI ``/v1/completions`` (``prompt``) or ``/v1/chat/completions``
        (``messages``) request; ``cost`` overrides the estimator's cost (cost units).
        Raises ``BackendError`` subclasses for backend failures, ``DispatcherClosed``,
        ``UnknownModel``, ``RequestTooLarge``, or ``ValueError``/``TypeError`` for bad input
        (nothing queued then).
        """
        if not self._started:
            await self.start()
        job = self._admit(flow, body, cost, False)
        if job.state != PLACED:
            await self._wait_placed(job)
        bs = job.bs
        assert bs is not None
        try:
            reply = await bs.backend.complete(job.endpoint, job.body)
        except asyncio.CancelledError:
            self._finish(job, ABORTED)
            raise
        except BackendError as exc:
            self._finish(job, FAILED, exc)
            raise
        except Exception as exc:
            err = BackendError(f"backend {bs.name!r} raised {type(exc).__name__}: {exc}", backend=bs.name)
            self._finish(job, FAILED, err)
            raise err from exc
        self._finish(job, OK, None, reply.get("usage") if isinstance(reply, dict) else None)
        return reply

    async def stream(self, flow: Hashable, body: Mapping[str, Any], *,
                     cost: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """Queue a streaming request of ``flow`` and yield the backend's events (JSON objects).

        The request is queued when iteration starts. Stopping early (``break``, or closing the
        generator: use ``contextlib.aclosing``) or cancelling the consuming task aborts it.
        Usage is always asked of the backend; the usage-only final chunk is passed on only
        when the body asked for it (``stream_options.include_usage``).
        """
        if not self._started:
            await self.start()
        job = self._admit(flow, body, cost, True)
        if job.state != PLACED:
            await self._wait_placed(job)
        bs = job.bs
        assert bs is not None
        so = job.body.get("stream_options")
        wants_usage = isinstance(so, Mapping) and bool(so.get("include_usage"))
        usage = None
        outcome, err = ABORTED, None
        agen = None
        try:
            agen = bs.backend.stream(job.endpoint, job.body)  # may raise before returning an iterator
            async for event in agen:
                u = event.get("usage")
                if u:
                    usage = u
                    if not wants_usage and not event.get("choices"):
                        continue
                yield event
            outcome = OK
        except BackendError as exc:
            outcome, err = FAILED, exc
            raise
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            outcome = FAILED
            err = BackendError(f"backend {bs.name!r} raised {type(exc).__name__}: {exc}", backend=bs.name)
            raise err from exc
        finally:
            aclose = getattr(agen, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                self._finish(job, outcome, err, usage)
