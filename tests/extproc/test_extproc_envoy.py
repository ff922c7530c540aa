"""The example envoy.yaml's economy, through a real Envoy: which ext_proc streams a request
costs, and that what is skipped is still recorded.

The upstream-level filter runs only on a refused attempt's response (a matcher on `:status`)
and on a retry's request headers (`x-envoy-attempt-count` above 1); the router-level filter
forwards only the headers the processor reads. A request answered well by its first key must
open no upstream-level stream, and everything the skipped phases used to record (a success that
resets faults, a probe that closes a breaker) must still be recorded by the router-level stream.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from switchyard_mw.core.pool import BreakerState
from switchyard_mw.extproc import servicer as servicer_module
from switchyard_mw.extproc.router import RouterStream
from switchyard_mw.extproc.upstream import UpstreamStream
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
KEYS = {"KEY_A": "key-a", "KEY_B": "key-b"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def config_text(mock_url: str, *, failure_threshold: int = 3, max_body_bytes: int = 1 << 20) -> str:
    account = f"""
base_url = "{mock_url}"
models = ["claude-haiku-5"]
failure_threshold = {failure_threshold}
cooldown_secs = 30
envoy_cluster = "mock"
"""
    return f"""
[server]
max_body_bytes = {max_body_bytes}

[llm_clients.key-a]
api_key_env = "KEY_A"
auth = "x-api-key"
priority = 0
{account}
[llm_clients.key-b]
api_key_env = "KEY_B"
auth = "bearer"
priority = 1
{account}
"""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, KEYS) as rig:
        yield rig


@pytest.fixture(autouse=True)
def clock(rig: Rig) -> FakeClock:
    """The time the pools of this test's policies read."""
    rig.clock = clock = FakeClock()
    return clock


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """ext_proc streams the processor opened, by filter level (and by phases seen upstream)."""
    opened: Counter[str] = Counter()

    class CountedRouter(RouterStream):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            opened["router"] += 1
            super().__init__(*args, **kwargs)

    class CountedUpstream(UpstreamStream):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            opened["upstream"] += 1
            super().__init__(*args, **kwargs)

        def on_request_headers(self, headers: dict[str, bytes]) -> Any:
            opened["upstream request headers"] += 1
            return super().on_request_headers(headers)

        def on_response_headers(self, request: Any) -> Any:
            opened["upstream response headers"] += 1
            return super().on_response_headers(request)

    monkeypatch.setattr(servicer_module, "RouterStream", CountedRouter)
    monkeypatch.setattr(servicer_module, "UpstreamStream", CountedUpstream)
    return opened


@pytest_asyncio.fixture(loop_scope="module")
async def http(rig: Rig) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=rig.envoy_url, timeout=10) as client:
        yield client


def message(model: str = "claude-haiku-5") -> dict[str, Any]:
    return {"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": "Hi"}]}


async def test_a_request_its_first_key_answers_opens_no_upstream_level_stream(
    rig: Rig, http: httpx.AsyncClient, streams: Counter[str]
) -> None:
    rig.configure()
    for _ in range(5):
        response = await http.post("/v1/messages", json=message())
        assert response.status_code == 200, response.text
        assert response.headers["x-switchyard-account"] == "key-a"
        assert response.headers["x-switchyard-attempts"] == "1"
    assert streams == {"router": 5}
    assert [r.key for r in rig.mock.requests] == ["key-a"] * 5
    # Envoy's attempt count reaches the provider; nothing of switchyard's does.
    assert all(r.headers.get("x-envoy-attempt-count") == "1" for r in rig.mock.requests)
    assert not any(h.startswith("x-switchyard") for r in rig.mock.requests for h in r.headers)
    assert len(rig.processor.servicer.flights) == 0


async def test_a_refusal_opens_one_response_stream_and_the_retry_one_request_stream(
    rig: Rig, http: httpx.AsyncClient, streams: Counter[str]
) -> None:
    policies = rig.configure(failure_threshold=1)
    rig.mock.set_behaviour("key-a", Behaviour(status=401))
    response = await http.post("/v1/messages", json=message())
    assert response.status_code == 200, response.text
    assert response.headers["x-switchyard-account"] == "key-b"
    assert response.headers["x-switchyard-attempts"] == "2"
    assert [r.key for r in rig.mock.requests] == ["key-a", "key-b"]
    assert streams == {
        "router": 1,
        "upstream": 2,
        "upstream response headers": 1,  # attempt 1's 401, found by request.id
        "upstream request headers": 1,  # attempt 2, key b swapped in
    }
    assert policies.pool.status_of("key-a").state is BreakerState.COOLED
    assert policies.pool.status_of("key-b").consecutive_faults == 0


async def test_a_success_no_upstream_stream_saw_still_resets_the_fault_count(
    rig: Rig, http: httpx.AsyncClient, streams: Counter[str]
) -> None:
    policies = rig.configure(failure_threshold=3)
    rig.mock.set_behaviour("key-a", Behaviour(status=500))
    failed = await http.post("/v1/messages", json=message())
    assert failed.headers["x-switchyard-account"] == "key-b"  # failed over inside the request
    assert policies.pool.status_of("key-a").consecutive_faults == 1
    rig.mock.clear_behaviour("key-a")
    streams.clear()
    ok = await http.post("/v1/messages", json=message())
    assert ok.headers["x-switchyard-account"] == "key-a"
    assert streams == {"router": 1}  # the 200 skipped the upstream-level filter ...
    assert policies.pool.status_of("key-a").consecutive_faults == 0  # ... and still counted


async def test_a_probe_that_succeeds_closes_the_breaker_without_an_upstream_stream(
    rig: Rig, http: httpx.AsyncClient, streams: Counter[str], clock: FakeClock
) -> None:
    policies = rig.configure(failure_threshold=1)
    rig.mock.set_behaviour("key-a", Behaviour(status=503))
    await http.post("/v1/messages", json=message())
    assert policies.pool.status_of("key-a").state is BreakerState.COOLED
    rig.mock.clear_behaviour("key-a")
    skipped = await http.post("/v1/messages", json=message())
    assert skipped.headers["x-switchyard-account"] == "key-b"  # the cooled key is skipped
    clock.now += 31  # its cooling is over: the next request probes it
    streams.clear()
    probe = await http.post("/v1/messages", json=message())
    assert probe.headers["x-switchyard-account"] == "key-a"
    assert streams == {"router": 1}
    assert policies.pool.status_of("key-a").state is BreakerState.CLOSED


async def test_a_client_error_from_the_provider_is_no_fault(
    rig: Rig, http: httpx.AsyncClient, streams: Counter[str]
) -> None:
    policies = rig.configure(failure_threshold=1)
    rig.mock.set_behaviour("key-a", Behaviour(status=400))
    response = await http.post("/v1/messages", json=message())
    assert response.status_code == 400
    # 400 is not a refusal: no failover. The upstream-level filter sees it (a context-length
    # refusal is a 400 too) and lets it on: no model here has a chain, so its body is not read.
    assert streams == {"router": 1, "upstream": 1, "upstream response headers": 1}
    assert [r.key for r in rig.mock.requests] == ["key-a"]
    assert policies.pool.status_of("key-a").state is BreakerState.CLOSED


async def test_the_headers_the_processor_reads_still_reach_it(
    rig: Rig, http: httpx.AsyncClient, otel_metrics: Any
) -> None:
    """forward_rules sends only what the processor reads: the incoming budget and the
    declared length must be among it."""
    rig.configure(max_body_bytes=2048)
    too_big = await http.post(
        "/v1/chat/completions",
        content=b"{" + b" " * 4096 + b"}",
        headers={"content-type": "application/json"},
    )
    assert too_big.status_code == 413
    assert too_big.json()["error"]["type"] == "request_too_large"
    rig.mock.set_behaviour("key-a", Behaviour(headers_delay_secs=3))
    before = otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="budget")
    budgeted = await http.post(
        "/v1/messages", json=message(), headers={"x-switchyard-timeout-ms": "300"}
    )
    assert budgeted.status_code == 504
    assert budgeted.json()["error"]["type"] == "deadline_exceeded"
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="budget") == before + 1
    assert rig.mock.requests[-1].key == "key-a"
