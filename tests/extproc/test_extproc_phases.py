"""One flight per ext_proc stream: a peer repeating or reordering phases leaks nothing.

A second `request_body` used to replace the stream's flight without closing it: each one left
a registry slot and a lease behind, until the registry was full and in-request failover was
never offered again. After any sequence of messages, however the stream ends, the flight
registry is empty and every lease the pool granted is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import httpx
import msgspec
import pytest

from extproc_child import CountingPool
from extproc_helpers import (
    Stream,
    answered,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
    upstream_headers,
)
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.context import RequestContext
from switchyard_mw.core.pool import Outcome
from switchyard_mw.core.shared import Shared
from switchyard_mw.engine.claims import acquire_shared
from switchyard_mw.extproc import ExtProcServicer, Policies, Transport, start_server
from switchyard_mw.extproc import flights as flights_module
from switchyard_mw.extproc.flights import Flight, Flights
from switchyard_mw.extproc.router import RouterStream
from switchyard_mw.testing import MockProvider

CONFIG = """
[llm_clients.a]
base_url = "https://prov.example"
api_key_env = "KEY_A"
models = ["m"]
priority = 0
failure_threshold = 1
cooldown_secs = 5
envoy_cluster = "prov"

[llm_clients.b]
base_url = "https://prov.example"
api_key_env = "KEY_B"
models = ["m"]
priority = 1
failure_threshold = 1
envoy_cluster = "prov"
"""
ENV = {"KEY_A": "ka", "KEY_B": "kb"}
UPSTREAM = [("x-switchyard-filter", "upstream")]
BODY = msgspec.json.encode(
    {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
)


@dataclass
class Env:
    clock: list[float]
    pool: CountingPool
    servicer: ExtProcServicer

    def stream(self, metadata: Sequence[tuple[str, str]] = ()) -> Stream:
        return Stream(self.servicer, metadata)

    def assert_empty(self) -> None:
        assert len(self.servicer.flights) == 0
        assert self.pool.out == 0
        assert not any(status.probe_in_flight for status in self.pool.status())


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    config = parse_config(CONFIG)
    accounts = build_accounts(config, ENV)
    clock = [1000.0]
    pool = CountingPool(pool_from_accounts(accounts).specs, clock=lambda: clock[0])
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=MockProvider()))
    policies = Policies(config, accounts, pool=pool, judge_http_client=http)
    yield Env(clock, pool, ExtProcServicer(policies, Flights(max_flights=8)))
    await http.aclose()


def cool_then_probe(env: Env) -> None:
    """Account a cools after one fault; once its cooldown is over its next lease is a probe."""
    lease = env.pool.acquire("m")
    assert lease is not None
    assert lease.account == "a"
    env.pool.record(lease, Outcome.FAULT)
    env.clock[0] += 60


BODY_AGAIN = request_body(BODY)
SSE = {"content-type": "text/event-stream"}
HEADERS = request_headers()
SEQUENCES = {
    "a body per message": [HEADERS, *[BODY_AGAIN] * 20],
    "headers again": [HEADERS, BODY_AGAIN, HEADERS, BODY_AGAIN],
    "body after the response": [HEADERS, BODY_AGAIN, response_headers(200), BODY_AGAIN],
    "response twice": [HEADERS, BODY_AGAIN, response_headers(500), response_headers(200)],
    "body before headers": [BODY_AGAIN, HEADERS, BODY_AGAIN, BODY_AGAIN],
    "response before anything": [response_headers(200), HEADERS, BODY_AGAIN],
    "a response body not asked for": [
        HEADERS,
        BODY_AGAIN,
        response_headers(200),
        response_body(b"{}", end=True),
    ],
    "a read stream's body again after its end": [
        HEADERS,
        BODY_AGAIN,
        response_headers(200, SSE),
        response_body(b"data: {}\n\n"),
        response_body(b"", end=True),
        response_body(b"data: more\n\n", end=True),
        response_headers(200, SSE),
    ],
    "a read stream cut off": [HEADERS, BODY_AGAIN, response_headers(200, SSE), response_body(b"d")],
}


@pytest.mark.parametrize("probe", [False, True], ids=["grant", "probe"])
@pytest.mark.parametrize("sequence", SEQUENCES.values(), ids=SEQUENCES.keys())
async def test_any_phase_sequence_leaves_no_flight_and_no_lease(
    env: Env, sequence: list[ep.ProcessingRequest], probe: bool
) -> None:
    if probe:
        cool_then_probe(env)
    stream = env.stream()
    answers = [await stream.send(request) for request in sequence]
    routed = [a for a in answers if "x-switchyard-cluster" in sets(a)] if answers else []
    assert len(routed) <= 1  # one flight, one account: a repeated body changes nothing
    assert len(env.servicer.flights) <= 1
    assert env.pool.out <= 1
    await stream.close()
    env.assert_empty()


async def test_a_repeated_body_answers_unchanged_and_the_first_flight_stays(env: Env) -> None:
    stream = env.stream()
    await stream.send(HEADERS)
    first = await stream.send(BODY_AGAIN)
    assert sets(first)["x-switchyard-cluster"] == b"prov"
    again = await stream.send(BODY_AGAIN)
    assert again.WhichOneof("response") == "request_body"
    assert not again.request_body.HasField("response") or not sets(again)
    flight = env.servicer.flights.find("rid-1")
    assert flight is not None
    assert flight.tried == ["a"]
    await stream.close()
    env.assert_empty()


async def test_after_a_flood_of_bodies_failover_is_still_offered(env: Env) -> None:
    """The registry holds 8 here: 51 streams of repeated bodies used to fill it for good."""
    for _ in range(51):
        stream = env.stream()
        await stream.send(HEADERS)
        for _ in range(5):
            await stream.send(BODY_AGAIN)
        await stream.close()
    env.assert_empty()
    # A real request afterwards: found by its id, and a 500 from account a offers a retry.
    router = env.stream()
    await router.send(request_headers(extra={"x-request-id": "fresh"}))
    await router.send(BODY_AGAIN)
    assert env.servicer.flights.find("fresh") is not None
    upstream = env.stream(UPSTREAM)
    retry = await upstream.send(response_headers(500, request_id="fresh"))
    assert sets(retry).get("x-switchyard-retry") == b"1"
    await upstream.close()
    await router.close()
    env.assert_empty()


async def test_an_upstream_stream_takes_one_attempt_however_often_headers_come(env: Env) -> None:
    router = env.stream()
    await router.send(HEADERS)
    await router.send(BODY_AGAIN)
    upstream = env.stream(UPSTREAM)
    await upstream.send(upstream_headers({"x-request-id": "rid-1"}, attempt=1))
    await upstream.send(response_headers(500))  # a's fault, settled; b is offered
    for attempt in range(2, 12):  # a peer replaying retries on one stream
        await upstream.send(upstream_headers({"x-request-id": "rid-1"}, attempt=attempt))
    flight = env.servicer.flights.find("rid-1")
    assert flight is not None
    assert flight.tried == ["a"]
    await upstream.close()
    await router.close()
    env.assert_empty()


class GatedStore:
    """A shared store whose probe claims answer "yours" once the test lets them."""

    def __init__(self) -> None:
        self.asked, self.go = asyncio.Event(), asyncio.Event()

    def changed(
        self, account: str, change: object, local: Shared, *, model: str | None = None
    ) -> None:
        pass  # nothing to share in this test

    def held(self, account: str, model: str, until_unix: float) -> None:
        pass

    async def claim_probe(self, account: str, model: str | None = None) -> Shared | None:
        self.asked.set()
        await self.go.wait()
        return None


def due_a_probe(env: Env, name: str) -> GatedStore:
    """Account `name` is due a probe, claimed through a store that waits for the test."""
    lease = env.pool.acquire("m", allowed={name})
    assert lease is not None
    env.pool.record(lease, Outcome.FAULT)
    env.clock[0] += 60
    store = GatedStore()
    env.pool.attach(store)  # type: ignore[arg-type]
    return store


async def test_a_retry_whose_request_ended_meanwhile_gives_its_lease_back(env: Env) -> None:
    """The router-level stream closes while the upstream-level one waits for a lease."""
    store = due_a_probe(env, "b")
    router = env.stream()
    await router.send(HEADERS)
    await router.send(BODY_AGAIN)  # a takes it: no probe, nothing to claim
    flight = env.servicer.flights.find("rid-1")
    assert flight is not None
    upstream = env.stream(UPSTREAM)
    retry = asyncio.create_task(
        upstream.send(upstream_headers({"x-request-id": "rid-1"}, attempt=2))
    )
    await store.asked.wait()  # b's probe is being claimed
    await router.close()
    store.go.set()
    answer = await retry
    assert "x-api-key" not in sets(answer)
    await upstream.close()
    env.pool.attach(None)
    env.assert_empty()


async def test_a_stream_cancelled_while_judged_or_leased_leaves_nothing(env: Env) -> None:
    policies = env.servicer.policies
    waiting = asyncio.Event()

    async def stuck(ctx: RequestContext, gone: object) -> None:
        waiting.set()
        await asyncio.Event().wait()

    policies.decide_model = stuck  # type: ignore[assignment,method-assign]
    policies.judged = lambda ctx: True  # a judged route, whose judge never answers
    stream = env.stream()
    await stream.send(HEADERS)
    task = asyncio.create_task(stream.send(BODY_AGAIN))
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    env.assert_empty()


async def test_a_lease_granted_after_the_stream_closed_goes_back(env: Env) -> None:
    """A transport that ends a stream while its body is being placed: the lease the placing
    then gets is given back, not kept by a flight nobody will settle."""
    store = due_a_probe(env, "a")
    stream = RouterStream(env.servicer.policies, env.servicer.flights, None)
    await answered(stream.answer(HEADERS))
    placing = asyncio.create_task(answered(stream.answer(BODY_AGAIN)))
    await store.asked.wait()  # a's probe is being claimed
    stream.close()
    store.go.set()
    answer = await placing
    assert "x-switchyard-cluster" not in sets(answer)
    env.pool.attach(None)
    env.assert_empty()


class StuckStore:
    """A shared store whose probe claim never answers (a slow Redis)."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    def changed(
        self, account: str, change: object, local: Shared, *, model: str | None = None
    ) -> None:
        pass  # nothing to share in this test

    async def claim_probe(self, account: str, model: str | None = None) -> Shared | None:
        self.asked.set()
        await asyncio.Event().wait()
        return None


async def test_a_probe_claim_cancelled_midway_frees_the_probe_slot(env: Env) -> None:
    cool_then_probe(env)
    store = StuckStore()
    env.pool.attach(store)  # type: ignore[arg-type]
    claim = asyncio.create_task(acquire_shared(env.pool, "m", allowed={"a"}))
    await store.asked.wait()
    claim.cancel()
    with pytest.raises(asyncio.CancelledError):
        await claim
    env.pool.attach(None)
    env.pool.out -= 1  # counted when acquired; cancelled before anyone held it
    env.assert_empty()
    lease = env.pool.acquire("m", allowed={"a"})
    assert lease is not None
    assert lease.probe


# --- the registry and the log, without protobuf ----------------------------------------------


def flight() -> Flight:
    return Flight(ctx=RequestContext(view=None, body=b"", now=0.0))


def test_a_flight_is_registered_once_and_not_after_it_closed() -> None:
    flights = Flights(max_flights=4)
    f = flight()
    assert flights.open(f, "r1")
    assert not flights.open(f, "r1")  # already registered: not counted twice
    assert not flights.open(f, "r2")
    assert len(flights) == 1
    assert flights.find("r1") is f
    flights.close(f)
    flights.close(f)
    assert len(flights) == 0
    assert flights.find("r1") is None
    assert not flights.open(f, "r1")  # a closed flight takes no attempt
    assert len(flights) == 0


def test_phase_breaches_are_logged_once_a_minute_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    episodes = flights_module._Episodes(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger=flights_module.__name__):
        for _ in range(1000):
            episodes("request_body")
        now[0] += flights_module.LOG_EVERY_SECS
        episodes("request_headers")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "request_body" in lines[0]
    assert "(1 such" in lines[0]
    assert "request_headers" in lines[1]
    assert "(1000 such" in lines[1]
    assert episodes.total == 1001


# --- live: the real server, on both transports -----------------------------------------------


async def _exchange(
    channel: grpc.aio.Channel,
    requests: list[ep.ProcessingRequest],
    metadata: Sequence[tuple[str, str]] = (),
) -> list[ep.ProcessingResponse]:
    stub = ep_grpc.ExternalProcessorStub(channel)
    call = stub.Process(iter(requests), metadata=tuple(metadata), timeout=30)
    return [answer async for answer in call]


@pytest.mark.integration
async def test_a_body_flood_over_51_streams_leaves_failover_offered(transport: Transport) -> None:
    config = parse_config(CONFIG)
    accounts = build_accounts(config, ENV)
    pool = CountingPool(pool_from_accounts(accounts).specs)
    server = await start_server(
        Policies(config, accounts, pool=pool), "127.0.0.1:0", transport=transport
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            flood = [HEADERS, *[BODY_AGAIN] * 100]
            answers = await asyncio.gather(*(_exchange(channel, flood) for _ in range(51)))
            assert all(len(a) == len(flood) for a in answers)
            assert len(server.servicer.flights) == 0
            assert pool.out == 0
            # A request afterwards is findable, and a fault on its account offers a retry.
            stub = ep_grpc.ExternalProcessorStub(channel)
            call = stub.Process(timeout=30)  # the router-level stream stays open meanwhile
            await call.write(request_headers(extra={"x-request-id": "fresh"}))
            await call.read()
            await call.write(BODY_AGAIN)
            assert "x-switchyard-cluster" in sets(await call.read())
            upstream = await _exchange(
                channel, [response_headers(500, request_id="fresh")], UPSTREAM
            )
            assert sets(upstream[0]).get("x-switchyard-retry") == b"1"
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
    finally:
        await server.stop(grace_secs=0)
    assert len(server.servicer.flights) == 0
    assert pool.out == 0
