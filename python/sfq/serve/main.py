"""``sfq serve``: the process. Signals, the listening socket, the event loop (uvloop when it
is installed), logging.

* SIGTERM (or SIGINT): stop accepting connections; answer new requests on open connections
  and every waiting request 503; let the running ones finish within ``--grace`` seconds;
  then close the backends (aborting what still runs) and exit 0.
* Once listening, the objects made at start-up (modules, the policy, the backends' sessions)
  are moved out of the garbage collector's sight (``gc.freeze``), and its youngest generation
  is collected after ``GC_THRESHOLD`` net allocations instead of 700: a full collection no
  longer walks everything the process has loaded, and requests in flight no longer trigger
  collections that find nothing to free.
* SIGHUP: re-read the policy file (keys, weights, classes, orgs, limits, the ``server:``
  section) without losing a waiting request; a file that is bad, or that changes what needs
  a restart (pools' backends, ``cost``, ``state``), is refused and logged, and the policy in
  force stays. After a reload that took, the frozen objects go back to the collector, which
  frees the policy and engine replaced, and the survivors are frozen again (``_refreeze``).
* The access log (``--access-log``): written once per event-loop iteration, never blocking the
  loop on a reader that stops reading, and flushed when the gateway stops and at exit
  (:mod:`sfq.serve.accesslog`).
* The edge (:mod:`sfq.serve.edge`): the soft file-descriptor limit is raised to the hard one,
  connections are capped below it, and the ``server:`` section's timeouts close idle,
  trickling and unread connections.
* ``--workers N`` (N > 1): a parent binds the socket and runs N of these processes on it
  (:mod:`sfq.serve.workers`); ``run`` hands over to it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TextIO

from aiohttp import web

from .accesslog import CLOSE_TIMEOUT, AccessLogHandler, open_access_log
from .app import ACCESS_LOGGER, Gateway
from .edge import EdgeSite, raise_fd_limit

__all__ = ["run", "serve", "configure_logging"]

log = logging.getLogger("sfq.serve")

#: the garbage collector's generation-0 threshold once ``sfq serve`` is listening (CPython's
#: default is 700, which the live objects of a few dozen concurrent requests pass all the time:
#: each collection then walks them and moves them to an older generation, only for them to be
#: freed by reference counting moments later)
GC_THRESHOLD = 10_000
#: the signals that stop ``serve`` (a worker of ``--workers`` leaves SIGINT to its parent)
_STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)


def configure_logging(access_log: str = "-", level: int = logging.INFO, stream: TextIO | None = None, *,
                      shared: bool = False) -> None:
    """Diagnostics to stderr; the access log (one JSON object per line) to stdout (``-``), a
    file, or nowhere (``off``).

    The access log gets an :class:`~sfq.serve.accesslog.AccessLogHandler`: the gateway's lines
    skip :mod:`logging` and are written once per event-loop iteration, without ever blocking
    the loop on a reader that stops reading (:mod:`sfq.serve.accesslog`). Calling this again
    flushes and closes the writer it installed before. ``shared``: other processes of the
    same ``sfq serve --workers`` write to the same stderr and access log: each diagnostic
    line names its process (``sfq.serve[PID]``), and each access-log write holds whole lines
    that no other process's write can split."""
    err = logging.StreamHandler(stream if stream is not None else sys.stderr)
    who = "%(name)s[%(process)d]" if shared else "%(name)s"
    err.setFormatter(logging.Formatter(f"%(asctime)s {who} %(levelname)s %(message)s"))
    root = logging.getLogger("sfq")
    root.handlers[:] = [err]
    root.setLevel(level)
    acc = logging.getLogger(ACCESS_LOGGER)
    acc.propagate = False
    # (an OSError leaves things as they were)
    writer = None if access_log == "off" else open_access_log(access_log, shared=shared)
    old = [h for h in acc.handlers if isinstance(h, AccessLogHandler)]
    if writer is None:
        acc.handlers[:] = []
        acc.setLevel(logging.WARNING)
    else:
        h = AccessLogHandler(writer)
        h.setFormatter(logging.Formatter("%(message)s"))
        acc.handlers[:] = [h]
        acc.setLevel(logging.INFO)
    for h in old:
        h.close()


def _flush_access_log(timeout: float = CLOSE_TIMEOUT) -> None:
    """Write what the access log's writer holds, waiting for its reader (at most ``timeout``
    seconds without progress): ``serve`` does it once the gateway has stopped."""
    for h in logging.getLogger(ACCESS_LOGGER).handlers:
        if isinstance(h, AccessLogHandler):
            h.writer.flush(timeout)


async def serve(config: str | Path, *, host: str = "127.0.0.1", port: int = 8080, grace: float = 30.0,
                ready: asyncio.Future[tuple[str, int]] | None = None,
                stop: asyncio.Event | None = None, dashboard: bool = True,
                sockets: Sequence[socket.socket] = ()) -> None:
    """Run the gateway until SIGTERM/SIGINT (or ``stop`` is set), then shut down gracefully.
    ``ready`` gets the bound ``(host, port)`` (``port=0`` picks a free one); ``dashboard=False``
    leaves ``GET /dashboard`` unrouted (404). ``sockets``: listening sockets bound already,
    served instead of binding ``host`` and ``port`` (``sfq serve --workers``: the parent's;
    or a socket handed over by a service manager)."""
    raise_fd_limit()
    gw = Gateway(config, grace=grace, dashboard=dashboard)
    loop = asyncio.get_running_loop()
    stop = stop if stop is not None else asyncio.Event()
    handled: list[signal.Signals] = []
    # the handlers first: a SIGHUP during start-up must not kill the process (its default action)
    def reload() -> None:
        if gw.reload() and _frozen:
            _refreeze()

    wanted: list[tuple[signal.Signals, Callable[[], None]]] = [(s, stop.set) for s in _STOP_SIGNALS]
    for sig, fn in (*wanted, (signal.SIGHUP, reload)):
        try:
            loop.add_signal_handler(sig, fn)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no such signal here
            pass
    # lingering_time=0: a body the gateway chose not to read (a refused key) is not read
    # afterwards either; the connection is closed instead
    runner = web.AppRunner(gw.app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                           lingering_time=0)
    try:
        await runner.setup()
        sites = [EdgeSite(runner, gw.edge, backlog=1024, sock=s) for s in sockets] or \
            [EdgeSite(runner, gw.edge, host, port, backlog=1024)]
        for site in sites:
            await site.start()
        sock = sites[0]._server.sockets[0]  # type: ignore[union-attr]
        bound = sock.getsockname()[:2]
        sv = gw.policy.server
        log.info("listening on http://%s:%d (policy %s; pools: %s; at most %d connections; timeouts: head %g s, "
                 "body %g s, idle %g s, send %g s)", bound[0], bound[1], config, ", ".join(gw.policy.pools),
                 gw.edge.max_connections, sv.header_timeout_seconds, sv.body_timeout_seconds,
                 sv.idle_timeout_seconds, sv.send_timeout_seconds)
        if ready is not None and not ready.done():
            ready.set_result((bound[0], bound[1]))
        await stop.wait()
        log.info("shutting down: no new requests; %d waiting answered 503; running ones get %g s",
                 sum(p["waiting"] for p in gw.pd.stats()["pools"].values()), grace)
        for site in sites:
            await site.stop()  # stop accepting connections
        await gw.drain()
        log.info("drained")
    finally:
        try:
            for sig in handled:
                loop.remove_signal_handler(sig)
            await runner.cleanup()
            if not gw.pd._closed:
                await gw.pd.close()
        finally:
            _flush_access_log()  # every request's line, before the process goes


#: whether this process froze its start-up objects (``_freeze_gc``; ``sfq serve``, not an embedder)
_frozen = False


def _refreeze() -> None:
    """After a reload: what was frozen comes back to the collector, which frees the policy and
    the engine the reload replaced (frozen with the rest at start-up, their reference cycles
    would never be collected: each SIGHUP kept the old ones, about 4 KB per org), and the
    survivors are frozen again."""
    gc.unfreeze()
    _freeze_gc()


def _freeze_gc() -> None:
    """Start-up garbage collected, the survivors frozen (never walked again), the youngest
    generation's threshold raised."""
    global _frozen
    _frozen = True
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD, g1, g2)


async def _serve_process(config: str | Path, *, on_ready: Callable[[], None] | None = None, **kwargs: Any) -> None:
    """``serve`` as the process runs it: the garbage collector tuned once it listens (an
    embedder awaiting ``serve`` keeps its own settings); then ``on_ready`` is called."""
    ready: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()

    def listening(f: asyncio.Future[tuple[str, int]]) -> None:
        if f.cancelled() or f.exception() is not None:
            return
        _freeze_gc()
        if on_ready is not None:
            on_ready()

    ready.add_done_callback(listening)
    await serve(config, ready=ready, **kwargs)


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def run(config: str | Path, *, host: str = "127.0.0.1", port: int = 8080, grace: float = 30.0,
        access_log: str = "-", dashboard: bool = True, workers: int = 1) -> int:
    """``sfq serve``'s entry point: the exit status (0 after a graceful shutdown, 1 when the
    policy file is bad or cannot be read, 2 when the address cannot be bound). ``workers``
    > 1: that many processes on one socket, sharing the policy's Redis
    (:func:`sfq.serve.workers.supervise`)."""
    from ..errors import PolicyError

    if workers > 1:
        from .workers import supervise

        return supervise(config, workers=workers, host=host, port=port, grace=grace, access_log=access_log,
                         dashboard=dashboard)
    configure_logging(access_log)
    return exit_status(config, lambda: _run(_serve_process(config, host=host, port=port, grace=grace,
                                                           dashboard=dashboard)))


def exit_status(config: str | Path, call: Callable[[], object]) -> int:
    """``call()``'s exit status as ``sfq serve`` gives it: 0; 1 when the policy file is bad or
    cannot be read; 2 for another OS error (the address cannot be bound); each said on stderr."""
    from ..errors import PolicyError

    try:
        call()
    except PolicyError as exc:
        print(f"sfq serve: {config}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sfq serve: {exc}", file=sys.stderr)
        return 2
    return 0
