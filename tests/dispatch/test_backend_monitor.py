"""``sfq.backends.health.BackendMonitor``: one backend's health as a component, told how each
request ended and reporting down, up, paused and saturated to its listener."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sfq.backends import Backend, SaturationProbe
from sfq.backends.health import BackendMonitor, HealthOptions
from sfq.errors import BackendHTTPError, BackendRateLimited, BackendTimeout, BackendUnavailable, StreamInterrupted

LIMIT = 10.0


class Fake(Backend):
    """A backend whose health check and metrics the test sets."""

    def __init__(self, probe: SaturationProbe | None = None) -> None:
        super().__init__("b", probe=probe)
        self.ok = False
        self.checks = 0
        self.metrics = "vllm:num_requests_waiting 0\n"

    async def complete(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    async def stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError
        yield {}

    async def check_health(self) -> bool:
        self.checks += 1
        return self.ok

    async def fetch_metrics(self) -> str:
        return self.metrics


class Heard:
    """A listener that writes down what it hears."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def backend_down(self, name: str, reason: str) -> None:
        self.events.append(("down", reason))

    def backend_up(self, name: str) -> None:
        self.events.append(("up", None))

    def backend_paused(self, name: str, seconds: float) -> None:
        self.events.append(("paused", seconds))

    def backend_unpaused(self, name: str) -> None:
        self.events.append(("unpaused", None))

    def backend_saturated(self, name: str, saturated: bool) -> None:
        self.events.append(("saturated", saturated))

    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]


async def until(cond: Any, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + LIMIT
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def e5xx() -> BackendHTTPError:
    return BackendHTTPError("boom", status=500, unhealthy=True)


async def test_5xx_of_one_flow_alone_never_take_it_down_but_of_several_do() -> None:
    heard = Heard()
    m = BackendMonitor(Fake(), heard, HealthOptions(error_window=10, error_rate=0.5, backoff=30, max_backoff=30))
    for _ in range(4):
        m.replied("good", None)
    for _ in range(4):
        m.replied("bad", e5xx())  # one tenant's failures, beside another's successes
    assert m.healthy and heard.events == []
    m.replied("other", e5xx())
    m.replied("other", e5xx())
    m.replied("third", e5xx())
    assert not m.healthy and heard.kinds() == ["down"] and "5xx" in str(heard.events[0][1])
    await m.close()


async def test_transport_failures_in_a_row_and_a_refused_connection() -> None:
    heard = Heard()
    m = BackendMonitor(Fake(), heard, HealthOptions(transport_failures=3, backoff=30, max_backoff=30))
    m.replied("f", BackendTimeout("slow"))
    m.replied("f", StreamInterrupted("cut"))
    m.replied("f", None)  # a reply in between: the count starts again
    m.replied("f", BackendUnavailable("reset"))
    m.replied("f", ValueError("the embedder's own transport failed"))  # not a BackendError: transport
    assert m.healthy
    m.replied("f", BackendTimeout("slow"))  # the driver's own calls: out at once
    assert not m.healthy and heard.kinds() == ["down"] and m.confirmations == 0
    await m.close()
    heard2 = Heard()
    m2 = BackendMonitor(Fake(), heard2, HealthOptions(backoff=30, max_backoff=30))
    m2.replied("f", BackendUnavailable("refused", never_sent=True))
    assert not m2.healthy and "cannot connect" in str(heard2.events[0][1])
    await m2.close()


async def test_reports_of_two_flows_take_it_out_at_once() -> None:
    heard = Heard()
    m = BackendMonitor(Fake(), heard, HealthOptions(transport_failures=3, backoff=30, max_backoff=30))
    for flow in ("f", "g", "f"):
        m.replied(flow, BackendUnavailable("the embedder's call failed"), True)
    assert not m.healthy and heard.kinds() == ["down"] and m.confirmations == 0
    await m.close()


@pytest.mark.parametrize("kind", ["transport", "refused", "5xx"])
async def test_one_flows_reports_never_take_it_out_unless_the_health_check_fails_too(kind: str) -> None:
    """One tenant's reports (an embedder's ``grant.fail()`` is its word) meet a rule: the
    monitor checks the backend once; it stays while the check passes, leaves if it fails."""
    def fail() -> BaseException:
        return {"transport": BackendTimeout("slow"), "refused": BackendUnavailable("refused", never_sent=True),
                "5xx": e5xx()}[kind]

    heard = Heard()
    be = Fake()
    be.ok = True
    m = BackendMonitor(be, heard, HealthOptions(transport_failures=3, error_window=4, backoff=30, max_backoff=30))
    for _ in range(12):
        m.replied("f", fail(), True)
        await until(lambda: m._confirm is None, "the health check to end")
        assert m.healthy
    assert heard.events == [] and be.checks == m.confirmations == {"transport": 4, "refused": 12, "5xx": 6}[kind]
    be.ok = False
    for _ in range(4):
        m.replied("f", fail(), True)
    await until(lambda: not m.healthy, "the failed check to take it out")
    assert heard.kinds() == ["down"] and "health check failed too" in str(heard.events[0][1])
    await m.close()


async def test_4xx_and_a_streams_own_error_count_against_the_request_only() -> None:
    heard = Heard()
    m = BackendMonitor(Fake(), heard, HealthOptions(error_window=2, transport_failures=1))
    for _ in range(5):
        m.replied("f", BackendHTTPError("bad request", status=400))
        m.replied("f", StreamInterrupted("error event", unhealthy=False))
    assert m.healthy and heard.events == [] and m.errors == 10
    await m.close()


async def test_a_429_pauses_capped_and_ends() -> None:
    heard = Heard()
    m = BackendMonitor(Fake(), heard, HealthOptions(max_pause=0.05))
    m.replied("f", BackendRateLimited("slow down", status=429, retry_after=3600.0))
    assert heard.events == [("paused", 0.05)] and m.paused and m.healthy
    await until(lambda: "unpaused" in heard.kinds(), "the pause to end")
    assert not m.paused and m.rate_limited == 1
    m.replied("f", BackendRateLimited("slow down", status=429))  # no Retry-After: default_pause
    assert heard.events[-1] == ("paused", 0.05)
    await m.close()
    none = Heard()
    m0 = BackendMonitor(Fake(), none, HealthOptions(max_pause=0))
    m0.replied("f", BackendRateLimited("slow down", status=429, retry_after=5.0))
    assert none.events == [] and not m0.paused  # a max_pause of 0: a 429 pauses nothing
    await m0.close()


async def test_health_checks_with_backoff_bring_it_back() -> None:
    heard = Heard()
    be = Fake()
    m = BackendMonitor(be, heard, HealthOptions(backoff=0.01, max_backoff=0.04))
    m.mark_down("test")
    await until(lambda: be.checks >= 3, "three failing checks")
    assert not m.healthy and m.stats()["check_interval"] is not None
    be.ok = True
    await until(lambda: m.healthy, "the check to pass")
    assert heard.kinds() == ["down", "up"] and m.stats()["check_interval"] is None and m.window.errors == 0
    await m.close()


async def test_the_saturation_probe_reports_changes_only() -> None:
    heard = Heard()
    be = Fake(SaturationProbe(interval=0.01, max_waiting=0))
    m = BackendMonitor(be, heard)
    m.start()
    await asyncio.sleep(0.05)
    assert heard.events == []
    be.metrics = "vllm:num_requests_waiting 3\n"
    await until(lambda: m.saturated, "saturated")
    be.metrics = "vllm:num_requests_waiting 0\n"
    await until(lambda: not m.saturated, "no longer saturated")
    assert heard.events == [("saturated", True), ("saturated", False)] and m.healthy
    await m.close()
    m.replied("f", BackendUnavailable("refused", never_sent=True))
    assert m.healthy  # closed: it reports nothing more


def test_bad_options() -> None:
    for kw in ({"error_window": 0}, {"error_rate": 0}, {"error_rate": 1.5}, {"transport_failures": 0},
               {"backoff": -1}, {"max_backoff": 0.1, "backoff": 1.0}, {"max_pause": float("inf")}):
        with pytest.raises(ValueError):
            HealthOptions(**kw)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BackendMonitor(object(), Heard())  # type: ignore[arg-type]
