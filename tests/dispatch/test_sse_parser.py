"""The SSE parser against a reference reading of the format (line by line, as the HTML
standard's event-stream interpretation does for the fields an OpenAI stream uses), over
random streams cut into random pieces: its fast path for whole one-line events and its
general path must agree with the reference and with each other."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sfq.backends.sse import EventTooLarge, SSEParser, payload_bytes


def reference(stream: bytes) -> list[bytes]:
    """Events' data as the format defines them (LF or CRLF line ends; ``data:`` with one
    optional space; other fields and comments ignored; a blank line dispatches a non-empty
    event). The stream's unterminated tail is not an event."""
    out: list[bytes] = []
    data: list[bytes] | None = None
    lines = stream.split(b"\n")
    for line in lines[:-1]:  # the last element has no line end yet
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            if data is not None:
                out.append(b"\n".join(data))
            data = None
            continue
        if line.startswith(b"data:"):
            value = line[5:]
            if value.startswith(b" "):
                value = value[1:]
            data = (data or []) + [value]
    return out


payload = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b""))
line = st.one_of(
    payload.map(lambda p: b"data: " + p),
    payload.map(lambda p: b"data:" + p),
    payload.map(lambda p: b": " + p),
    st.sampled_from([b"event: message", b"id: 7", b"retry: 5", b"data", b"dat", b""]),
)
event = st.lists(line, min_size=1, max_size=4).flatmap(
    lambda ls: st.sampled_from([b"\n", b"\r\n"]).map(lambda end: end.join(ls) + end + end))
stream = st.lists(event, max_size=8).map(b"".join)


@settings(max_examples=400, deadline=None)
@given(stream, st.lists(st.integers(min_value=0, max_value=400), max_size=10))
def test_random_streams_in_random_pieces_read_as_the_reference_reads_them(s: bytes, cuts: list[int]):
    want = reference(s)
    whole = [payload_bytes(p) for p in SSEParser().feed(s)]
    assert whole == want
    assert [len(p) if isinstance(p, bytes) else p.size for p in SSEParser().feed(s)] == [len(x) for x in want]
    bounds = sorted({0, len(s), *(c for c in cuts if c < len(s))})
    parser = SSEParser()
    pieces = [payload_bytes(p) for a, b in zip(bounds, bounds[1:]) for p in parser.feed(s[a:b])]
    assert pieces == want and parser.pending == 0


def test_the_fast_path_keeps_the_event_size_bound():
    """A whole one-line event over ``max_event_bytes`` is refused as the general path refuses it."""
    with pytest.raises(EventTooLarge):
        SSEParser(max_event_bytes=10).feed(b"data: " + b"x" * 11 + b"\n\n")
    assert SSEParser(max_event_bytes=10).feed(b"data: " + b"x" * 10 + b"\n\n") == [b"x" * 10]


def test_events_after_a_partial_line_and_in_the_same_piece():
    p = SSEParser()
    assert p.feed(b"data: {\"a\"") == []
    assert [payload_bytes(x) for x in p.feed(b": 1}\n\ndata: 2\n\ndata: 3\n\ndata: 4")] == [b'{"a": 1}', b"2", b"3"]
    assert [payload_bytes(x) for x in p.feed(b"\n\n")] == [b"4"]
