"""What the example proxies' tests share (examples/proxy.py on aiohttp, examples/fastapi_proxy.py
on FastAPI): a bounded wait on an async condition, and the flood scenario each must pass.

A proxy fixture offers ``client(key)`` (an ``openai.AsyncOpenAI`` for one of the example's
users) and ``waiting()`` (how many requests wait in its dispatcher); the upstream fixture
records what it served (``requests``) and holds its one slot until ``release`` is set."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

import sfq

from .processes import free_port


def fake_openai() -> Any:
    """tests/policy/fake_openai.py's ``FakeOpenAI`` class (loaded by path: tests/policy has no
    package), the loopback upstream the example proxies and ``sfq.asgi`` are tested against."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "policy" / "fake_openai.py"
    spec = importlib.util.spec_from_file_location("sfq_support_fake_openai", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FakeOpenAI


@contextlib.asynccontextmanager
async def serving(up: Any) -> AsyncIterator[Any]:
    """A fake upstream started, and stopped on exit (its held slot released first)."""
    await up.start()
    try:
        yield up
    finally:
        if up.release is not None:
            up.release.set()
        await up.stop()


def example_policy(upstream_url: str) -> str:
    """The policy both examples run under: one slot upstream; acme and globex, orgs without keys
    (the proxy authenticates its users); anyone else the proxy names gets the template."""
    return textwrap.dedent(f"""\
        pools:
          gpu:
            models: [m]
            backends: [{{url: "{upstream_url}", max_in_flight: 1}}]
        classes:
          interactive: {{weight: 1}}
        orgs:
          acme: {{classes: [interactive]}}
          globex: {{classes: [interactive]}}
        org_template: {{classes: [interactive]}}
        """)


async def until(cond: Any, what: str, limit: float = 20.0) -> None:
    """Await ``cond()`` every 20 ms until it is true; fail naming ``what`` after ``limit`` s
    (a safety net, not a timing check)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not await cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def prompts(upstream: Any) -> list[str]:
    """The prompts the upstream served, in order."""
    return [str(b.get("prompt")) for b in upstream.requests]


async def flood_then_quiet(proxy: Any, upstream: Any, quiet: int) -> list[str]:
    """acme sends 24 requests (one holds the only slot, 23 queue), then globex sends ``quiet``;
    the slot is released and everything is served. Returns whose each served request was, in
    the order the upstream served them. Under equal weights the two alternate while both wait:
    globex's ``quiet`` are among the ``2 * quiet`` after the first, not after acme's 23."""
    upstream.release = asyncio.Event()
    acme, globex = proxy.client("key-acme"), proxy.client("key-globex")
    flood = [asyncio.create_task(acme.completions.create(model="m", prompt=f"acme {i}", max_tokens=4))
             for i in range(24)]

    async def flooding() -> bool:
        return bool(await proxy.waiting() == 23)
    await until(flooding, "acme's flood to queue")
    polite = [asyncio.create_task(globex.completions.create(model="m", prompt=f"globex {i}", max_tokens=4))
              for i in range(quiet)]

    async def both() -> bool:
        return bool(await proxy.waiting() == 23 + quiet)
    await until(both, "globex's requests to queue behind the flood")
    upstream.release.set()
    await asyncio.gather(*flood, *polite)
    order = [p.split()[0] for p in prompts(upstream)]
    assert len(order) == 24 + quiet and order[0] == "acme"
    assert order[1:1 + 2 * quiet].count("globex") == quiet, order
    return order


class Proxy:
    """An example proxy running as its users run it (:func:`running`): its ``url``, its
    ``/stats``, and ``openai`` clients for its users (closed when it stops)."""

    def __init__(self, url: str, http: aiohttp.ClientSession, log: Path) -> None:
        self.url = url
        self.http = http
        self.log = log
        self.clients: list[Any] = []

    async def stats(self) -> dict[str, Any]:
        async with self.http.get(f"{self.url}/stats") as r:
            assert r.status == 200
            out: dict[str, Any] = await r.json()
            return out

    async def flow(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = (await self.stats())["flows"][name]
        return out

    async def waiting(self) -> int:
        return sum(int(f["waiting"]) for f in (await self.stats())["flows"].values())

    def client(self, key: str) -> Any:
        import openai

        c = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=30)
        self.clients.append(c)
        return c


@contextlib.asynccontextmanager
async def running(example: Path, upstream_url: str, tmp_path: Path) -> AsyncIterator[Proxy]:
    """``python EXAMPLE policy.yaml --port N`` (:func:`example_policy` in front of the upstream)
    in a process of its own, until it answers ``/stats``; terminated on exit. Its output is in
    ``proxy.log`` under ``tmp_path`` (``Proxy.log``)."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(example_policy(upstream_url))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(sfq.__file__).resolve().parents[1])}
    log_path = tmp_path / "proxy.log"
    log = log_path.open("wb")
    proc = await asyncio.create_subprocess_exec(sys.executable, str(example), str(policy), "--port", str(port),
                                                env=env, stdout=log, stderr=log)
    async with aiohttp.ClientSession() as http:
        p = Proxy(f"http://127.0.0.1:{port}", http, log_path)

        async def up() -> bool:
            if proc.returncode is not None:
                raise AssertionError("the proxy exited: " + log_path.read_text())
            try:
                await p.stats()
            except aiohttp.ClientError:
                return False
            return True

        try:
            await until(up, "the proxy to listen", 30.0)
            yield p
        finally:
            for c in p.clients:
                await c.close()
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)
            log.close()
