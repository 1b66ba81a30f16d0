"""The floor for ``bench_proxy.py``: the least an aiohttp proxy does (uvloop when installed).
No policy, no log, no metrics: the client's body goes upstream as bytes (its headers do not),
a JSON reply comes back as bytes, an event stream is passed on piece by piece as it arrives.

Usage: ``python benchmarks/bare_proxy.py UPSTREAM_URL [PORT]`` (prints ``ready PORT``).
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
from aiohttp import web

HEADERS = {"Content-Type": "application/json"}


async def main(upstream: str, port: int) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=None))

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with session.post(upstream + request.path, data=body, headers=HEADERS) as up:
            if up.content_type != "text/event-stream":
                return web.Response(status=up.status, body=await up.read(), content_type=up.content_type)
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            async for piece in up.content.iter_any():
                await resp.write(piece)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_post("/v1/completions", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    print(f"ready {site._server.sockets[0].getsockname()[1]}", flush=True)  # type: ignore[union-attr]
    await asyncio.Event().wait()


if __name__ == "__main__":
    args = (sys.argv[1].rstrip("/"), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    try:
        from uvloop import run
    except ImportError:
        from asyncio import run
    try:
        run(main(*args))
    except KeyboardInterrupt:
        pass
