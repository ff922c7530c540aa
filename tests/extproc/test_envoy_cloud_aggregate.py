"""A cloud account inside an aggregate cluster under a real Envoy 1.40: failover across
providers where one provider is Bedrock, with the official Anthropic SDK and the mock's Bedrock
face (which re-signs every request with botocore and refuses a mismatch).

The example's envoy.yaml with a `bedrock` cloud cluster and an aggregate over it and the
example's `mock` cluster (`[server] envoy_failover`). An aggregate runs its own upstream
filters, so it carries the cloud cluster's, the cloud filter among them: for an attempt Envoy
sends to the API provider's cluster that filter changes nothing, and for one on Bedrock it
re-envelopes and signs.
"""

from __future__ import annotations

import copy
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
import yaml

from envoy_rig import Rig, StartRig
from extproc_helpers import with_cloud_cluster
from sdk_calls import anthropic_message
from switchyard_mw.testing import Behaviour, MockProvider

pytest.importorskip("botocore")
from switchyard_mw.testing._bedrock_face import (
    MOCK_AWS_ACCESS_KEY_ID,
    MOCK_AWS_SECRET_ACCESS_KEY,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
SONNET_ID = "anthropic.claude-sonnet-5-v1:0"
AGGREGATE = "bedrock-then-mock"
REQUEST: dict[str, Any] = {
    "model": "claude-sonnet-5",
    "max_tokens": 50,
    "messages": [{"role": "user", "content": "hi"}],
}


def config_text(mock_url: str) -> str:
    """`claude-sonnet-5` on Bedrock first, then on the API account of the `mock` cluster."""
    return f"""
[server.envoy_failover]
"{AGGREGATE}" = ["bedrock", "mock"]

[llm_clients.aws]
kind = "bedrock"
base_url = "{mock_url}"
bedrock = {{ region = "us-east-1" }}
models = {{ "claude-sonnet-5" = "{SONNET_ID}" }}
failure_threshold = 100
envoy_cluster = "bedrock"

[llm_clients.api]
base_url = "{mock_url}"
api_key_env = "KEY_API"
auth = "x-api-key"
models = ["claude-sonnet-5"]
priority = 1
failure_threshold = 100
envoy_cluster = "mock"
"""


def with_cloud_aggregate(envoy_yaml: str) -> str:
    """The example's config with the `bedrock` cloud cluster and the aggregate over it and
    `mock`, whose upstream filters are the cloud cluster's (the cloud filter's included)."""
    config = yaml.safe_load(with_cloud_cluster(envoy_yaml, name="bedrock"))
    clusters = config["static_resources"]["clusters"]
    [cloud] = [c for c in clusters if c["name"] == "bedrock"]
    [aggregate] = [copy.deepcopy(c) for c in clusters if c["name"] == "mock-then-other"]
    aggregate["name"] = AGGREGATE
    aggregate["cluster_type"]["typed_config"]["clusters"] = ["bedrock", "mock"]
    aggregate["typed_extension_protocol_options"] = copy.deepcopy(
        cloud["typed_extension_protocol_options"]
    )
    clusters.append(aggregate)
    return str(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def aws_env() -> Iterator[None]:
    """The processor's AWS chain: the mock's test key in its environment, nothing else."""
    env = {
        "KEY_API": "key-api",
        "AWS_ACCESS_KEY_ID": MOCK_AWS_ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": MOCK_AWS_SECRET_ACCESS_KEY,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        patch.delenv("AWS_SESSION_TOKEN", raising=False)
        patch.delenv("AWS_PROFILE", raising=False)
        yield


@pytest.fixture(scope="module")
def mock_provider() -> MockProvider:
    return MockProvider(aws_credentials={MOCK_AWS_ACCESS_KEY_ID: MOCK_AWS_SECRET_ACCESS_KEY})


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig, aws_env: None) -> AsyncIterator[Rig]:
    async with start_rig(config_text, os.environ, edit=with_cloud_aggregate, admin=True) as rig:
        yield rig


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_bedrock_throttled_fails_over_to_the_api_provider_in_the_request(
    rig: Rig, client: Any, stream: bool
) -> None:
    """Bedrock's ThrottlingException (a 429 once mapped): Envoy sends the retry to the
    aggregate's next cluster, where the API account serves with its own key, unsigned."""
    rig.mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, Behaviour(status=429))
    before = rig.sent_to()
    message, headers = await anthropic_message(client, REQUEST, stream)
    assert message.content[0].text
    assert message.model == "claude-sonnet-5"
    assert headers["x-switchyard-account"] == "api"
    assert headers["x-switchyard-attempts"] == "2"
    first, second = rig.mock.requests
    assert (first.key, first.path.split("/")[1:3]) == (MOCK_AWS_ACCESS_KEY_ID, ["model", SONNET_ID])
    assert (second.key, second.path) == ("key-api", "/v1/messages")
    assert "authorization" not in second.headers  # no Bedrock signature on the API's attempt
    after = rig.sent_to()
    assert (after["bedrock"] - before["bedrock"], after["mock"] - before["mock"]) == (1, 1)


async def test_bedrock_answering_serves_signed_through_the_aggregate(rig: Rig, client: Any) -> None:
    raw = await client.messages.with_raw_response.create(**REQUEST)
    assert (await raw.parse()).content[0].text
    assert raw.headers["x-switchyard-account"] == "aws"
    assert [r.key for r in rig.mock.requests] == [MOCK_AWS_ACCESS_KEY_ID]
