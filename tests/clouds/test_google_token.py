"""A Vertex account's token against the mock's token endpoint (uvicorn): signed assertion,
cached until near expiry, refreshed beside the requests, and a clear error within the bound
when the endpoint refuses or does not answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers import free_port, serve_in_thread
from switchyard_mw.clouds.google_token import REFRESH_AHEAD_SECS, GoogleToken
from switchyard_mw.config import VertexSettings
from switchyard_mw.errors import CloudCredentialError
from switchyard_mw.testing import MockProvider
from vertex_accounts import EMAIL, service_account_file

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture(autouse=True)
def clean(mock: tuple[MockProvider, str]) -> None:
    mock[0].reset()


def token_source(path: Path, timeout: float = 5.0) -> GoogleToken:
    settings = VertexSettings(
        project="my-project",
        region="us-east5",
        credentials_file=str(path),
        token_timeout_secs=timeout,
    )
    return GoogleToken("gcp", settings)


async def test_the_token_is_fetched_once_and_cached(
    mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    provider, url = mock
    source = token_source(service_account_file(tmp_path, provider, url))
    tokens = {await source.token() for _ in range(5)}
    tokens |= set(await asyncio.gather(*(source.token() for _ in range(20))))
    assert len(tokens) == 1
    (token,) = tokens
    assert provider.vertex.holder(token) is not None
    assert provider.vertex.token_requests == 1
    assert token not in repr(source)


async def test_concurrent_first_requests_share_one_token_request(
    mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    provider, url = mock
    provider.vertex.token_delay_secs = 0.2
    source = token_source(service_account_file(tmp_path, provider, url))
    tokens = await asyncio.gather(*(source.token() for _ in range(10)))
    assert len(set(tokens)) == 1
    assert provider.vertex.token_requests == 1


async def test_near_expiry_the_old_token_serves_while_a_new_one_is_fetched_beside(
    mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    provider, url = mock
    provider.vertex.token_lifetime_secs = int(REFRESH_AHEAD_SECS) - 60  # "near" from the start
    source = token_source(service_account_file(tmp_path, provider, url))
    first = await source.token()
    provider.vertex.token_delay_secs = 0.5  # a slow endpoint: the request must not wait for it
    started = time.monotonic()
    again = await source.token()
    assert time.monotonic() - started < 0.4  # the endpoint takes 0.5 s: it was not waited for
    assert again == first
    for _ in range(50):  # the refresh beside it lands
        await asyncio.sleep(0.05)
        if await source.token() != first:
            break
    assert await source.token() != first
    assert provider.vertex.token_requests == 2


async def test_a_failed_refresh_beside_the_requests_is_not_retried_on_every_request(
    mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    provider, url = mock
    provider.vertex.token_lifetime_secs = int(REFRESH_AHEAD_SECS) - 60
    source = token_source(service_account_file(tmp_path, provider, url))
    first = await source.token()
    provider.vertex.distrust(EMAIL)  # the key is revoked: refreshes are refused
    for _ in range(20):
        assert await source.token() == first  # still good for minutes: still used
        await asyncio.sleep(0.01)
    assert provider.vertex.token_requests == 2  # the first, and one refused refresh


async def test_a_token_endpoint_that_does_not_answer_is_an_error_naming_the_account_in_time(
    mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    provider, url = mock
    provider.vertex.token_delay_secs = 5.0
    source = token_source(service_account_file(tmp_path, provider, url), timeout=0.5)
    started = time.monotonic()
    with pytest.raises(CloudCredentialError) as info:
        await source.token()
    waited = time.monotonic() - started
    assert 0.5 <= waited < 1.0
    assert info.value.account == "gcp"
    assert info.value.refused is False
    assert str(info.value) == f"account 'gcp': {url}/token did not answer within 0.5 s"


async def test_a_key_the_endpoint_does_not_trust_is_a_refusal(
    mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    url = mock[1]
    source = token_source(service_account_file(tmp_path, None, url))  # key never trusted
    with pytest.raises(CloudCredentialError) as info:
        await source.token()
    assert info.value.refused is True
    assert "invalid_grant" in str(info.value)
    assert str(info.value).startswith("account 'gcp': the token endpoint refused")
    assert "PRIVATE KEY" not in str(info.value)


async def test_an_unreachable_token_endpoint_fails_at_once(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    source = token_source(service_account_file(tmp_path, None, url), timeout=2.0)
    started = time.monotonic()
    with pytest.raises(CloudCredentialError) as info:
        await source.token()
    assert time.monotonic() - started < 2.5
    assert info.value.refused is False
    assert str(info.value).startswith("account 'gcp': ")


@pytest.fixture
def no_ambient_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No key file, gcloud login or metadata server to find but what a test sets (the
    metadata server's address is a closed loopback port: nothing leaves the machine)."""
    closed = f"127.0.0.1:{free_port()}"
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("GCE_METADATA_HOST", closed)
    monkeypatch.setenv("GCE_METADATA_IP", closed)


@pytest.mark.usefixtures("no_ambient_credentials")
async def test_application_default_credentials_find_the_key_file_google_names(
    mock: tuple[MockProvider, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider, url = mock
    key_file = service_account_file(tmp_path, provider, url)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key_file))
    settings = VertexSettings(project="my-project", region="us-east5")  # no credentials_file
    token = await GoogleToken("gcp", settings).token()
    assert provider.vertex.holder(token) == EMAIL


@pytest.mark.usefixtures("no_ambient_credentials")
async def test_no_application_default_credentials_is_an_error_naming_the_account() -> None:
    settings = VertexSettings(project="my-project", region="us-east5", token_timeout_secs=3.0)
    started = time.monotonic()
    with pytest.raises(CloudCredentialError) as info:
        await GoogleToken("gcp", settings).token()
    assert time.monotonic() - started < 3.5
    assert info.value.refused is False
    assert str(info.value).startswith("account 'gcp': no application-default credentials found")


async def test_credentials_found_nowhere_at_once_say_the_same_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # google-auth may give up before the bound (no metadata server to wait for): the
    # operator reads the same cause as when the search runs out of time.
    import google.auth

    def nowhere(**_: object) -> None:
        raise google.auth.exceptions.DefaultCredentialsError(
            "Your default credentials were not found."
        )

    monkeypatch.setattr(google.auth, "default", nowhere)
    settings = VertexSettings(project="my-project", region="us-east5", token_timeout_secs=3.0)
    with pytest.raises(CloudCredentialError) as info:
        await GoogleToken("gcp", settings).token()
    assert info.value.refused is False
    assert str(info.value) == (
        "account 'gcp': no application-default credentials found: "
        "Your default credentials were not found."
    )
