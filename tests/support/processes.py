"""Real processes for the tests and the benchmarks: ``redis-server`` on a free loopback port and
``sfq serve`` (``python -m sfq serve``), with bounded waits.

Every wait is bounded (:func:`wait_until`); nothing here measures time to pass or fail a test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

LIMIT = 20.0  # seconds: the safety net of every wait (never a timing check)
REDIS = shutil.which("redis-server") or (
    "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(cond: Callable[[], Any], what: str, limit: float = LIMIT) -> Any:
    deadline = time.monotonic() + limit
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)



def stop_process(proc: subprocess.Popen[Any]) -> int | None:
    """SIGTERM ``proc`` (a graceful stop), SIGKILL it if it is not gone within ``LIMIT``; its
    exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(LIMIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(LIMIT)
    return proc.returncode

class RedisServer:
    """``redis-server --port N --save "" --appendonly no`` (nothing persists: a restart is empty)."""

    def __init__(self, port: int | None = None) -> None:
        assert REDIS is not None
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen([REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.ping, "redis-server to answer")
        return self

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(LIMIT)
        self.proc = None


class Gateway:
    """``python -m sfq serve`` on a free loopback port (its stderr collected). ``wait=False``
    returns at once (start several, then :meth:`listen` on each): ``url`` is empty until then."""

    def __init__(self, config: Path, *, wait: bool = True, grace: float = 2.0,
                 extra: Sequence[str] = ("--access-log", "off"), env: dict[str, str] | None = None,
                 port: int = 0) -> None:
        cmd = [sys.executable, "-m", "sfq", "serve", "--config", str(config), "--port", str(port), "--grace",
               str(grace), *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=None if env is None else {**os.environ, **env})
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = ""
        if wait:
            self.listen()

    def listen(self, limit: float = LIMIT) -> str:
        """Wait (bounded) until the gateway says where it listens; its URL."""
        line = wait_until(lambda: next((x for x in self.err if "listening on http://" in x), None)
                          or (self.proc.poll() is not None and "exited"), "the gateway to listen", limit)
        if line == "exited":
            time.sleep(0.2)
            raise RuntimeError(f"sfq serve exited with {self.proc.returncode}:\n{''.join(self.err)}")
        self.url = line.split("listening on ")[1].split()[0]
        return self.url

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            self.err.append(raw.decode("utf-8", "replace"))

    def post(self, key: str, prompt: str, timeout: float = LIMIT,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        data = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=data, method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def state_stats(self) -> dict[str, Any]:
        try:
            return dict(self.health()[1].get("state") or {})
        except (OSError, ValueError):
            return {}

    def round_trips(self) -> int:
        """The Redis round trips this gateway made so far (``/health``'s state; 0 in memory or
        unreachable)."""
        try:
            st = self.health()[1].get("state") or {}
        except (OSError, ValueError):
            return 0
        return int(st.get("round_trips", 0))

    def health(self) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=LIMIT) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(LIMIT)

    def stop(self) -> int | None:
        return stop_process(self.proc)
