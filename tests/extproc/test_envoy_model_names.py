"""Provider model names through a real Envoy 1.40 (examples/envoy/envoy.yaml) and the processor.

The router-level stream rewrites the body to the chosen account's own name (content-length
set with it) and, for an account with a path template, sets `:path` with the route cache
cleared; an in-request failover (Envoy's retry, upstream-level filter) to an account with
another name carries that account's name too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from switchyard_mw.testing import Behaviour

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
KEYS = {"KEY_A": "key-a", "KEY_B": "key-b", "KEY_C": "key-c"}
VENDOR_NAME = "vendor.claude-opus-5-v1:0"
DEPLOYMENT = "gpt-x-deploy"


def config_text(mock_url: str) -> str:
    return f"""
[llm_clients.direct]
base_url = "{mock_url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["claude-opus-5", "gpt-x"]
failure_threshold = 100
envoy_cluster = "mock"

[llm_clients.vendor]
base_url = "{mock_url}"
api_key_env = "KEY_B"
models = {{ "claude-opus-5" = "{VENDOR_NAME}" }}
priority = 1
envoy_cluster = "mock"

[llm_clients.azure]
base_url = "{mock_url}"
api_key_env = "KEY_C"
models = {{ "gpt-x" = "{DEPLOYMENT}" }}
path = "/openai/deployments/{{model}}/chat/completions?api-version=2025-04-01"
priority = 1
envoy_cluster = "mock"
"""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
    async with start_rig(config_text, KEYS) as rig:
        yield rig


@pytest_asyncio.fixture(loop_scope="module")
async def http(rig: Rig) -> AsyncIterator[httpx.AsyncClient]:
    rig.configure()
    async with httpx.AsyncClient(base_url=rig.envoy_url, timeout=10) as client:
        yield client


def chat(model: str, *, stream: bool = False) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


def messages(model: str, *, stream: bool = False) -> dict[str, object]:
    return {
        "model": model,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failover_to_a_deployment_account_sets_its_path_and_name(
    rig: Rig, http: httpx.AsyncClient, stream: bool
) -> None:
    rig.mock.set_behaviour("key-a", Behaviour(status=503))
    response = await http.post("/v1/chat/completions?trace=1", json=chat("gpt-x", stream=stream))
    assert response.status_code == 200, response.text
    assert response.headers["x-switchyard-model"] == "gpt-x"
    assert response.headers["x-switchyard-account"] == "azure"
    seen = [(r.key, r.path, r.model) for r in rig.mock.requests]
    assert seen == [
        ("key-a", "/v1/chat/completions", "gpt-x"),
        ("key-c", f"/openai/deployments/{DEPLOYMENT}/chat/completions", DEPLOYMENT),
    ]
    assert all(int(r.headers["content-length"]) == len(r.body) for r in rig.mock.requests)


async def test_the_first_attempt_to_a_deployment_account_is_routed_there(
    rig: Rig, http: httpx.AsyncClient
) -> None:
    rig.install(
        config_text(rig.mock_url).replace('models = ["claude-opus-5", "gpt-x"]', 'models = ["x"]')
    )
    response = await http.post("/v1/chat/completions", json=chat("gpt-x"))
    assert response.status_code == 200, response.text
    assert response.headers["x-switchyard-account"] == "azure"
    (record,) = rig.mock.requests
    assert (record.key, record.path, record.model) == (
        "key-c",
        f"/openai/deployments/{DEPLOYMENT}/chat/completions",
        DEPLOYMENT,
    )
    assert int(record.headers["content-length"]) == len(record.body)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failover_inside_envoy_sends_each_account_its_own_name(
    rig: Rig, http: httpx.AsyncClient, stream: bool
) -> None:
    rig.mock.set_behaviour("key-a", Behaviour(status=503))
    response = await http.post("/v1/messages", json=messages("claude-opus-5", stream=stream))
    assert response.status_code == 200, response.text
    assert response.headers["x-switchyard-model"] == "claude-opus-5"
    assert response.headers["x-switchyard-account"] == "vendor"
    seen = [(r.key, r.path, r.model) for r in rig.mock.requests]
    assert seen == [
        ("key-a", "/v1/messages", "claude-opus-5"),
        ("key-b", "/v1/messages", VENDOR_NAME),
    ]
    assert all(int(r.headers["content-length"]) == len(r.body) for r in rig.mock.requests)
