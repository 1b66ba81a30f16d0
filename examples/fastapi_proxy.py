"""A fair OpenAI-compatible proxy on FastAPI: your own users and HTTP client, sfq's order.

Each user's requests wait their org's turn (sfq.PolicyDispatcher.acquire) while sfq.asgi
watches for the client leaving (a request nobody waits for is withdrawn, uncharged), then go
upstream with this proxy's own aiohttp session; streams are admitted, and answered by the
upstream, before the first byte goes out (open_stream), so every refusal is still an HTTP status.
Run it from the clone (``pip install '.[asgi]'`` brings FastAPI and uvicorn) beside the demo
engine (``sfq demo-backend``), under its own policy, examples/fastapi_policy.yaml:
python examples/fastapi_proxy.py [POLICY] [--port 8080]   (docs/library.md, "In a Starlette or
FastAPI app"; the same proxy on aiohttp: examples/proxy.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import sfq
from sfq import asgi as sfq_asgi

# your own accounts: a user's key -> (org, class). The policy file names these orgs without
# keys, or gives them all its org_template: it never sees the users' keys.
USERS = {"key-acme": ("acme", "interactive"), "key-globex": ("globex", "interactive"),
         "key-initech": ("initech", "interactive")}
#: upstream statuses that are the proxy's problem, not the client's (its key, its rate)
NOT_THE_CLIENTS = {401, 403, 407, 429}


def _seconds(value: str | None) -> float | None:
    try:
        return None if value is None else max(0.0, float(value))
    except ValueError:
        return None


def _object(text: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


async def forward(http: aiohttp.ClientSession, grant: sfq.Grant, body: dict[str, Any]) -> Response:
    """One plain request on its turn, with this proxy's own client; the grant is told how it went."""
    try:
        async with http.post(grant.url, json=body, headers=dict(grant.backend.headers)) as up:
            status, text, retry_after = up.status, await up.text(), _seconds(up.headers.get("Retry-After"))
    except (aiohttp.ClientError, asyncio.TimeoutError):
        grant.fail()  # the upstream could not be reached (counts toward its health)
        return sfq_asgi.error_response(sfq.errors.BackendUnavailable("the upstream could not be reached"))
    reply = _object(text)
    if status < 400 and reply is not None:
        grant.finish(reply.get("usage"))  # settles the charge from what was served
        return JSONResponse(reply)
    if 400 <= status < 500 and status not in NOT_THE_CLIENTS:  # the client's to fix: the upstream's words
        error = reply.get("error") if reply is not None else None
        error = error if isinstance(error, dict) else {"message": f"the upstream answered HTTP {status}"}
        return JSONResponse({"error": {"message": error.get("message"),
                                       "type": error.get("type") or "invalid_request_error",
                                       "param": error.get("param"), "code": error.get("code")}},
                            status_code=status)
    grant.fail(status=status, retry_after=retry_after)  # 5xx, 429, its key refused: the upstream's failure
    kind = sfq.errors.BackendRateLimited if status == 429 else sfq.errors.BackendHTTPError
    return sfq_asgi.error_response(kind(f"HTTP {status}", status=status, retry_after=retry_after))  # 502; 503


def create_app(policy: str) -> FastAPI:
    pd: sfq.PolicyDispatcher
    http: aiohttp.ClientSession

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal pd, http
        async with sfq.PolicyDispatcher(policy) as pd, aiohttp.ClientSession() as http:
            yield

    app = FastAPI(lifespan=lifespan)
    app.add_exception_handler(sfq.SFQError, sfq_asgi.error_response_handler)  # every refusal: its status

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> Response:
        user = USERS.get(request.headers.get("Authorization", "").removeprefix("Bearer "))
        if user is None:
            raise sfq.Refused("unauthenticated", "unknown key")
        try:
            body = await request.json()
        except ValueError as exc:
            raise sfq.errors.BadRequest(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise sfq.errors.BadRequest("the body must be a JSON object with a 'model'", param="model")
        pool = pd.policy.pool_of(body["model"])
        if pool is None:
            raise sfq.errors.UnknownModel(f"the model {body['model']!r} is not served here")
        flow = sfq.Flow(org=user[0], cls=user[1], pool=pool.name)
        if body.get("stream"):  # the wait, the upstream's first event: refusals raise here
            events = await sfq_asgi.enter(request, pd.open_stream(flow, body, timeout=60))
            return sfq_asgi.EventStreamResponse(events)  # closed when done or when the client leaves
        async with sfq_asgi.enter(request, pd.acquire(flow, body, timeout=60)) as grant:  # its turn
            return await forward(http, grant, body)

    @app.get("/stats")
    async def stats() -> Response:
        return Response(json.dumps(pd.stats()), media_type="application/json")

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("policy", nargs="?", default=str(Path(__file__).with_name("fastapi_policy.yaml")),
                    help="the policy file (default: examples/fastapi_policy.yaml, in front of sfq demo-backend)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args()
    uvicorn.run(create_app(args.policy), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
