"""The request engine charges what was delivered: the charge modes, settlement from usage (clamped),
the busy period held with the flow, look before pop with the driver's ``fits``, backend events,
retries on another backend. Every rule on an injected clock, on both twins (``core``)."""

from __future__ import annotations

import pytest
from policy_helpers import Clock, policy

from sfq.cost import CostEstimator
from sfq.engine import RUNNING, PolicyEngine
from sfq.errors import BackendHTTPError, NoHealthyBackend
from sfq.policy import Flow, Policy

A, B = Flow("a", "batch", "p"), Flow("b", "batch", "p")
ORGS = """
  a: {keys: [ka], classes: [batch]}
  b: {keys: [kb], classes: [batch]}
"""
TWO_BACKENDS = """
  p:
    models: [m]
    backends:
      - {url: "http://127.0.0.1:9", max_in_flight: 1, name: one}
      - {url: "http://127.0.0.1:10", max_in_flight: 1, name: two}
"""


def make(charge: str, clock: Clock, core, pools: str = "", slots: int = 1) -> PolicyEngine:
    pools = pools or f"""
      p:
        models: [m]
        backends: [{{url: "http://127.0.0.1:9", max_in_flight: {slots}}}]
    """
    pol: Policy = policy(pools=pools, orgs=ORGS, extra=f"cost: {{input_weight: 1, output_weight: 2, charge: {charge}}}\n")
    return PolicyEngine(pol, clock=clock, scheduler=core,
                        estimator=CostEstimator(1.0, 2.0, prior_ratio=1.0, min_flow_samples=10**6))


def body(max_tokens: int, prompt: str = "x" * 40) -> dict[str, object]:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens}


def submit(e: PolicyEngine, flow: Flow, max_tokens: int, *, streaming: bool = False):
    return e.submit(flow, estimate=e.estimator.estimate(body(max_tokens), flow), streaming=streaming)


def test_served_stream_charges_prompt_then_tokens_then_settles(clock: Clock, core) -> None:
    e = make("served", clock, core)
    r = submit(e, A, 100, streaming=True)
    submit(e, B, 100)  # b waits: the busy period stays open (an idle system starts level anyway)
    assert e.poll() == [r]
    q = e.queues["p"]
    start = q.meter(A) - r.charged  # the meter before the dispatch
    assert r.charged == pytest.approx(10.0)  # the prompt only: 40 chars / 4 per token
    assert e.delivered(r, 5) == 5
    assert q.meter(A) - start == pytest.approx(10.0 + 2 * 5)
    assert e.event_tokens(r, {"choices": [{"delta": {"content": "abcdefgh"}}]}) == pytest.approx(2.0)
    assert e.event_tokens(r, {"usage": {"completion_tokens": 9}}) == pytest.approx(4.0)  # a running count
    e.delivered(r, 4)
    e.complete(r, {"prompt_tokens": 12, "completion_tokens": 9})
    assert q.meter(A) - start == pytest.approx(12 + 2 * 9)  # reconciled with the usage


@pytest.mark.parametrize("charge", ["served", "settle"])
def test_over_declared_max_tokens_costs_nothing_once_finished(charge: str, clock: Clock, core) -> None:
    e = make(charge, clock, core)
    r = submit(e, A, 2000)
    submit(e, B, 10)
    e.poll()
    q = e.queues["p"]
    before = q.meter(A) - r.charged
    assert r.charged == pytest.approx(10 + 2 * 2000)  # estimated at the cap (prior ratio 1)
    e.complete(r, {"prompt_tokens": 10, "completion_tokens": 50})
    assert q.meter(A) - before == pytest.approx(10 + 2 * 50)


def test_seed_is_never_corrected(clock: Clock, core) -> None:
    e = make("seed", clock, core)
    r = submit(e, A, 2000, streaming=True)
    submit(e, B, 10)
    e.poll()
    q = e.queues["p"]
    m = q.meter(A)
    e.delivered(r, 10)
    e.complete(r, {"prompt_tokens": 10, "completion_tokens": 50})
    assert q.meter(A) == m and r.charged == pytest.approx(10 + 2 * 2000)


def test_absurd_usage_is_clamped_before_it_touches_a_meter_or_bucket(clock: Clock, core) -> None:
    pools = """
      p:
        models: [m]
        backends: [{url: "http://127.0.0.1:9", max_in_flight: 1}]
        limits: {tokens_per_minute: 100000}
    """
    e = make("settle", clock, core, pools=pools)
    r = submit(e, A, 100)
    submit(e, B, 10)
    e.poll()
    q = e.queues["p"]
    before = q.meter(A) - r.charged
    e.complete(r, {"prompt_tokens": 10**30, "completion_tokens": 10**30})
    # at most the cap of output and 4x the prompt (+64): what the request could have cost
    assert q.meter(A) - before == pytest.approx((10 * 4 + 64) + 2 * 100)
    assert q.tpm is not None and q.tpm.available(clock()) > 100000 - 1000


def test_estimate_at_dispatch_uses_the_calibration_of_then(clock: Clock, core) -> None:
    e = make("seed", clock, core)
    first = submit(e, A, 100)
    waiting = submit(e, B, 100)  # estimated at the cap on arrival
    e.poll()
    e.complete(first, {"prompt_tokens": 10, "completion_tokens": 10})  # the model answers 10 of 100
    [r] = e.poll()
    assert r is waiting and r.charged < 10 + 2 * 100 - 1  # re-estimated with the ratio learned meanwhile


@pytest.mark.parametrize("charge", ["seed", "served"])
def test_a_start_waiting_for_a_shared_grant_is_priced_at_the_grant(charge: str, clock: Clock, core) -> None:
    """With a shared state (several gateways) the engine starts a request as it hands it on,
    and the grant, its dispatch over the fleet, may come seconds later: ``reprice`` prices it
    with the calibration of then, as ``poll`` does at dispatch, and moves the local meter and
    the request's charge with it (the grant charges that price; docs/design.md 5a)."""
    e = make(charge, clock, core, slots=2)
    q = e.queues["p"]
    first = submit(e, A, 100)
    handed = submit(e, B, 100)
    assert e.poll() == [first, handed]  # both handed on at the cap: nothing calibrated yet
    assert handed.charged == pytest.approx(10 + 2 * 100)
    before = q.meter(B)
    assert q.reprice(handed) == pytest.approx(10 + 2 * 100)  # nothing learned since: the same price
    assert q.meter(B) == before
    e.complete(first, {"prompt_tokens": 10, "completion_tokens": 10})  # the model answers 10 of 100
    price = q.reprice(handed)
    assert price == handed.cost == pytest.approx(handed.charged) == pytest.approx(10 + 2 * 10)
    assert q.meter(B) - before == pytest.approx(price - (10 + 2 * 100))


def test_flow_keeps_its_lag_while_its_work_runs(clock: Clock, core) -> None:
    """Delivered-service modes report work as the flow's: a closed-loop client whose request
    still runs keeps its meter when its next request arrives, instead of being lifted to v."""
    e = make("served", clock, core, slots=2)
    q = e.queues["p"]
    ra = submit(e, A, 10)
    e.poll()
    for _ in range(3):
        submit(e, B, 100)
    e.poll()  # one of b's starts: v moves with b's dispatches
    assert q.sched.running(A) == 1
    e.complete(ra, {"prompt_tokens": 10, "completion_tokens": 10})
    assert q.sched.running(A) == 0


def test_nothing_is_charged_while_the_fleet_cannot_place_it(clock: Clock, core) -> None:
    e = make("seed", clock, core)
    r = submit(e, A, 100)
    q = e.queues["p"]
    m = q.meter(A)
    assert e.poll(fits=lambda req, backend: False) == []
    assert r.state != RUNNING and q.meter(A) == m  # looked at, not popped: uncharged
    assert e.poll(fits=lambda req, backend: True) == [r]
    assert q.meter(A) > m


def test_last_backend_down_refuses_at_once_and_ends_the_waiting(clock: Clock, core) -> None:
    e = make("served", clock, core)
    running = submit(e, A, 10)
    waiting = submit(e, B, 10)
    e.poll()
    e.backend_down("p", "http://127.0.0.1:9", "connection refused")
    assert not e.pool_available("p")
    with pytest.raises(NoHealthyBackend) as info:
        submit(e, A, 10)
    assert info.value.retry_after == e.unavailable_retry_after
    e.poll()
    assert waiting.outcome == "refused" and waiting.reason == "unavailable"
    assert running.state == RUNNING  # what runs is left to finish
    e.backend_up("p", "http://127.0.0.1:9")
    assert e.pool_available("p") and submit(e, A, 10).state != RUNNING


def test_retry_after_pauses_are_capped(clock: Clock, core) -> None:
    e = make("served", clock, core)
    assert e.backend_paused("p", "http://127.0.0.1:9", 3600) == e.max_pause == 60.0
    r = submit(e, A, 10)
    assert e.poll() == []
    clock.advance(60.0)
    assert e.poll() == [r]
    d = e.fail(r, BackendHTTPError("slow down", status=429, retry_after=3600.0))
    assert d.retry and d.delay <= 60.0


def test_a_retry_prefers_another_backend(clock: Clock, core) -> None:
    e = make("served", clock, core, pools=TWO_BACKENDS)
    r = submit(e, A, 10)
    [first] = e.poll()
    failed_on = first.backend
    d = e.fail(first, BackendHTTPError("boom", status=500))
    assert d.retry and d.avoid == failed_on
    clock.advance(d.delay)
    e.requeue(r)
    [again] = e.poll()
    assert again is r and r.backend != failed_on


def test_bad_delivered_counts_change_nothing(clock: Clock, core) -> None:
    e = make("served", clock, core)
    r = submit(e, A, 10, streaming=True)
    e.poll()
    m = e.queues["p"].meter(A)
    for bad in (-1, float("nan"), float("inf"), "3", True):
        with pytest.raises(ValueError, match="tokens must be a finite number"):
            e.delivered(r, bad)  # type: ignore[arg-type]
    assert e.queues["p"].meter(A) == m
    assert e.delivered(r, 10**9) == 10  # capped at max_tokens


CONTEXT = """
  p:
    models: [m]
    backends:
      - {url: "http://127.0.0.1:9", max_in_flight: 1, name: small, max_context: 100}
      - {url: "http://127.0.0.1:10", max_in_flight: 1, name: big}
"""


@pytest.mark.parametrize("overtake", [0, 1])
def test_a_head_that_fits_nothing_waits_uncharged_or_is_overtaken(overtake: int, clock: Clock, core) -> None:
    e = make("seed", clock, core, pools=CONTEXT)
    q = e.queues["p"]
    q.overtake = overtake
    big_b = submit(e, B, 400)  # takes the big backend; b is charged
    assert e.poll() == [big_b] and big_b.backend == "big"
    clock.advance(1)
    too_big = submit(e, A, 400)  # a is next in line but fits only the big one, which is busy
    small_b = submit(e, B, 10)
    started = e.poll()
    # never charged while it waits (set aside, its meter is at most v: it rejoins at max(S, v))
    assert too_big.state != RUNNING and too_big.charged == 0 and q.meter(A) <= q.sched.virtual_time
    assert started == ([] if overtake == 0 else [small_b])
    e.complete(big_b, {"prompt_tokens": 10, "completion_tokens": 400})
    assert too_big in e.poll()  # the big backend freed: it goes, and its flow competes again
    assert not q.aside



def test_the_longest_pause_is_the_policy_files(clock: Clock) -> None:
    from sfq.dispatch import PolicyDispatcher

    pol = policy(orgs=ORGS, extra="retry: {max_pause_seconds: 5}\n")
    assert pol.retry.max_pause_seconds == 5.0
    pd = PolicyDispatcher(pol, clock=clock)
    assert pd.engine.max_pause == 5.0
    assert pd.engine.backend_paused("p", "http://127.0.0.1:9", 3600) == 5.0
    with pytest.raises(Exception, match="retry.max_pause_seconds"):
        policy(orgs=ORGS, extra="retry: {max_pause_seconds: -1}\n")


def test_a_flows_lead_is_read_and_put_back_the_same_on_both_twins(clock: Clock, core) -> None:
    """``PolicyQueue.lead``/``set_lead`` (a fleet's next decider putting back the meters the
    last one left): a flow charged ahead of the others reads its lead over the virtual time,
    and another queue given that lead holds the flow that far ahead."""
    e = make("seed", clock, core, slots=1)
    q = e.queues["p"]
    ra = submit(e, A, 100)
    for _ in range(2):
        submit(e, B, 10)
    e.poll()  # a runs (charged its estimate), b waits: a is ahead of v by a's charge
    assert ra.state == RUNNING
    ahead = q.lead(A)
    assert ahead > 0 and q.lead(B) == 0.0
    other = make("seed", clock, core, slots=1).queues["p"]
    other.set_lead(A, ahead)
    assert other.lead(A) == pytest.approx(ahead)
    other.set_lead(B, 0.0)  # (nothing: no lead to put back)
    assert other.lead(B) == 0.0
    e.complete(ra, None)


def test_an_adopted_request_is_charged_its_corrections_and_refunded_no_more(clock: Clock, core) -> None:
    """``PolicyQueue.correct`` of a request adopted as running (a fleet's new decider adopting the
    attempts that run, ``sfq.state``): its flow's meter moves by a charge as for any request, and
    a refund takes back no more than was charged here, on both twins."""
    from sfq.engine import Request

    e = make("seed", clock, core, slots=2)
    q = e.queues["p"]
    ra = submit(e, A, 10)
    e.poll()
    assert ra.state == RUNNING and ra.backend is not None
    r = Request(A, 1e-9, 0.0, clock())
    r.state, r.backend = RUNNING, ra.backend
    q.adopt_running(r)
    before = q.meter(A)
    q.correct(r, 40.0)  # a stream delivered 40 more cost units than it was charged where it started
    assert q.meter(A) == pytest.approx(before + 40.0 / q.sched.weight(A))
    q.correct(r, -100.0)  # its refund: only the 40 charged here come back
    assert q.meter(A) == pytest.approx(before)
    q.finish(r, None)
    e.complete(ra, None)
