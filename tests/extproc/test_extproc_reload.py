"""Config reload of the ext_proc servicer (SIGHUP's work), with synthetic Envoy traffic."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_extproc import CONFIG, UPSTREAM, anthropic

from extproc_helpers import (
    Stream,
    request_body,
    request_headers,
    response_headers,
    sets,
    upstream_headers,
)
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import load_config
from switchyard_mw.core.pool import BreakerState, Outcome
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.extproc.reloading import load_extproc_config, reload_policies
from switchyard_mw.testing import MockProvider

ENV = {"KEY_A": "secret-a", "KEY_B": "secret-b", "KEY_C": "secret-c", "KEY_B2": "secret-b2"}


@pytest.fixture
async def servicer(tmp_path: Path) -> AsyncIterator[tuple[ExtProcServicer, Path]]:
    path = tmp_path / "switchyard.toml"
    path.write_text(CONFIG)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=MockProvider()))
    config = load_config(path)
    yield (
        ExtProcServicer(Policies(config, build_accounts(config, ENV), judge_http_client=http)),
        path,
    )
    await http.aclose()


def reload(servicer: ExtProcServicer, path: Path) -> list[str]:
    return reload_policies(servicer, functools.partial(load_extproc_config, path), ENV)


async def route(servicer: ExtProcServicer, body: bytes, rid: str) -> tuple[Stream, Any]:
    stream = Stream(servicer)
    await stream.send(request_headers(extra={"x-request-id": rid}))
    return stream, await stream.send(request_body(body))


async def test_a_request_under_way_fails_over_with_the_config_it_started_with(
    servicer: tuple[ExtProcServicer, Path],
) -> None:
    svc, path = servicer
    old = svc.policies
    router, _ = await route(svc, anthropic(), "rid-old")
    path.write_text(CONFIG.replace('"KEY_B"', '"KEY_B2"'))  # account b's key is rotated
    assert reload(svc, path) == []
    assert svc.policies is not old

    refused = Stream(svc, UPSTREAM)
    assert sets(await refused.send(response_headers(402, request_id="rid-old"))) == {
        "x-switchyard-retry": b"1"
    }
    await refused.close()
    retry = Stream(svc, UPSTREAM)
    attempt = await retry.send(upstream_headers({"x-request-id": "rid-old"}, attempt=2))
    assert sets(attempt) == {"authorization": b"Bearer secret-b"}  # the old config's key
    await retry.close()
    await router.close()
    # The refusal cooled account a, in the pool now in force too.
    assert svc.policies.pool.status_of("a").state is BreakerState.COOLED

    new_router, answer = await route(svc, anthropic(), "rid-new")
    assert sets(answer)["authorization"] == b"Bearer secret-b2"  # a is cooled: b, new key
    await new_router.close()


async def test_a_broken_config_changes_nothing(servicer: tuple[ExtProcServicer, Path]) -> None:
    svc, path = servicer
    old = svc.policies
    path.write_text(CONFIG.replace("timeout_secs = 10", "timeout_secs = 0", 1))
    problems = reload(svc, path)
    assert problems
    assert all(p.startswith("llm_clients.a.timeout_secs") for p in problems)
    assert svc.policies is old


async def test_a_config_envoy_cannot_route_is_refused(
    servicer: tuple[ExtProcServicer, Path],
) -> None:
    svc, path = servicer
    old = svc.policies
    path.write_text(
        CONFIG.replace('envoy_cluster = "prov"', "").replace('envoy_cluster = "other"', "")
    )
    assert [p.split(":")[0] for p in reload(svc, path)] == ["llm_clients"]
    assert svc.policies is old


async def test_health_is_kept_and_the_guard_re_armed(
    servicer: tuple[ExtProcServicer, Path],
) -> None:
    svc, path = servicer
    pool = svc.policies.pool
    lease = pool.acquire("m-base", exclude=["b"])
    assert lease is not None
    pool.record(lease, Outcome.FAULT)
    assert pool.status_of("a", model="m-base").state is BreakerState.COOLED
    svc.policies.canaries.trip("m-base", "m-var")
    path.write_text(CONFIG.replace('"https://other.example"', '"https://moved.example"'))
    assert reload(svc, path) == []
    assert svc.policies.pool.status_of("a", model="m-base").state is BreakerState.COOLED
    assert not svc.policies.canaries.tripped("m-base", "m-var")
