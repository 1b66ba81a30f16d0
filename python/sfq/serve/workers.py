"""``sfq serve --workers N``: N gateway processes on one listening socket, sharing the ledger.

Each worker is a whole gateway (:func:`sfq.serve.main.serve`) with its own engine, its own
``RedisState`` and its own random gateway id: exactly what several ``sfq serve`` sharing Redis
are (docs/gateway.md, "Several gateways"), so every limit, budget and the fair order hold over
the workers as they hold over gateways. That is why N > 1 needs the policy's ``state.redis``:
an in-memory ledger cannot be shared by processes, and without Redis each worker would enforce
every limit on its own (N times the pool's ``max_in_flight``).

The parent (:class:`Supervisor`) runs no event loop and serves nothing:

* It reads the policy (a bad file, or one without ``state.redis``, exits 1 before anything
  starts), binds the address once (``port`` 0 picks a free one; a host with several addresses
  gets one socket each, on the same port) and listens, then forks the workers before any event
  loop exists. Each worker serves the inherited socket; the kernel hands each new connection
  to whichever worker accepts it first (a busy worker accepts less).
* SIGTERM or SIGINT: the parent closes its copy of the socket and sends SIGTERM to every
  worker once (each drains as one gateway does: ``--grace``); it exits 0 when every worker
  exited 0, 1 otherwise. A worker still draining ``--grace`` + :data:`KILL_AFTER` seconds
  later is killed (SIGKILL), and the exit status is 1. Workers ignore SIGINT (a terminal's
  Ctrl-C reaches the whole process group): the parent's SIGTERM is the one they act on.
* SIGHUP: sent on to every worker; each re-reads the file (a worker still starting reloads
  once it listens).
* A worker that exits while the parent is not stopping is replaced after a back-off
  (:data:`BACKOFF_FIRST` seconds, doubled for each worker of that slot that died within
  :data:`STABLE_SECONDS` of its start, at most :data:`BACKOFF_MAX`); each death is logged
  with its pid and status. A worker that fails before the workers ever listened (its policy
  differs from the one in force in Redis, say) stops the parent with its status instead.
* Workers die with the parent (Linux's ``PR_SET_PDEATHSIG``: SIGTERM, a graceful drain).
* Logs: every diagnostic line names its process (``sfq.serve[PID]``); the access log is
  written by each worker, whole lines per write (:mod:`sfq.serve.accesslog`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["supervise", "bind", "Supervisor", "needs_redis", "BACKOFF_FIRST", "BACKOFF_MAX", "STABLE_SECONDS",
           "KILL_AFTER"]

log = logging.getLogger("sfq.serve")

#: seconds before a worker that died is replaced, the first time
BACKOFF_FIRST = 0.5
#: seconds: the most a replacement waits (workers that keep dying at start)
BACKOFF_MAX = 30.0
#: seconds a worker must have run for its death not to count as one more quick failure
STABLE_SECONDS = 10.0
#: seconds past ``--grace`` after which the parent kills workers still draining
KILL_AFTER = 30.0

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)


def needs_redis(config: str | Path, workers: int) -> str | None:
    """Why ``config`` cannot run with ``workers`` processes (``None``: it can): the policy must
    keep its state in Redis. Raises ``PolicyError`` or ``OSError`` as ``load_policy`` does."""
    from ..policy import load_policy

    st = load_policy(config).state
    if st is not None and st.redis:
        return None
    where = "keeps its state in memory" if st is None else "has no state.redis (state.file is one process's spend)"
    return (f"--workers {workers} needs state.redis in the policy file: the workers are separate processes that "
            f"share limits, budgets and the fair order only through Redis (docs/gateway.md, 'Several gateways'); "
            f"this policy {where}")


def bind(host: str, port: int, backlog: int = 1024) -> list[socket.socket]:
    """Listening sockets for ``host`` and ``port``, as ``loop.create_server`` binds them (every
    address ``host`` names, ``SO_REUSEADDR``, IPv6 sockets IPv6 only), but with one port for
    all of them when ``port`` is 0. Raises ``OSError`` naming the address."""
    infos = socket.getaddrinfo(host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    chosen = port
    seen: set[tuple[int, str]] = set()
    try:
        for af, kind, proto, _, addr in infos:
            if (af, str(addr[0])) in seen:
                continue
            seen.add((af, str(addr[0])))
            s = socket.socket(af, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if af == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            where = (addr[0], chosen, *addr[2:])
            try:
                s.bind(where)
            except OSError as exc:
                raise OSError(exc.errno, f"error while attempting to bind on address {where[:2]!r}: "
                                         f"{(exc.strerror or str(exc)).lower()}") from None
            chosen = int(s.getsockname()[1])
            s.listen(backlog)
    except BaseException:
        for s in socks:
            s.close()
        raise
    if not socks:
        raise OSError(errno.EADDRNOTAVAIL, f"no address to listen on for host {host!r}")
    return socks


@dataclass
class _Worker:
    """One worker's slot: its process while it runs, its back-off while it is replaced."""

    slot: int
    pid: int = 0
    started: float = 0.0
    ready: bool = False
    quick_deaths: int = 0  # deaths in a row within STABLE_SECONDS of their start
    restart_at: float | None = None
    status: int | None = None  # the last exit status (a signal's death: -signum)
    final: int | None = None  # the status of its exit once the parent was stopping


class Supervisor:
    """The parent of ``sfq serve --workers N`` (see the module's docstring): :meth:`run` starts
    the workers on ``sockets`` and returns the exit status."""

    def __init__(self, config: str | Path, sockets: list[socket.socket], *, workers: int, grace: float,
                 access_log: str, dashboard: bool) -> None:
        self.config = config
        self.sockets = sockets
        self.grace = grace
        self.access_log = access_log
        self.dashboard = dashboard
        self.workers = [_Worker(i + 1) for i in range(workers)]
        self.stopping = False
        self.kill_at: float | None = None
        self.listening = False  # every worker listened once (the start is over)
        self._signals: list[int] = []
        self._pid = os.getpid()
        self._ready_r, self._ready_w = os.pipe()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._ready_r, self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._partial = b""
        self.failed: int | None = None  # a worker's status that ends the start (it failed before listening)

    # ------------------------------------------------------------ the loop
    def run(self) -> int:
        old = {sig: signal.signal(sig, self._on_signal) for sig in _FORWARDED}
        old_wake = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        try:
            for w in self.workers:
                self._spawn(w)
            while True:
                self._handle_signals()
                self._reap()
                if self.failed is not None and not self.stopping:
                    self._stop()
                if self.stopping and not any(w.pid for w in self.workers):
                    break
                now = time.monotonic()
                if self.kill_at is not None and now >= self.kill_at:
                    self._kill_stragglers()
                for w in self.workers:
                    if w.restart_at is not None and now >= w.restart_at and not self.stopping:
                        self._spawn(w)
                self._wait(self._timeout(time.monotonic()))
        finally:
            signal.set_wakeup_fd(old_wake)
            for sig, h in old.items():
                signal.signal(sig, h)
            for fd in (self._ready_r, self._ready_w, self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._close_sockets()
        if self.failed is not None:
            return self.failed
        bad = [w for w in self.workers if w.final not in (None, 0)]
        log.info("stopped: %d workers exited%s", sum(1 for w in self.workers if w.final is not None),
                 "" if not bad else f", {len(bad)} not with status 0")
        return 0 if not bad else 1

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)  # (the wake-up fd wakes the select)

    def _timeout(self, now: float) -> float:
        times = [w.restart_at for w in self.workers if w.restart_at is not None and not self.stopping]
        if self.kill_at is not None:
            times.append(self.kill_at)
        return max(0.0, min([now + 5.0, *times]) - now)

    def _wait(self, timeout: float) -> None:
        try:
            readable, _, _ = select.select([self._ready_r, self._wake_r], [], [], timeout)
        except InterruptedError:  # pragma: no cover - PEP 475 retries select
            return
        if self._wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 512):
                    pass
        if self._ready_r in readable:
            self._read_ready()

    def _handle_signals(self) -> None:
        while self._signals:
            sig = self._signals.pop(0)
            if sig in (signal.SIGTERM, signal.SIGINT):
                if self.stopping:
                    log.info("%s: already stopping (%d workers draining)", signal.Signals(sig).name,
                             sum(1 for w in self.workers if w.pid))
                    continue
                log.info("%s: stopping the workers (each drains; running requests get %g s)",
                         signal.Signals(sig).name, self.grace)
                self._stop()
            elif sig == signal.SIGHUP and self.stopping:  # (a worker past its drain would die of it)
                log.info("SIGHUP: not passed on, the workers are stopping")
            elif sig == signal.SIGHUP:
                live = [w for w in self.workers if w.pid]
                log.info("SIGHUP: every worker re-reads %s (pids %s)", self.config,
                         ", ".join(str(w.pid) for w in live) or "none running")
                for w in live:
                    self._send(w, signal.SIGHUP)
            # SIGCHLD: _reap looks

    def _stop(self) -> None:
        self.stopping = True
        self._close_sockets()  # the workers' copies close as they drain; then the port refuses connections
        for w in self.workers:
            w.restart_at = None
            if w.pid:
                self._send(w, signal.SIGTERM)
        self.kill_at = time.monotonic() + self.grace + KILL_AFTER

    def _kill_stragglers(self) -> None:
        self.kill_at = None
        for w in self.workers:
            if w.pid:
                log.error("worker %d (pid %d) still running %g s after SIGTERM: killing it", w.slot, w.pid,
                          self.grace + KILL_AFTER)
                self._send(w, signal.SIGKILL)

    def _send(self, w: _Worker, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, sig)

    def _close_sockets(self) -> None:
        for s in self.sockets:
            s.close()

    # ------------------------------------------------------------ workers
    def _reap(self) -> None:
        for w in self.workers:
            if not w.pid:
                continue
            try:
                pid, raw = os.waitpid(w.pid, os.WNOHANG)
            except ChildProcessError:  # pragma: no cover - reaped elsewhere
                pid, raw = w.pid, 0
            if pid == 0:
                continue
            self._ended(w, os.waitstatus_to_exitcode(raw))

    def _ended(self, w: _Worker, status: int) -> None:
        pid, lived, was_ready = w.pid, time.monotonic() - w.started, w.ready
        w.pid, w.ready, w.status = 0, False, status
        if self.stopping:
            w.final = status
            (log.info if status == 0 else log.error)("worker %d (pid %d) exited with %s", w.slot, pid,
                                                     _status(status))
            return
        if not was_ready and not self.listening and status > 0:  # the start failed: as one gateway would
            log.error("worker %d (pid %d) failed to start (%s): stopping", w.slot, pid, _status(status))
            self.failed = status
            return
        w.quick_deaths = w.quick_deaths + 1 if lived < STABLE_SECONDS else 0
        delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** max(0, w.quick_deaths - 1))
        w.restart_at = time.monotonic() + delay
        log.warning("worker %d (pid %d) %s after %.1f s; starting another in %g s", w.slot, pid,
                    _status(status), lived, delay)

    def _spawn(self, w: _Worker) -> None:
        w.restart_at = None
        for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
            with contextlib.suppress(Exception):
                stream.flush()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
            w.restart_at = time.monotonic() + BACKOFF_MAX
            log.error("cannot start worker %d: %s; trying again in %g s", w.slot, exc, BACKOFF_MAX)
            return
        if pid == 0:  # the worker: never returns
            code = 1
            try:
                code = self._child(w.slot, old)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    logging.shutdown()
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        w.pid, w.started, w.ready = pid, time.monotonic(), False
        log.info("worker %d started (pid %d)", w.slot, pid)

    def _read_ready(self) -> None:
        try:
            data = os.read(self._ready_r, 4096)
        except BlockingIOError:
            return
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                slot_s, pid_s = line.split()
                slot, pid = int(slot_s), int(pid_s)
            except ValueError:
                continue
            for w in self.workers:
                if w.slot == slot and w.pid == pid:
                    w.ready = True
        if not self.listening and all(w.ready for w in self.workers):
            self.listening = True
            names = ", ".join(_url(s) for s in self.sockets if s.fileno() >= 0)
            log.info("%d workers listening on %s (pids %s; policy %s)", len(self.workers), names,
                     ", ".join(str(w.pid) for w in self.workers), self.config)

    # ------------------------------------------------------------ in the worker
    def _child(self, slot: int, mask: set[int | signal.Signals]) -> int:
        """The worker's life after the fork (the signals still blocked): its own signal
        handling, then ``serve`` on the inherited sockets. Returns its exit status."""
        from . import main

        early: list[int] = []  # SIGTERM / SIGHUP before serve's handlers exist: acted on once it listens
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda signum, frame: early.append(signum))
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's SIGTERM is the one that stops a worker
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (self._ready_r, self._wake_r, self._wake_w):
            os.close(fd)
        ready_w = self._ready_w
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _die_with_parent(self._pid)
        main._STOP_SIGNALS = (signal.SIGTERM,)
        try:
            main.configure_logging(self.access_log, shared=True)
        except OSError as exc:
            print(f"sfq serve: worker {slot}: cannot open the access log {self.access_log!r}: {exc}",
                  file=sys.stderr)
            return 2

        def on_ready() -> None:
            with contextlib.suppress(OSError):
                os.write(ready_w, f"{slot} {os.getpid()}\n".encode())
                os.close(ready_w)
            for sig in early:  # serve's own handlers take them now
                os.kill(os.getpid(), sig)

        status: int = main.exit_status(self.config, lambda: main._run(main._serve_process(
            self.config, sockets=self.sockets, grace=self.grace, dashboard=self.dashboard, on_ready=on_ready)))
        return status


def _die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGTERM when its parent dies (it drains, as it would when told)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - no libc prctl
        return
    if os.getppid() != parent:  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def _status(code: int | None) -> str:
    if code is None:
        return "no status"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"status {code}"


def _url(s: socket.socket) -> str:
    host, port = s.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in str(host) else f"http://{host}:{port}"


def supervise(config: str | Path, *, workers: int, host: str = "127.0.0.1", port: int = 8080,
              grace: float = 30.0, access_log: str = "-", dashboard: bool = True) -> int:
    """``sfq serve --workers N``: the exit status (0 when every worker drained and exited 0; 1
    when the policy file is bad, has no ``state.redis``, or a worker failed; 2 when the address
    cannot be bound or the file cannot be read)."""
    from .main import configure_logging, exit_status

    configure_logging("off", shared=True)  # the parent's own lines (each worker opens the access log itself)
    said: list[str | None] = []
    status = exit_status(config, lambda: said.append(needs_redis(config, workers)))
    if status:
        return status
    why = said[0]
    if why is not None:
        print(f"sfq serve: {config}: {why}", file=sys.stderr)
        return 1
    if access_log not in ("-", "off"):  # a file no worker could open: said once, before any starts
        try:
            os.close(os.open(access_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666))
        except OSError as exc:
            print(f"sfq serve: cannot open the access log {access_log!r}: {exc}", file=sys.stderr)
            return 2
    try:
        socks = bind(host, port)
    except OSError as exc:
        print(f"sfq serve: {exc}", file=sys.stderr)
        return 2
    log.info("bound %s; starting %d workers", ", ".join(_url(s) for s in socks), workers)
    return Supervisor(config, socks, workers=workers, grace=grace, access_log=access_log, dashboard=dashboard).run()
