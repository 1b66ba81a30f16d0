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
