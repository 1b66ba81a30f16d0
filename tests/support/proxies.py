"""What the example proxies' tests share (examples/proxy.py on aiohttp, examples/fastapi_proxy.py
on FastAPI): a bounded wait on an async condition, and the flood scenario each must pass.

A proxy fixture offers ``client(key)`` (an ``openai.AsyncOpenAI`` for one of the example's
users) and ``waiting()`` (how many requests wait in its dispatcher); the upstream fixture
records what it served (``requests``) and holds its one slot until ``release`` is set."""

from __future__ import annotations

import asyncio
import textwrap
from typing import Any


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
