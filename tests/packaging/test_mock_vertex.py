"""The mock provider's Vertex AI face, checked against the official SDK's own Vertex client
(`AnthropicVertex`): what the SDK sends, the mock takes; its token endpoint takes what
google-auth signs; and what is not the Vertex envelope, or not a live token, is refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from servers import serve_in_thread
from switchyard_mw.clouds.google_token import GoogleToken
from switchyard_mw.config import VertexSettings
from switchyard_mw.testing import Behaviour, MockProvider
from vertex_accounts import EMAIL, service_account_file

pytestmark = pytest.mark.integration

PREDICT = "/v1/projects/p/locations/us-east5/publishers/anthropic/models/claude-x@1:rawPredict"


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture(autouse=True)
def clean(mock: tuple[MockProvider, str]) -> None:
    mock[0].reset()


async def issued_token(mock: tuple[MockProvider, str], directory: Path) -> str:
    provider, url = mock
    key_file = service_account_file(directory, provider, url)
    settings = VertexSettings(project="p", region="us-east5", credentials_file=str(key_file))
    return await GoogleToken("gcp", settings).token()


def vertex_sdk(url: str, token: str) -> anthropic.AsyncAnthropicVertex:
    return anthropic.AsyncAnthropicVertex(
        region="us-east5",
        project_id="p",
        access_token=token,
        base_url=f"{url}/v1",
        max_retries=0,
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_the_sdks_vertex_client_is_answered_by_the_tokens_service_account(
    mock: tuple[MockProvider, str], tmp_path: Path, stream: bool
) -> None:
    provider, url = mock
    token = await issued_token(mock, tmp_path)
    provider.set_behaviour(EMAIL, Behaviour(reply="from vertex"))
    client = vertex_sdk(url, token)
    request = {
        "model": "claude-x@1",
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if stream:
        async with client.messages.stream(**request) as events:  # type: ignore[arg-type]
            text = "".join([chunk async for chunk in events.text_stream])
    else:
        message = await client.messages.create(**request)  # type: ignore[arg-type]
        text = message.content[0].text  # type: ignore[union-attr]
        assert message.model == "claude-x@1"
    await client.close()
    assert text == "from vertex"
    (record,) = provider.requests
    verb = "streamRawPredict" if stream else "rawPredict"
    assert (record.key, record.model, record.stream) == (EMAIL, "claude-x@1", stream)
    assert record.path == PREDICT.replace("rawPredict", verb)


async def test_the_sdks_vertex_client_counts_tokens(
    mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    provider, url = mock
    client = vertex_sdk(url, await issued_token(mock, tmp_path))
    messages: Any = [{"role": "user", "content": "hi"}]
    counted = await client.messages.count_tokens(model="claude-x@1", messages=messages)
    provider.set_behaviour(EMAIL, Behaviour(status=429))
    with pytest.raises(anthropic.RateLimitError) as info:
        await client.messages.count_tokens(model="claude-x@1", messages=messages)
    await client.close()
    assert info.value.body["error"]["status"] == "RESOURCE_EXHAUSTED"  # type: ignore[index]
    first, _ = provider.requests
    assert (first.key, first.model) == (EMAIL, "claude-x@1")
    assert first.path == PREDICT.replace("claude-x@1:", "count-tokens:")
    assert counted.input_tokens == max(1, len(first.body) // 4)


@pytest.mark.parametrize("token", ["", "ya29.never-issued"])
async def test_a_token_it_did_not_issue_is_a_401_in_googles_shape(
    mock: tuple[MockProvider, str], token: str
) -> None:
    client = vertex_sdk(mock[1], token or "x")
    headers = {} if token else {"authorization": ""}
    with pytest.raises(anthropic.AuthenticationError) as info:
        await client.messages.create(
            model="claude-x@1",
            max_tokens=5,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers=headers,
        )
    await client.close()
    assert info.value.body == {  # the SDK keeps the body it could not read as Anthropic's
        "error": {
            "code": 401,
            "message": "Request had invalid authentication credentials.",
            "status": "UNAUTHENTICATED",
        }
    }


async def test_an_expired_token_is_refused(mock: tuple[MockProvider, str], tmp_path: Path) -> None:
    provider = mock[0]
    provider.vertex.token_lifetime_secs = 1
    token = await issued_token(mock, tmp_path)
    assert provider.vertex.holder(token) == EMAIL
    await asyncio.sleep(1.1)
    assert provider.vertex.holder(token) is None


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"model": "claude-x@1", "anthropic_version": "vertex-2023-10-16"}, "Unknown name"),
        ({"max_tokens": 5}, "anthropic_version: required (vertex-2023-10-16)."),
        ({"anthropic_version": "2023-06"}, "anthropic_version: required"),
        ({"anthropic_version": "vertex-2023-10-16", "stream": True}, "stream: "),
    ],
)
async def test_what_is_not_the_vertex_envelope_is_a_400(
    mock: tuple[MockProvider, str], tmp_path: Path, body: dict[str, object], said: str
) -> None:
    token = await issued_token(mock, tmp_path)
    async with httpx.AsyncClient(base_url=mock[1]) as client:
        answer = await client.post(PREDICT, json=body, headers={"authorization": f"Bearer {token}"})
    assert answer.status_code == 400
    assert answer.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert answer.json()["error"]["message"].startswith(said)


async def test_errors_are_googles_but_the_models_overload_is_anthropics(
    mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    provider, url = mock
    token = await issued_token(mock, tmp_path)
    body = {"anthropic_version": "vertex-2023-10-16", "max_tokens": 5, "messages": []}
    seen = {}
    async with httpx.AsyncClient(base_url=url) as client:
        for status in (429, 529):
            provider.set_behaviour(EMAIL, Behaviour(status=status))
            answer = await client.post(
                PREDICT, json=body, headers={"authorization": f"Bearer {token}"}
            )
            seen[answer.status_code] = answer.json()
    assert seen[429]["error"]["status"] == "RESOURCE_EXHAUSTED"
    assert seen[529]["error"]["type"] == "overloaded_error"


async def test_the_vertex_face_is_set_over_http_too(mock: tuple[MockProvider, str]) -> None:
    provider, url = mock
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    async with httpx.AsyncClient(base_url=url) as client:
        trusted = await client.put(f"/_mock/vertex/keys/{EMAIL}", content=public)
        timed = await client.put(
            "/_mock/vertex", json={"token_lifetime_secs": 120, "token_delay_secs": 0.5}
        )
        bad = await client.put("/_mock/vertex", json={"token_delay_secs": -1})
    assert (trusted.status_code, timed.status_code, bad.status_code) == (204, 204, 400)
    assert (provider.vertex.token_lifetime_secs, provider.vertex.token_delay_secs) == (120, 0.5)


async def test_a_grant_that_is_not_a_jwt_assertion_is_refused(
    mock: tuple[MockProvider, str],
) -> None:
    async with httpx.AsyncClient(base_url=mock[1]) as client:
        wrong = await client.post("/token", data={"grant_type": "password"})
        garbled = await client.post(
            "/token",
            data={
                "grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer",
                "assertion": "a.b.c",
            },
        )
    assert (wrong.status_code, wrong.json()["error"]) == (400, "unsupported_grant_type")
    assert (garbled.status_code, garbled.json()["error"]) == (400, "invalid_grant")
    assert json.dumps(garbled.json())  # a JSON answer, as google-auth reads it
