"""The embedder's primitives on the library's Dispatcher, as on PolicyDispatcher: ``acquire`` (wait
your turn, learn where to send, report what was delivered) and ``open_stream`` (admitted and
answered by the backend before it returns), with a deadline; against a real loopback server."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from dispatch_helpers import FakeServer, settle

import sfq
from sfq.backends import OpenAIBackend
from sfq.dispatch import Dispatcher
from sfq.errors import BackendHTTPError, BadRequest, Refused

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


async def test_acquire_grants_a_backend_and_settles_from_the_usage(fake: FakeServer) -> None:
    async with Dispatcher([OpenAIBackend(fake.url, max_in_flight=1)]) as d:
        async with d.acquire("a", BODY, timeout=30) as grant:
            assert isinstance(grant, sfq.Grant)
            assert grant.url == f"{fake.url}/v1/completions" and grant.backend.url == fake.url
            async with aiohttp.ClientSession() as http:
                async with http.post(grant.url, json=BODY, headers=dict(grant.backend.headers)) as resp:
                    reply = await resp.json()
            grant.finish(reply["usage"])
        s = d.stats()
        assert s["flows"]["a"]["completed"] == 1 and s["backends"][fake.url]["in_flight"] == 0
        assert len(fake.requests) == 1  # the embedder's own call: the dispatcher sent nothing


async def test_an_exception_inside_acquire_is_a_failure_that_frees_the_slot(fake: FakeServer) -> None:
    async with Dispatcher([OpenAIBackend(fake.url, max_in_flight=1)]) as d:
        with pytest.raises(RuntimeError, match="my client broke"):
            async with d.acquire("a", BODY):
                raise RuntimeError("my client broke")
        s = d.stats()
        assert s["flows"]["a"]["failed"] == 1 and s["backends"][fake.url]["in_flight"] == 0
        async with d.acquire("a", BODY) as grant:  # the slot is free again
            grant.finish({"prompt_tokens": 2, "completion_tokens": 4})


async def test_a_refused_finish_leaves_the_grant_open_and_its_slot_held_only_until_the_block_ends(
        fake: FakeServer) -> None:
    """Bad input to ``finish`` raises and changes nothing: the grant stays open (it used to be
    marked ended while its request still ran, so its slot stayed taken until close())."""
    async with Dispatcher([OpenAIBackend(fake.url, max_in_flight=1)]) as d:
        async with d.acquire("a", BODY) as grant:
            for bad in ("3", True, -1):
                with pytest.raises(ValueError, match="output_text_chars must be an integer >= 0"):
                    grant.finish(None, output_text_chars=bad)
            assert d.stats()["flows"]["a"]["in_flight"] == 1
            grant.finish(None, output_text_chars=12)  # still open: this one ends it
        s = d.stats()
        assert s["flows"]["a"]["completed"] == 1 and s["backends"][fake.url]["in_flight"] == 0
        async with d.acquire("a", BODY, timeout=5) as grant:  # the one slot is free again
            pass
        assert d.stats()["flows"]["a"]["completed"] == 2
        assert d.monitor_of(fake.url).completed == 2  # the refused calls counted no reply


async def test_acquire_waits_its_turn_and_its_deadline_refuses_it(fake: FakeServer) -> None:
    async with Dispatcher([OpenAIBackend(fake.url, max_in_flight=1)]) as d:
        async with d.acquire("a", BODY) as held:
            with pytest.raises(Refused) as info:
                async with d.acquire("b", BODY, timeout=0.2):
                    pytest.fail("granted while the only slot was held")
            assert info.value.reason == "deadline" and info.value.http_status == 504
            held.finish(None)
        assert d.stats()["flows"]["b"]["expired"] == 1 and fake.requests == []


async def test_acquire_cancelled_while_waiting_is_uncharged(fake: FakeServer) -> None:
    async with Dispatcher([OpenAIBackend(fake.url, max_in_flight=1)]) as d:
        async with d.acquire("a", BODY) as held:
            async def wait_turn() -> None:
                async with d.acquire("b", BODY):
                    pytest.fail("granted while the only slot was held")
            t = asyncio.create_task(wait_turn())
            await settle()
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            held.finish(None)
        row = d.stats()["flows"]["b"]
        assert row["cancelled"] == 1 and row["charged_cost"] == 0.0


async def test_open_stream_refuses_a_bad_body_before_anything_is_sent(fake: FakeServer) -> None:
    async with Dispatcher([OpenAIBackend(fake.url)]) as d:
        with pytest.raises(BadRequest):
            async with d.open_stream("a", {**BODY, "stream": True, "max_tokens": "abc"}):
                pytest.fail("opened a stream for a bad body")
        assert fake.requests == []


async def test_open_stream_raises_the_backends_status_at_entry(fake: FakeServer) -> None:
    fake.mode = "400"
    async with Dispatcher([OpenAIBackend(fake.url)]) as d:
        with pytest.raises(BackendHTTPError) as info:
            async with d.open_stream("a", {**BODY, "stream": True}):
                pytest.fail("opened a stream the backend refused")
        assert info.value.status == 400


async def test_open_stream_yields_the_events_once_entered(fake: FakeServer) -> None:
    async with Dispatcher([OpenAIBackend(fake.url)]) as d:
        async with d.open_stream("a", {**BODY, "stream": True}) as events:
            assert isinstance(events, sfq.EventStream)
            assert len(fake.requests) == 1  # entered: the backend has answered
            got = [ev async for ev in events]
        assert got and d.stats()["flows"]["a"]["completed"] == 1


async def test_a_queued_open_stream_whose_caller_leaves_never_reaches_the_backend(fake: FakeServer) -> None:
    async with Dispatcher([OpenAIBackend(fake.url, max_in_flight=1)]) as d:
        async with d.acquire("a", BODY) as held:
            async def open_it() -> None:
                async with d.open_stream("b", {**BODY, "stream": True}):
                    pytest.fail("opened while the only slot was held")
            t = asyncio.create_task(open_it())
            await settle()
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            held.finish(None)
        await settle()
        assert fake.requests == [] and d.stats()["flows"]["b"]["cancelled"] == 1
