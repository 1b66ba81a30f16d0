"""The baseline for ``bench_serve.py``'s overload run: a plain FIFO proxy, what an operator
has without sfq. One queue for everybody, first come first served (``asyncio.Semaphore``
wakes its waiters in order), at most ``--max-in-flight`` requests upstream, bodies and
streams passed through as they come.

Usage: ``python benchmarks/fifo_proxy.py --upstream URL --port PORT --max-in-flight N``
(prints ``ready PORT`` when listening).
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web


def build(upstream: str, max_in_flight: int) -> web.Application:
    sem = asyncio.Semaphore(max_in_flight)
    app = web.Application()
    state: dict[str, aiohttp.ClientSession] = {}

    async def startup(app: web.Application) -> None:
        state["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                           timeout=aiohttp.ClientTimeout(total=None))

    async def cleanup(app: web.Application) -> None:
        await state["s"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with sem:
            async with state["s"].post(upstream + request.path, data=body,
                                       headers={"Content-Type": "application/json"}) as up:
                resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
                await resp.prepare(request)
                async for piece in up.content.iter_any():
                    await resp.write(piece)
                await resp.write_eof()
                return resp

    app.router.add_post("/v1/completions", forward)
    app.router.add_post("/v1/chat/completions", forward)
    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    return app


async def main(upstream: str, port: int, max_in_flight: int) -> None:
    runner = web.AppRunner(build(upstream.rstrip("/"), max_in_flight), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    print(f"ready {site._server.sockets[0].getsockname()[1]}", flush=True)  # type: ignore[union-attr]
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-in-flight", type=int, required=True)
    a = ap.parse_args()
    try:
        import uvloop

        uvloop.run(main(a.upstream, a.port, a.max_in_flight))
    except ImportError:
        asyncio.run(main(a.upstream, a.port, a.max_in_flight))
    except KeyboardInterrupt:
        pass
