"""`auth = "api-key"`: an account whose provider takes its key in an `api-key` header (Azure
OpenAI's API keys), through the forwarding gateway under uvicorn with the official SDK; and a
client's own `api-key` header never goes upstream, whatever the account's scheme."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.accounts import Account
from switchyard_mw.config import LLMClient, parse_config
from switchyard_mw.testing import MockProvider

ENV = {"AZURE_KEY": "azure-key", "OTHER_KEY": "other-key"}


def test_the_config_takes_the_scheme_and_the_account_sends_the_header() -> None:
    config = parse_config(
        '[llm_clients.az]\nbase_url = "https://r.openai.azure.com"\n'
        'models = { "gpt-4o" = "prod-4o" }\nauth = "api-key"\n'
        'path = "/openai/deployments/{model}/chat/completions?api-version=2025-04-01"\n'
    )
    spec = config.llm_clients["az"]
    assert spec.auth == "api-key"
    account = Account(name="az", spec=spec, api_key="k")
    assert account.auth_headers() == [("api-key", "k")]
    bearer = LLMClient(base_url="http://o", models=["m"], auth="bearer")
    assert Account(name="o", spec=bearer, api_key="k").auth_headers() == [
        ("authorization", "Bearer k")
    ]


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProvider]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        provider.url = url  # type: ignore[attr-defined]
        yield provider


@pytest.fixture(scope="module")
def gateway(mock: MockProvider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = mock.url  # type: ignore[attr-defined]
    config = f"""
[llm_clients.azure]
base_url = "{url}"
api_key_env = "AZURE_KEY"
auth = "api-key"
models = {{ "gpt-4o" = "prod-4o" }}

[llm_clients.other]
base_url = "{url}"
api_key_env = "OTHER_KEY"
models = ["gpt-5"]
"""
    with example_gateway(config, tmp_path_factory.mktemp("gw"), ENV) as gateway_url:
        yield gateway_url


@pytest.mark.integration
def test_an_api_key_account_is_called_with_its_key_in_api_key(
    gateway: str, mock: MockProvider
) -> None:
    mock.reset()
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="client-key", max_retries=0)
    answer = client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.choices[0].message.content
    (seen,) = mock.requests
    assert seen.key == "azure-key"  # read from the api-key header: nothing else carried it
    assert seen.headers["api-key"] == "azure-key"
    assert "authorization" not in seen.headers
    assert seen.model == "prod-4o"


@pytest.mark.integration
def test_a_client_s_own_api_key_header_never_goes_upstream(
    gateway: str, mock: MockProvider
) -> None:
    mock.reset()
    answer = httpx.post(
        f"{gateway}/v1/chat/completions",
        headers={"api-key": "client-secret", "authorization": "Bearer client-key"},
        json={"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert answer.status_code == 200
    (seen,) = mock.requests
    assert seen.key == "other-key"
    assert "client-secret" not in seen.headers.values()
    assert "api-key" not in seen.headers
