"""The health service (`h2_health`), alone: what each request gets, and watchers told once
the server stops serving."""

from __future__ import annotations

from grpc_health.v1 import health_pb2

from switchyard_mw.extproc.h2_framing import INVALID_ARGUMENT, NOT_FOUND, OK
from switchyard_mw.extproc.h2_health import NOT_SERVING, SERVING, Health, Verdict


def request(service: str) -> bytes:
    return health_pb2.HealthCheckRequest(service=service).SerializeToString()


def status_in(answer: bytes) -> int:
    return health_pb2.HealthCheckResponse.FromString(answer).status


def test_a_served_service_is_serving() -> None:
    health = Health(frozenset({"", "envoy.service.ext_proc.v3.ExternalProcessor"}))
    assert health.judge(request(""), asked=False) == Verdict(OK, service="")
    assert status_in(health.answer("")) == SERVING


def test_an_unknown_service_is_not_found() -> None:
    health = Health(frozenset({""}))
    verdict = health.judge(request("other"), asked=False)
    assert (verdict.status, verdict.detail) == (NOT_FOUND, "unknown service 'other'")


def test_a_second_request_on_one_call_is_refused() -> None:
    health = Health(frozenset({""}))
    verdict = health.judge(request(""), asked=True)
    assert verdict.status == INVALID_ARGUMENT


def test_a_request_that_does_not_parse_is_refused() -> None:
    health = Health(frozenset({""}))
    verdict = health.judge(b"\xff\xff\xff", asked=False)
    assert (verdict.status, verdict.detail) == (INVALID_ARGUMENT, "cannot parse HealthCheckRequest")


def test_stopping_tells_every_watcher_not_serving_once() -> None:
    health = Health(frozenset({""}))
    told: list[int] = []
    health.watch("call-1", lambda: told.append(status_in(health.answer(""))))
    health.watch("call-2", lambda: told.append(status_in(health.answer(""))))
    health.unwatch("call-2")
    health.unwatch("never-watched")
    health.stop_serving()
    assert told == [NOT_SERVING]
    assert status_in(health.answer("")) == NOT_SERVING
    assert status_in(health.answer("unknown")) == 0  # UNKNOWN: not a service here
