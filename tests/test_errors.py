"""One exception family: every error sfq raises for a request carries the answer a gateway
gives for it (``http_status``, ``retry_after``, ``to_openai()``), and that answer is the one
``sfq serve`` gives (``sfq.serve.errors.http_error_of``), for every refusal reason and every
error class."""

from __future__ import annotations

import math

import pytest

import sfq
from sfq import errors
from sfq.policy import REASONS
from sfq.serve import errors as gateway

# reasons only an embedder's own classification can produce: the gateway's orgs come from
# their keys, so it never refuses a flow for naming an org the file does not know
EMBEDDER_ONLY = {"unknown_org"}


def _instances() -> list[errors.SFQError]:
    """One of every error class a request can end with, in each of its answers."""
    out: list[errors.SFQError] = [errors.Refused(r, f"refused: {r}", retry_after=2.5) for r in REASONS]
    out += [errors.Refused(r, f"refused: {r}") for r in REASONS]
    out += [
        errors.BadRequest("'max_tokens' must be an integer >= 1, got 'abc'", param="max_tokens"),
        errors.UnknownModel("no pool serves model 'x'"),
        errors.RequestTooLarge("the request needs about 9000 tokens"),
        errors.InvalidCost("cost must be a finite number > 0, got 0"),
        errors.InvalidCostType("cost must be a real number, got 'abc' of type str"),
        errors.InvalidTimeout("timeout must be a finite number of seconds > 0, got 'abc'"),
        errors.DeadlineExceeded("the deadline ran out while it was running"),
        errors.NoHealthyBackend("no backend of pool 'p' was healthy"),
        errors.DispatcherClosed("this dispatcher is closed"),
        errors.BackendError("backend 'b': RuntimeError: boom", backend="b"),
        errors.BackendUnavailable("backend 'b': cannot connect", backend="b", never_sent=True),
        errors.BackendTimeout("backend 'b': timed out", backend="b"),
        errors.StreamInterrupted("backend 'b': the stream was cut after 3 events", backend="b", chunks=3),
        errors.BackendRateLimited("backend 'b': HTTP 429", backend="b", status=429, retry_after=3.2),
        errors.BackendRateLimited("backend 'b': HTTP 429", backend="b", status=429),
    ]
    for status in (400, 404, 409, 500, 502, 503, 504):
        out.append(errors.BackendHTTPError(f"backend 'b': HTTP {status}", backend="b", status=status))
        out.append(errors.BackendHTTPError(f"backend 'b': HTTP {status}", backend="b", status=status,
                                           retry_after=7.0))
    return out


def test_every_error_class_is_covered():
    """A new error class must be added to ``_instances`` (and so be checked below)."""
    classes = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.SFQError)}
    covered = {type(e) for e in _instances()}
    not_per_request = {errors.SFQError, errors.SchedulerBusy, errors.PolicyError}
    assert classes - not_per_request == covered


def _whole(s: float) -> int:
    return max(1, math.ceil(s - 1e-9))


@pytest.mark.parametrize("exc", _instances(), ids=lambda e: f"{type(e).__name__}-{getattr(e, 'reason', '')}"
                         f"{getattr(e, 'status', '') or ''}-{e.retry_after}")
def test_the_error_answers_what_the_gateway_answers(exc):
    if getattr(exc, "reason", None) in EMBEDDER_ONLY:
        assert exc.reason not in gateway.REFUSALS
        assert exc.http_status == 403 and exc.error_type == "permission_error"
        return
    gw = gateway.http_error_of(exc)
    assert (exc.http_status, exc.error_type, exc.error_code) == (gw.status, gw.type, gw.code)
    body = exc.to_openai()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code", "param"}
    assert (body["error"]["type"], body["error"]["code"]) == (gw.type, gw.code)
    assert body["error"]["message"]
    if gw.retry_after is not None and exc.retry_after is not None:  # the gateway sends it in whole seconds
        assert gw.retry_after == _whole(exc.retry_after)
    if gw.status == 429:  # the gateway always says when: the error knows it whenever the policy did
        assert exc.retry_after is not None or gw.retry_after == 1


def test_the_refusal_table_is_the_gateways():
    for reason, answer in gateway.REFUSALS.items():
        assert errors.REFUSALS[reason] == answer, reason
    assert set(errors.REFUSALS) - set(gateway.REFUSALS) == EMBEDDER_ONLY
    assert set(errors.REFUSALS) <= set(REASONS)


def test_the_family_and_its_builtin_bases():
    bad = errors.BadRequest("'n' must be an integer >= 1, got 0", param="n")
    assert isinstance(bad, ValueError) and isinstance(bad, sfq.Refused) and isinstance(bad, sfq.SFQError)
    assert bad.reason == "bad_request" and bad.http_status == 400 and bad.retry_after is None
    assert bad.to_openai() == {"error": {"message": "'n' must be an integer >= 1, got 0",
                                         "type": "invalid_request_error", "code": "bad_request", "param": "n"}}
    assert isinstance(errors.UnknownModel("x"), LookupError)
    assert isinstance(errors.RequestTooLarge("x"), ValueError)
    assert errors.UnknownModel("x").reason == "unknown_model"
    assert errors.RequestTooLarge("x").to_openai()["error"]["code"] == "context_length_exceeded"
    assert isinstance(errors.BackendUnavailable("x"), ConnectionError)
    assert not isinstance(errors.BackendTimeout("x"), TimeoutError)


def test_a_backend_error_keeps_the_upstreams_status_and_tells_the_client_no_secret():
    exc = errors.BackendHTTPError("backend 'b': HTTP 500 from POST http://10.0.0.7:8001/v1/completions: "
                                  "'{\"detail\": \"key sk-upstream-1 has no quota\"}'", backend="b", status=500,
                                  body='{"detail": "key sk-upstream-1 has no quota"}')
    assert exc.status == 500 and exc.http_status == 502
    message = exc.to_openai()["error"]["message"]
    assert "10.0.0.7" not in message and "sk-upstream" not in message and "500" in message
    assert "10.0.0.7" in str(exc)  # the operator's log keeps the details
    unavailable = errors.BackendHTTPError("HTTP 503", status=503, retry_after=4)
    assert (unavailable.status, unavailable.http_status, unavailable.error_code) == (503, 503, "upstream_unavailable")
    assert unavailable.retry_after == 4
    assert errors.BackendUnavailable("backend 'b' at http://10.0.0.7: refused").to_openai()["error"]["message"] == \
        "no backend could be reached"


def test_an_unknown_reason_is_a_service_error_named_by_it():
    exc = errors.Refused("state_unavailable", "the gateways' shared state cannot be used: Redis is down")
    assert (exc.http_status, exc.error_type, exc.error_code) == (503, "server_error", "state_unavailable")


def test_docs_api_errors_say_what_the_code_answers() -> None:
    """docs/API.md's "Errors" states each status the code gives a backend's failure, a bad
    ``cost=`` and a bad ``timeout=``/``max_wait=`` (it used to say every upstream failure
    became 502 or 503)."""
    from pathlib import Path

    from sfq.errors import BackendHTTPError, BackendUnavailable, InvalidCost, InvalidCostType, InvalidTimeout

    doc = (Path(__file__).resolve().parents[1] / "docs" / "API.md").read_text()
    errors = doc[doc.index("\n# Errors\n"):doc.index("\n# Embedding sfq")]
    flat = " ".join(errors.split())
    assert "(502, or 503)" not in flat
    for said in ("an upstream 4xx other than 401, 403, 407 and 429 is the client's to fix and keeps its own status",
                 "an upstream 503 is 503", "every other failure is 502", "a connection that failed or timed out: 503",
                 "`sfq.errors.InvalidCost`, a `BadRequest` (400, so also a `ValueError`)",
                 "`sfq.errors.InvalidCostType` (also a `TypeError`)",
                 "`sfq.errors.InvalidTimeout`, a `BadRequest` too (400, so also a `ValueError`)"):
        assert said in flat, said

    def http(status: int) -> int:
        return BackendHTTPError("x", status=status, unhealthy=status >= 500).http_status

    assert [http(s) for s in (400, 404, 422)] == [400, 404, 422]  # the client's to fix: its own status
    assert [http(s) for s in (401, 403, 407, 429, 500, 502)] == [502] * 6 and http(503) == 503
    assert BackendUnavailable("x").http_status == 503
    assert InvalidCost("x").http_status == InvalidCostType("x").http_status == InvalidTimeout("x").http_status == 400
    assert isinstance(InvalidTimeout("x"), ValueError)
    assert "charged that cost, never corrected" in " ".join(doc.split())  # acquire's cost=: never settled
    assert "settled by finish()" not in doc
