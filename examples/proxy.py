"""A fair OpenAI-compatible proxy: your own users and HTTP client, sfq's order.

Each user's requests wait their org's turn (sfq.PolicyDispatcher.acquire), then go upstream
with this proxy's own aiohttp session; streams are admitted, and answered by the upstream,
before the first byte goes out (open_stream), so every refusal is still an HTTP status.
Run: python examples/proxy.py policy.yaml [--port 8080]   (docs/API.md, "Embedding sfq")
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

import sfq

# your own accounts: a user's key -> (org, class). The policy file names these orgs without
# keys, or gives them all its org_template: it never sees the users' keys.
USERS = {"key-acme": ("acme", "interactive"), "key-globex": ("globex", "interactive"),
         "key-initech": ("initech", "interactive")}
POLICY, PD = web.AppKey("policy", str), web.AppKey("pd", sfq.PolicyDispatcher)
HTTP = web.AppKey("http", aiohttp.ClientSession)


def answer(exc: sfq.SFQError) -> web.Response:
    headers = {} if exc.retry_after is None else {"Retry-After": str(sfq.errors.whole_seconds(exc.retry_after))}
    return web.json_response(exc.to_openai(), status=exc.http_status, headers=headers)


async def completions(request: web.Request) -> web.StreamResponse:
    pd, http = request.app[PD], request.app[HTTP]
    try:
        user = USERS.get(request.headers.get("Authorization", "").removeprefix("Bearer "))
        if user is None:
            raise sfq.Refused("unauthenticated", "unknown key")
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            raise sfq.errors.BadRequest(f"the body is not JSON: {exc}") from None
        pool = pd.policy.pool_of(str(body.get("model"))) if isinstance(body, dict) else None
        if pool is None:
            raise sfq.errors.BadRequest("the body must be a JSON object naming a served model")
        flow = sfq.Flow(org=user[0], cls=user[1], pool=pool.name)
        if body.get("stream"):
            async with pd.open_stream(flow, body, timeout=60) as events:  # refusals raise here
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)  # from here on the status is 200
                try:
                    async for event in events:
                        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    await resp.write(b"data: [DONE]\n\n")
                except sfq.SFQError as exc:  # after the 200: the error ends the stream as an event
                    await resp.write(b"data: " + json.dumps(exc.to_openai()).encode() + b"\n\n")
                return resp
        async with pd.acquire(flow, body, timeout=60) as grant:  # wait your turn; refusals raise here
            async with http.post(grant.url, json=body, headers=dict(grant.backend.headers)) as up:
                reply = await up.json(content_type=None)
                if up.status >= 400:  # a failure of the slot (counts toward the backend's health)
                    raise sfq.errors.BackendHTTPError(f"HTTP {up.status}", status=up.status)
            grant.finish(reply.get("usage"))  # settles the charge from what was served
        return web.json_response(reply)
    except sfq.SFQError as exc:
        return answer(exc)


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[PD].stats())


async def lifespan(app: web.Application) -> AsyncIterator[None]:
    async with sfq.PolicyDispatcher(app[POLICY]) as pd, aiohttp.ClientSession() as http:
        app[PD], app[HTTP] = pd, http
        yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args()
    app = web.Application()
    app[POLICY] = args.policy
    app.cleanup_ctx.append(lifespan)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/stats", stats)
    # a client that leaves must cancel its handler, or a queued request would still be sent
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, print=None)


if __name__ == "__main__":
    main()
