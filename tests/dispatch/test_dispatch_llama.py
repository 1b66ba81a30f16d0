"""Integration: the Dispatcher and OpenAIBackend in front of a real llama.cpp ``llama-server``
on loopback (a tiny synthetic model, see ``tinymodel.py``).

The tiny model always generates ``max_tokens`` copies of one character, so every reply's
``usage.completion_tokens`` equals the request's ``max_tokens`` and the cost estimator's
output ratio must calibrate to exactly 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from dispatch_helpers import LLAMA_MODEL_NAME, LLAMA_SLOTS, LlamaServer, needs_llama, start_llama
from tinymodel import OUTPUT_CHAR

from sfq.backends import OpenAIBackend, SaturationProbe
from sfq.cost import CostEstimator
from sfq.dispatch import Dispatcher, DispatchRecord

pytestmark = [pytest.mark.integration, needs_llama]

M = LLAMA_MODEL_NAME


def completion(max_tokens: int, prompt: str = "hello world", **kw: Any) -> dict[str, Any]:
    return {"model": M, "prompt": prompt, "max_tokens": max_tokens, **kw}


async def wait_for(cond, what: str, limit: float = 20.0, step: float = 0.02) -> None:
    """Poll ``cond``; fail naming ``what`` after ``limit`` s (a safety net, not a timing check)."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(step)


async def test_plain_completion_reports_usage(llama: LlamaServer):
    async with Dispatcher([OpenAIBackend(llama.url, model=M, max_in_flight=LLAMA_SLOTS)]) as d:
        r = await d.submit("f", completion(16))
    assert r["usage"]["completion_tokens"] == 16
    assert r["usage"]["prompt_tokens"] > 0
    assert r["choices"][0]["text"].strip() == OUTPUT_CHAR * 16


async def test_a_fleet_of_two_servers(llama: LlamaServer, tiny_gguf, tmp_path):
    """The README's shape: a Dispatcher in front of a list of OpenAI-compatible servers.
    Least-loaded placement spreads a burst over both; every reply comes back."""
    second = start_llama(tiny_gguf, tmp_path / "second.log")
    try:
        fleet = [OpenAIBackend(url, model=M, max_in_flight=LLAMA_SLOTS) for url in (llama.url, second.url)]
        async with Dispatcher(fleet, estimator=CostEstimator(input_weight=1.0, output_weight=2.0)) as d:
            replies = await asyncio.gather(
                *(d.submit(f"team-{i % 2}", completion(24)) for i in range(8)),
                *(_collect(d.stream("team-c", {"model": M, "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 6, "stream": True})) for _ in range(2)))
            st = d.stats()
        assert [r["usage"]["completion_tokens"] for r in replies[:8]] == [24] * 8
        assert all("".join(replies[8 + i]).strip() == OUTPUT_CHAR * 6 for i in range(2))
        served = [st["backends"][b.name]["completed"] for b in fleet]
        assert sum(served) == 10 and min(served) >= LLAMA_SLOTS, served  # the first burst fills both
        assert {f: st["flows"][f]["completed"] for f in ("team-0", "team-1", "team-c")} == \
            {"team-0": 4, "team-1": 4, "team-c": 2}
    finally:
        second.stop()


async def _collect(events) -> list[str]:
    return [(c.get("delta") or {}).get("content") or "" async for e in events for c in e.get("choices", [])]


async def test_chat_completion(llama: LlamaServer):
    async with Dispatcher([OpenAIBackend(llama.url, model=M)]) as d:
        r = await d.submit("f", {"model": M, "messages": [{"role": "user", "content": "hi there"}],
                                 "max_tokens": 12})
    assert r["usage"]["completion_tokens"] == 12
    assert r["choices"][0]["message"]["content"].strip() == OUTPUT_CHAR * 12


async def test_streaming_completion_and_chat(llama: LlamaServer):
    est = CostEstimator(prior_ratio=0.25)
    async with Dispatcher([OpenAIBackend(llama.url, model=M)], estimator=est) as d:
        events = [e async for e in d.stream("f", completion(10, stream=True))]
        text = "".join(c.get("text") or "" for e in events for c in e.get("choices", []))
        assert text.strip() == OUTPUT_CHAR * 10
        assert all(e.get("choices") for e in events)  # the usage-only chunk was not asked for: hidden
        body = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}}
        events = [e async for e in d.stream("f", body)]
        text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices", []))
        assert text.strip() == OUTPUT_CHAR * 8
        assert events[-1]["usage"]["completion_tokens"] == 8
    assert est.observed == 2 and est.ratio(M) == 1.0  # usage came back on both streams


async def test_estimator_calibrates_from_real_usage(llama: LlamaServer, tmp_path):
    est = CostEstimator(input_weight=1.0, output_weight=1.0, prior_ratio=0.5, chars_per_token=10.0,
                        min_flow_samples=2)
    prompt = "the quick brown fox"
    body = completion(20, prompt=prompt)
    before = est.estimate(body, "f")
    assert before.expected_output == 10 and before.prompt_tokens == len(prompt) / 10
    async with Dispatcher([OpenAIBackend(llama.url, model=M, max_in_flight=LLAMA_SLOTS)], estimator=est) as d:
        replies = await asyncio.gather(*(d.submit("f", body) for _ in range(3)))
    prompt_tokens = replies[0]["usage"]["prompt_tokens"]
    assert est.ratio(M) == 1.0 and est.ratio(M, "f") == 1.0
    # the server's real ratio pulls the (deliberately wrong) prior its way, each report within
    # bounds: exactly what replaying the reports gives, most of the way there after three
    truth = len(prompt) / prompt_tokens
    replay = CostEstimator(input_weight=1.0, output_weight=1.0, prior_ratio=0.5, chars_per_token=10.0,
                           min_flow_samples=2)
    for r in replies:
        replay.observe(replay.estimate(body, "f"), r["usage"], "f")
    cpt = est.chars_per_token_of(M)
    assert cpt == pytest.approx(replay.chars_per_token_of(M))
    assert abs(cpt - truth) < abs(10.0 - truth) / 2
    after = est.estimate(body, "f")
    assert after.expected_output == 20
    assert after.prompt_tokens == pytest.approx(len(prompt) / cpt)
    assert after.cost == pytest.approx(len(prompt) / cpt + 20)
    est.save(tmp_path / "cal.json")
    again = CostEstimator(prior_ratio=0.5, chars_per_token=10.0, min_flow_samples=2)
    again.load(tmp_path / "cal.json")
    assert again.estimate(body, "f").cost == pytest.approx(after.cost)


async def test_saturation_probe_reads_real_metrics(llama: LlamaServer):
    """More requests than slots: the probe sees them processing and deferred in /metrics."""
    probe = SaturationProbe(interval=0.05)
    backend = OpenAIBackend(llama.url, model=M)
    async with backend:
        reading = probe.read(await backend.fetch_metrics())
        assert reading.running == 0 and reading.waiting == 0 and not reading.saturated
        async def drain() -> None:  # streamed, so that cancelling stops the server (see below)
            async for _ in backend.stream("completions", completion(1500)):
                pass

        tasks = [asyncio.create_task(drain()) for _ in range(3)]
        try:
            async def saturated() -> bool:
                nonlocal reading
                reading = probe.read(await backend.fetch_metrics())
                return reading.running == LLAMA_SLOTS and reading.waiting >= 1

            deadline = time.monotonic() + 20
            while not await saturated():
                assert time.monotonic() < deadline, f"never saw the slots full: {reading}"
                await asyncio.sleep(0.02)
            assert reading.saturated and "waiting in the server" in reading.reason
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        deadline = time.monotonic() + 20
        while (r := probe.read(await backend.fetch_metrics())).running or r.waiting:
            assert time.monotonic() < deadline, f"the server kept working after the aborts: {r}"
            await asyncio.sleep(0.05)


async def test_probe_keeps_the_queue_in_sfq(llama: LlamaServer):
    """max_in_flight is generous (8 for 2 slots); the probe sees requests deferred inside
    llama-server and holds dispatch, so requests wait in sfq while fewer than 8 are in flight
    (without a probe the dispatcher refills to 8 at once on every completion).

    The first 8 go out before any reading can show them (max_in_flight bounds that burst);
    requests are long enough (250 tokens) for the probe to see the deferred ones before the
    first completion. (llama-server serves HTTP from np + 4 = 6 fixed threads and a kept-alive
    connection holds one: a probe sharing the request pool's connections could wait seconds
    for a new one here; OpenAIBackend gives the probe its own connection.)"""
    backend = OpenAIBackend(llama.url, model=M, max_in_flight=8, probe=SaturationProbe(interval=0.02))
    held = 0
    async with Dispatcher([backend]) as d:
        await wait_for(lambda: d.stats()["backends"][llama.url]["probe"] is not None, "the first reading")
        tasks = [asyncio.create_task(d.submit(f"f{i % 3}", completion(250))) for i in range(12)]
        while not all(t.done() for t in tasks):
            s = d.stats()
            b = s["backends"][llama.url]
            if s["pools"][M]["waiting"] > 0 and b["in_flight"] < 8:
                held += 1
                assert b["saturated"], "waiting with room while the server was not saturated"
            await asyncio.sleep(0.01)
        replies = await asyncio.gather(*tasks)
    assert all(r["usage"]["completion_tokens"] == 250 for r in replies)
    assert held > 0, "the probe never held a request in sfq"


async def test_cancel_after_dispatch_stops_the_server(llama: LlamaServer):
    """Aborting a dispatched (streamed) request closes the connection and llama-server stops
    generating: far fewer decode steps run than the request's max_tokens.

    Only streams: this llama-server build notices a client that went away only while it
    streams; a non-streamed request runs to its end after the disconnect (measured: 1800 of
    1800 tokens generated after closing the socket 1 s in). The dispatcher's side of a plain
    abort (connection closed, slot freed, charge kept) is tested against the fault server.
    """
    n = 1800
    backend = OpenAIBackend(llama.url, model=M)
    async with Dispatcher([backend]) as d:
        await wait_for(lambda: llama.metrics()["llamacpp:requests_processing"] == 0, "an idle server")
        decodes = llama.metrics()["llamacpp:n_decode_total"]

        async def consume() -> int:
            got = 0
            async with contextlib.aclosing(d.stream("f", completion(n, stream=True))) as it:
                async for _ in it:
                    got += 1
            return got

        t = asyncio.create_task(consume())
        await wait_for(lambda: llama.metrics()["llamacpp:n_decode_total"] > decodes + 5, "generation to start")
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await wait_for(lambda: llama.metrics()["llamacpp:requests_processing"] == 0, "the server to stop")
        ran = llama.metrics()["llamacpp:n_decode_total"] - decodes
        assert ran < n / 2, f"llama-server ran {ran} decode steps of {n} after the abort"
        st = d.stats()
        assert st["flows"]["f"]["aborted"] == 1 and st["backends"][llama.url]["healthy"]


async def _flood_and_chat(llama: LlamaServer, fifo: bool = False) -> tuple[list[DispatchRecord], int, dict[str, Any]]:
    """``bulk`` floods 24 long requests, then ``chat`` sends 60 short ones; 2 slots. ``fifo``:
    the baseline, both tenants' requests in one flow (one queue, first come first served);
    the records then name the tenant by the request's size."""
    records: list[DispatchRecord] = []
    est = CostEstimator(prior_ratio=1.0, chars_per_token=1.0)  # cost ~ prompt chars + max_tokens
    backend = OpenAIBackend(llama.url, model=M, max_in_flight=LLAMA_SLOTS)
    tenant = {"bulk": "all" if fifo else "bulk", "chat": "all" if fifo else "chat"}
    async with Dispatcher([backend], estimator=est, on_dispatch=records.append) as d:
        bulk = [asyncio.create_task(d.submit(tenant["bulk"], completion(48, prompt="write a long story")))
                for _ in range(24)]
        await wait_for(lambda: len(records) >= LLAMA_SLOTS, "the flood to start")
        arrival = len(records)  # dispatches before the chat flow arrived
        chat = [asyncio.create_task(d.submit(tenant["chat"], completion(4, prompt="hi"))) for _ in range(60)]
        replies = await asyncio.wait_for(asyncio.gather(*bulk, *chat), 120)
        stats = d.stats()
    assert all(r["usage"]["completion_tokens"] in (48, 4) for r in replies)
    return records, arrival, stats


async def test_fairness_flood_versus_short_requests(llama: LlamaServer):
    """Two flows, one flooding long requests, one sending short ones, through one llama-server:

    * the short flow's requests start within a bounded wait: from its arrival on, at most one
      long request is dispatched between two short ones (under FIFO: the whole flood first);
    * while both flows are backlogged, charged cost is split evenly: |W_bulk - W_chat| <= 2 c_max
      (Goyal, Vin and Cheng, 1996), and the long flow gets no more than that ahead.
    """
    records, arrival, stats = await _flood_and_chat(llama)
    after = records[arrival:]
    # bounded wait, in dispatches: runs of bulk dispatches between chat dispatches
    runs, run = [], 0
    left = {"bulk": sum(r.flow == "bulk" for r in after), "chat": 60}
    for r in after:
        if left["chat"] == 0:
            break
        if r.flow == "bulk":
            run += 1
        else:
            runs.append(run)
            run = 0
        left[r.flow] -= 1
    assert runs and max(runs) <= 1, f"bulk dispatches between chat dispatches: {runs}"
    # even split of charged cost while both are backlogged
    c_max = max(r.cost for r in records)
    charged = {"bulk": 0.0, "chat": 0.0}
    left = {"bulk": 24 - arrival, "chat": 60}
    worst = 0.0
    for r in after:
        if left["bulk"] == 0 or left["chat"] == 0:
            break
        charged[r.flow] += r.cost
        left[r.flow] -= 1
        worst = max(worst, abs(charged["bulk"] - charged["chat"]))
    assert worst <= 2 * c_max, f"charged {charged}, worst gap {worst} > 2 c_max = {2 * c_max}"
    assert charged["bulk"] > 0 and charged["chat"] > 0
    assert stats["flows"]["bulk"]["completed"] == 24 and stats["flows"]["chat"]["completed"] == 60

    # the same workload under FIFO: the short flow waits behind the whole flood
    fifo, f_arrival, f_stats = await _flood_and_chat(llama, fifo=True)
    first_chat = next(i for i, r in enumerate(fifo) if r.cost < 30)  # a short request: chat's
    assert first_chat == 24, "under FIFO the chat flow starts only after the flood"
    first = next(r for r in records if r.flow == "chat")
    fifo_chat = sorted(r.wait for r in fifo if r.cost < 30)
    print(f"\nfirst chat request waited {first.wait:.3f} s under sfq, {fifo[first_chat].wait:.3f} s under fifo; "
          f"chat wait p50/p95 (s): sfq {stats['flows']['chat']['wait_p50']:.3f}/"
          f"{stats['flows']['chat']['wait_p95']:.3f}, fifo {fifo_chat[len(fifo_chat) // 2]:.3f}/"
          f"{fifo_chat[int(len(fifo_chat) * 0.95)]:.3f}")
