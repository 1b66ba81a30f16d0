"""A fast loopback OpenAI-shaped upstream for ``bench_serve.py``: a bare asyncio protocol
(uvloop when installed), HTTP/1.1 keep-alive, one canned reply per request, so that what
the benchmark measures is the gateway and not the upstream.

* ``POST /v1/completions`` or ``/v1/chat/completions``: a canned completion (with usage);
  with ``"stream": true`` in the body, a canned SSE stream of four events and ``[DONE]``.
  A body containing ``"hold`` is never answered (the memory benchmark's queued requests).
* ``GET`` anything: ``{"status": "ok"}``.

Usage: ``python benchmarks/serve_upstream.py PORT`` (prints ``ready PORT`` when listening).
"""

from __future__ import annotations

import asyncio
import json
import sys

_REPLY = json.dumps({
    "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "text": "xxxx", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}}).encode()
_CHUNK = b'data: {"id":"cmpl-bench","object":"text_completion","created":0,"model":"m",' \
         b'"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
_USAGE = b'data: {"id":"cmpl-bench","object":"text_completion","created":0,"model":"m","choices":[],' \
         b'"usage":{"prompt_tokens":4,"completion_tokens":4,"total_tokens":8}}\n\n'
_SSE = _CHUNK * 4 + _USAGE + b"data: [DONE]\n\n"
_HEALTH = b'{"status":"ok"}'


def _response(body: bytes, ctype: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


REPLY = _response(_REPLY, b"application/json")
STREAM = _response(_SSE, b"text/event-stream")
HEALTH = _response(_HEALTH, b"application/json")


class Upstream(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            assert self.transport is not None
            if head.startswith(b"GET"):
                self.transport.write(HEALTH)
            elif b'"hold' in body:
                continue  # never answered
            elif b'"stream":true' in body.replace(b" ", b""):
                self.transport.write(STREAM)
            else:
                self.transport.write(REPLY)


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, "127.0.0.1", port, backlog=4096)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main(int(sys.argv[1])))
    except ImportError:
        asyncio.run(main(int(sys.argv[1])))
    except KeyboardInterrupt:
        pass
