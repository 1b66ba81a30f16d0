"""OpenAIBackend reads replies and stream events with orjson where it can, and must read
exactly what ``json.loads`` reads: the same values (integers past 64 bits exact, NaN and
Infinity, UTF-16 and a BOM accepted) and the same failures."""

from __future__ import annotations

import json
import random

import pytest

from sfq.backends.openai import _loads

ODD = [b'{"a":NaN}', b'{"a":-Infinity}', '{"a":1}'.encode("utf-16"), b'\xef\xbb\xbf{"a":1}',
       b'{"a":-9223372036854775809}', b'{"a":-9223372036854775808}', b'{"a":18446744073709551615}',
       b'{"a":18446744073709551616}', b'{"a":123456789012345678901234567890}', b'{"a":1,"a":2}',
       b'{"a":"\\ud800"}', b'{"b":1e400}', b'{"t":"12345678901234567890123"}', b'"x"', b"", b"nul", b"[1,2",
       b'{"a":0.1234567890123456789012}', b'{"choices":[{"delta":{"content":"h\\u00e9"}}],"created":1700000000}']


def _same(doc: bytes) -> None:
    try:
        want: object = repr(json.loads(doc))
    except ValueError:
        want = ValueError
    try:
        got: object = repr(_loads(doc))
    except ValueError:
        got = ValueError
    assert got == want, doc


@pytest.mark.parametrize("doc", ODD)
def test_odd_documents_read_as_json_reads_them(doc: bytes) -> None:
    _same(doc)


def test_numbers_of_every_length_read_as_json_reads_them() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.choice([1, 10, 17, 18, 19, 20, 21, 30])
        num = rng.choice(["", "-"]) + str(rng.randint(10 ** (n - 1), 10 ** n - 1))
        if rng.random() < 0.3:
            num += rng.choice([".5", "e3", "E-2", ".0e+1"])
        _same(f'{{"x":[{num}, {{"y": "{num}"}}]}}'.encode())


# ---------------------------------------------------------------- a client's body, forwarded as it came
def test_a_json_body_asks_for_usage_without_reencoding() -> None:
    import orjson

    from sfq.backends.base import JSONBody

    raw = b' {"model":"m", "stream":true,"prompt":"h\\u00e9 \xc3\xa9"}'
    b = JSONBody(orjson.loads(raw), raw)
    s = b.streamed_with_usage()
    assert s.raw is not None and s.raw.endswith(raw.lstrip()[1:])  # the client's bytes, one key before them
    assert orjson.loads(s.raw) == dict(s) == {**orjson.loads(raw), "stream_options": {"include_usage": True}}
    asked = JSONBody({"model": "m", "stream": True, "stream_options": {"include_usage": True}}, b"x")
    assert asked.streamed_with_usage() is asked  # nothing to change: the same bytes
    for other in ({"model": "m", "stream": True, "stream_options": {"include_usage": False}},
                  {"model": "m", "stream": True, "stream_options": None}, {"model": "m"}):
        s = JSONBody(other, orjson.dumps(other)).streamed_with_usage()
        assert s.raw is None and s["stream"] is True and s["stream_options"]["include_usage"] is True


async def test_the_backend_sends_a_json_body_s_own_bytes() -> None:
    from aiohttp import web

    from sfq.backends import OpenAIBackend
    from sfq.backends.base import JSONBody

    seen: list[bytes] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}})

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    b = OpenAIBackend(f"http://127.0.0.1:{port}")
    try:
        raw = b'{ "model": "m",  "prompt": "x", "max_tokens": 1 }'
        await b.complete("completions", JSONBody(json.loads(raw), raw))
        await b.complete("completions", {"model": "m", "prompt": "x", "max_tokens": 1})
        assert seen[0] == raw  # as it came, spaces and all
        assert json.loads(seen[1]) == {"model": "m", "prompt": "x", "max_tokens": 1}
    finally:
        await b.close()
        await runner.cleanup()
