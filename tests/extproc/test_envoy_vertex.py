"""Vertex accounts through a real Envoy 1.40 and the processor, the official Anthropic SDK as
the client and the mock provider's Vertex face as the upstream: its token endpoint issues a
token for a JWT signed with a key generated here, and its rawPredict paths take only a token
it issued.

The example's envoy.yaml with a `vertex` cluster whose cloud filter (nearest the codec) puts
each attempt in Vertex's envelope with its account's token (`clouds.google_token`) and maps
Vertex's Google-shaped errors to the Anthropic API's.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
import pytest_asyncio

from conftest import Metrics
from envoy_rig import Rig, StartRig
from extproc_helpers import with_cloud_cluster
from sdk_calls import anthropic_message
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour, MockProvider
from vertex_accounts import EMAIL, service_account_file

pytest.importorskip("google.auth")
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
VERTEX_NAME = "claude-opus-5@20260101"
VERTEX_PATH = (
    f"/v1/projects/my-project/locations/us-east5/publishers/anthropic/models/{VERTEX_NAME}:"
)
HAIKU_NAME = "claude-haiku-5@20261101"
"""The good account's own name for `claude-haiku-5` (the revoked one has another)."""
REQUEST: dict[str, Any] = {
    "model": "claude-opus-5",
    "max_tokens": 50,
    "messages": [{"role": "user", "content": "hi"}],
}


OTHER_EMAIL = "other@my-project.iam.gserviceaccount.com"
"""The second good account's service account (its key trusted too)."""
OTHER_NAME = "claude-opus-5@20260202"
"""The second good account's own name for `claude-opus-5`."""
HEDGE_SECS = 0.4
LATE_SECS = 2.5


def config_text(
    mock_url: str, key_file: Path, revoked_file: Path, other_file: Path, *, hedge: bool = False
) -> str:
    """`gcp-revoked` first (its key is not trusted by the mock's token endpoint), `gcp`
    second: both serve `claude-opus-5` on the `vertex` cluster, and `claude-haiku-5` each
    under a version name of its own. `hedge`: `[server] envoy_hedge` on and, in their place,
    `gcp` first and `gcp-other` (`other_file`'s service account, `claude-opus-5` under its
    own version name) second, both hedging after HEDGE_SECS without content."""
    if hedge:
        return _hedging(mock_url, key_file, other_file)
    return f"""
[llm_clients.gcp-revoked]
kind = "vertex"
base_url = "{mock_url}"
vertex = {{ project = "my-project", region = "us-east5", credentials_file = "{revoked_file}" }}
models = {{ "claude-opus-5" = "{VERTEX_NAME}", "claude-haiku-5" = "claude-haiku-5@20261001" }}
failure_threshold = 1000
envoy_cluster = "vertex"

[llm_clients.gcp]
kind = "vertex"
base_url = "{mock_url}"
vertex = {{ project = "my-project", region = "us-east5", credentials_file = "{key_file}" }}
models = {{ "claude-opus-5" = "{VERTEX_NAME}", "claude-haiku-5" = "{HAIKU_NAME}" }}
failure_threshold = 1000
priority = 1
envoy_cluster = "vertex"
"""


def _hedging(mock_url: str, key_file: Path, other_file: Path) -> str:
    accounts = [("gcp", key_file, VERTEX_NAME), ("gcp-other", other_file, OTHER_NAME)]
    return "[server]\nenvoy_hedge = true\nhedge_max_ratio = 1.0\n" + "".join(
        f"""
[llm_clients.{name}]
kind = "vertex"
base_url = "{mock_url}"
vertex = {{ project = "my-project", region = "us-east5", credentials_file = "{file}" }}
models = {{ "claude-opus-5" = "{model}" }}
failure_threshold = 1000
priority = {priority}
hedge_after_secs = {HEDGE_SECS}
envoy_cluster = "vertex"
"""
        for priority, (name, file, model) in enumerate(accounts)
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(
    start_rig: StartRig,
    mock_server: tuple[MockProvider, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Rig]:
    """The example's Envoy with a `vertex` cloud cluster; the accounts' key files made here,
    the good one's key trusted by the mock's token endpoint."""
    mock, mock_url = mock_server
    keys = tmp_path_factory.mktemp("keys")
    key_file = service_account_file(keys, mock, mock_url)
    revoked = service_account_file(
        keys, None, mock_url, email="revoked@my-project.iam.gserviceaccount.com"
    )
    other = service_account_file(keys, mock, mock_url, email=OTHER_EMAIL)
    vertex = functools.partial(with_cloud_cluster, name="vertex")
    text = functools.partial(config_text, key_file=key_file, revoked_file=revoked, other_file=other)
    async with start_rig(text, {}, edit=vertex) as rig:
        yield rig


@pytest_asyncio.fixture(loop_scope="module")
async def client(rig: Rig) -> AsyncIterator[Any]:
    # Behaviours and records only: the tokens issued and the trusted key stay, as at Google.
    rig.mock.reset_behaviours()
    rig.mock.clear_requests()
    rig.install(rig.config_text(rig.mock_url))
    sdk = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    try:
        yield sdk
    finally:
        await sdk.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refused_token_fails_over_to_the_vertex_account_whose_token_is_good(
    rig: Rig, client: Any, stream: bool
) -> None:
    """The revoked account's token request is refused: the cloud filter answers its attempt
    with a 401 in the API's shape (as the forwarding app does), which the route retries on
    the next account of the cluster, whose token the mock's Vertex face accepts."""
    if stream:
        async with client.messages.stream(**REQUEST) as events:
            types = [event.type async for event in events]
            message = await events.get_final_message()
            headers = events.response.headers
        assert types[0] == "message_start"
        assert types[-1] == "message_stop"
    else:
        raw = await client.messages.with_raw_response.create(**REQUEST)
        message, headers = await raw.parse(), raw.headers
    assert message.model == "claude-opus-5"
    assert message.content[0].text
    assert headers["x-switchyard-account"] == "gcp"
    verb = "streamRawPredict" if stream else "rawPredict"
    # The revoked account never reached the model: its token request was refused.
    assert [(r.key, r.path) for r in rig.mock.requests] == [(EMAIL, VERTEX_PATH + verb)]
    [call] = rig.mock.requests
    assert "x-api-key" not in call.headers
    assert b'"anthropic_version":"vertex-2023-10-16"' in call.body
    assert b'"model"' not in call.body


async def test_a_retry_to_a_vertex_account_goes_under_its_own_model_name(
    rig: Rig, client: Any
) -> None:
    """The retry's rawPredict path names the good account's own version of the model, and the
    SDK reads the public name."""
    raw = await client.messages.with_raw_response.create(**{**REQUEST, "model": "claude-haiku-5"})
    message = await raw.parse()
    assert message.model == "claude-haiku-5"
    assert raw.headers["x-switchyard-account"] == "gcp"
    haiku_path = VERTEX_PATH.replace(VERTEX_NAME, HAIKU_NAME) + "rawPredict"
    assert [(r.key, r.path) for r in rig.mock.requests] == [(EMAIL, haiku_path)]


async def test_a_vertex_error_reaches_the_sdk_in_the_anthropic_shape(rig: Rig, client: Any) -> None:
    rig.mock.set_behaviour(EMAIL, Behaviour(status=429, headers={}))
    with pytest.raises(anthropic.RateLimitError) as info:
        await client.messages.create(**REQUEST)
    body = info.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error"
    assert body["error"]["message"].startswith("Vertex AI: RESOURCE_EXHAUSTED: ")


SLOW = {
    "json": Behaviour(headers_delay_secs=LATE_SECS),
    "stream": Behaviour(stall_after_chunks=0, body_stall_secs=LATE_SECS),
}
"""A Vertex answer whose content comes LATE_SECS late: a JSON answer's headers (it comes when
ready), a stream's first content event after its headers and opening events."""


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_slow_vertex_answer_is_hedged_on_the_next_account_with_its_own_token(
    rig: Rig, client: Any, otel_metrics: Metrics, stream: bool
) -> None:
    """Envoy's `hedge_policy` on the Vertex cluster: the hedge's try goes out with the
    hedge's account's token (its service account, as the mock's token endpoint issued it)
    and under its own version name, not as the first try's, and it answers first."""
    policies = rig.install(rig.config_text(rig.mock_url, hedge=True))
    won = otel_metrics.value(tm.HEDGES, result="won")
    rig.mock.set_behaviour(EMAIL, SLOW["stream" if stream else "json"])
    started = time.monotonic()
    message, headers = await anthropic_message(client, REQUEST, stream)
    elapsed = time.monotonic() - started
    assert message.content[0].text
    assert message.model == "claude-opus-5"
    assert headers["x-switchyard-account"] == "gcp-other"
    assert headers["x-switchyard-attempts"] == "2"
    assert elapsed < LATE_SECS  # the hedge's answer, not the first try's
    verb = "streamRawPredict" if stream else "rawPredict"
    assert [(r.key, r.path) for r in rig.mock.requests] == [
        (EMAIL, VERTEX_PATH + verb),
        (OTHER_EMAIL, VERTEX_PATH.replace(VERTEX_NAME, OTHER_NAME) + verb),
    ]
    assert all(b'"anthropic_version":"vertex-2023-10-16"' in r.body for r in rig.mock.requests)
    assert otel_metrics.value(tm.HEDGES, result="won") == won + 1
    assert policies.pool.status_of("gcp", model="claude-opus-5").consecutive_faults == 0
