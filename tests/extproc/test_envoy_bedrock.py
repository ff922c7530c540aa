"""Bedrock accounts through a real Envoy 1.40 and the processor, the official Anthropic SDK as
the client and the mock provider's Bedrock face, which re-signs every request with botocore
and refuses any mismatch, as the upstream.

The example's envoy.yaml with one more cluster, `bedrock`: the example cluster's upstream
filters and the cloud filter (`x-switchyard-filter: cloud`) nearest the codec, which
re-envelopes and signs each attempt (the retry's with the retry's account), turns the event
stream into SSE and maps Bedrock's errors as the forwarding app does.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx
import pytest
import pytest_asyncio

from conftest import Metrics
from envoy_rig import Rig, StartRig
from extproc_helpers import with_cloud_cluster
from redis_server import until
from sdk_calls import anthropic_message
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour, MockProvider

pytest.importorskip("botocore")
from switchyard_mw.testing._bedrock_face import (
    MOCK_AWS_ACCESS_KEY_ID,
    MOCK_AWS_SECRET_ACCESS_KEY,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
OPUS_ID = "us.anthropic.claude-opus-5-v1:0"
SONNET_ID = "anthropic.claude-sonnet-5-v1:0"
HAIKU_US_ID = "us.anthropic.claude-haiku-5-v1:0"
HAIKU_EU_ID = "eu.anthropic.claude-haiku-5-v1:0"
"""`claude-haiku-5` under a cross-region profile of each account's own: a retry renames it."""
SECOND_KEY_ID = "AKIAMOCKBEDROCK00002"
SECOND_SECRET = "second/mock/secret"
REQUEST: dict[str, Any] = {
    "model": "claude-opus-5",
    "max_tokens": 50,
    "messages": [{"role": "user", "content": "hi"}],
}


HEDGE_SECS = 0.4
LATE_SECS = 2.5


def config_text(mock_url: str, *, hedge: bool = False, ratio: float = 1.0) -> str:
    """`claude-opus-5`: two Bedrock accounts; `claude-haiku-5`: the same two, each with a
    model id of its own; `claude-sonnet-5`: Bedrock first, then the API (on the example's
    `mock` cluster). `hedge`: `[server] envoy_hedge` on, both Bedrock accounts hedging after
    HEDGE_SECS without content (`ratio`: `hedge_max_ratio`)."""
    text = _accounts(mock_url)
    if not hedge:
        return text
    server = f"[server]\nenvoy_hedge = true\nhedge_max_ratio = {ratio}\n"
    hedging = f"failure_threshold = 100\nhedge_after_secs = {HEDGE_SECS}\n"
    return server + text.replace("failure_threshold = 100\n", hedging)


def _accounts(mock_url: str) -> str:
    return f"""
[llm_clients.aws]
kind = "bedrock"
base_url = "{mock_url}"
bedrock = {{ region = "us-east-1" }}
failure_threshold = 100
envoy_cluster = "bedrock"

[llm_clients.aws.models]
"claude-opus-5" = "{OPUS_ID}"
"claude-sonnet-5" = "{SONNET_ID}"
"claude-haiku-5" = "{HAIKU_US_ID}"

[llm_clients.api]
base_url = "{mock_url}"
api_key_env = "KEY_API"
auth = "x-api-key"
models = ["claude-sonnet-5"]
priority = 1
envoy_cluster = "mock"

[llm_clients.aws-second]
kind = "bedrock"
base_url = "{mock_url}"
bedrock = {{ region = "us-west-2", profile = "second" }}
models = {{ "claude-opus-5" = "{OPUS_ID}", "claude-haiku-5" = "{HAIKU_EU_ID}" }}
priority = 1
failure_threshold = 100
envoy_cluster = "bedrock"
"""


@pytest.fixture(scope="module")
def aws_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The processor's AWS chain: the test key in its environment, the second in a shared
    credentials file; nothing of this machine's."""
    tmp = tmp_path_factory.mktemp("aws")
    (tmp / "credentials").write_text(
        f"[second]\naws_access_key_id = {SECOND_KEY_ID}\naws_secret_access_key = {SECOND_SECRET}\n"
    )
    env = {
        "KEY_API": "key-api",
        "AWS_ACCESS_KEY_ID": MOCK_AWS_ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": MOCK_AWS_SECRET_ACCESS_KEY,
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "credentials"),
        "AWS_CONFIG_FILE": str(tmp / "config"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        patch.delenv("AWS_SESSION_TOKEN", raising=False)
        patch.delenv("AWS_PROFILE", raising=False)
        yield


@pytest.fixture(scope="module")
def mock_provider() -> MockProvider:
    return MockProvider(
        aws_credentials={
            MOCK_AWS_ACCESS_KEY_ID: MOCK_AWS_SECRET_ACCESS_KEY,
            SECOND_KEY_ID: SECOND_SECRET,
        }
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(start_rig: StartRig, aws_env: None) -> AsyncIterator[Rig]:
    """The example's Envoy with a `bedrock` cloud cluster; the accounts read this process's
    environment (`aws_env`)."""
    bedrock = functools.partial(with_cloud_cluster, name="bedrock")
    async with start_rig(config_text, os.environ, edit=bedrock) as rig:
        yield rig


async def test_a_bedrock_json_answer_signed_and_verified(rig: Rig, client: Any) -> None:
    raw = await client.messages.with_raw_response.create(**REQUEST)
    message = await raw.parse()
    assert raw.headers["x-switchyard-account"] == "aws"
    assert message.model == "claude-opus-5"
    assert message.content[0].text
    assert message.usage.output_tokens > 0
    [call] = rig.mock.requests
    assert call.path == f"/model/{OPUS_ID}/invoke"
    assert call.key == MOCK_AWS_ACCESS_KEY_ID  # its signature verified by the mock
    assert "x-api-key" not in call.headers  # the caller's key never leaves
    assert b'"anthropic_version":"bedrock-2023-05-31"' in call.body
    assert b'"model"' not in call.body
    assert int(call.headers["content-length"]) == len(call.body)


async def test_a_bedrock_stream_reaches_the_sdk_as_sse(rig: Rig, client: Any) -> None:
    rig.mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, Behaviour(chunks=3, chunk_interval_secs=0.1))
    async with client.messages.stream(**REQUEST) as events:
        types = [event.type async for event in events]
        message = await events.get_final_message()
        content_type = events.response.headers["content-type"]
    assert content_type.startswith("text/event-stream")
    assert types[0] == "message_start"
    assert types[-1] == "message_stop"
    assert message.model == "claude-opus-5"
    assert message.content[0].text
    assert message.stop_reason == "end_turn"
    [call] = rig.mock.requests
    assert call.path == f"/model/{OPUS_ID}/invoke-with-response-stream"
    assert call.key == MOCK_AWS_ACCESS_KEY_ID


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("status", "why"),
    [(429, "ThrottlingException"), (404, "ResourceNotFoundException: a 502 after mapping")],
)
async def test_a_bedrock_refusal_fails_over_to_the_next_account_signed_anew(
    rig: Rig, client: Any, stream: bool, status: int, why: str
) -> None:
    """Bedrock's 404 ResourceNotFoundException is mapped to a 502 (the model is not offered
    to this account) before the refusal filter's matcher reads the status, so it fails over
    as through the forwarding app; a 404 as such would go to the client."""
    rig.mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, Behaviour(status=status))
    message, headers = await anthropic_message(client, REQUEST, stream)
    account = headers["x-switchyard-account"]
    assert message.content[0].text, why
    assert account == "aws-second"
    assert [r.key for r in rig.mock.requests] == [MOCK_AWS_ACCESS_KEY_ID, SECOND_KEY_ID]
    assert all(r.path.startswith(f"/model/{OPUS_ID}/invoke") for r in rig.mock.requests)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_retry_to_a_bedrock_account_goes_under_its_own_model_id(
    rig: Rig, client: Any, stream: bool
) -> None:
    """The retry's path and signature carry the second account's model id (its own
    cross-region profile), and the SDK reads the public name."""
    rig.mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, Behaviour(status=429))
    request = {**REQUEST, "model": "claude-haiku-5"}
    message, headers = await anthropic_message(client, request, stream)
    account = headers["x-switchyard-account"]
    assert message.content[0].text
    assert message.model == "claude-haiku-5"
    assert account == "aws-second"
    assert [(r.key, r.path.split("/")[2]) for r in rig.mock.requests] == [
        (MOCK_AWS_ACCESS_KEY_ID, HAIKU_US_ID),
        (SECOND_KEY_ID, HAIKU_EU_ID),
    ]


async def test_the_last_bedrock_refusal_reaches_the_sdk_in_the_api_shape(
    rig: Rig, client: Any
) -> None:
    for key in (MOCK_AWS_ACCESS_KEY_ID, SECOND_KEY_ID):
        rig.mock.set_behaviour(key, Behaviour(status=429))
    with pytest.raises(anthropic.RateLimitError) as info:
        await client.messages.create(**REQUEST)
    assert info.value.status_code == 429
    body = info.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error"
    assert "ThrottlingException" in body["error"]["message"]
    assert len(rig.mock.requests) == 2


async def test_a_bedrock_exception_mid_stream_ends_the_sdks_stream_with_the_error_event(
    rig: Rig, client: Any
) -> None:
    """The event stream's `exception` message becomes Anthropic's `error` event (the first
    delta 0.3 s before it, so it reached the client first)."""
    fault = Behaviour(
        fail="error_mid_stream",
        stall_after_chunks=1,
        body_stall_secs=0.3,
        bedrock_exception="InternalServerException",
    )
    rig.mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, fault)
    text: list[str] = []

    async def read() -> None:
        async with client.messages.stream(**REQUEST) as events:
            async for chunk in events.text_stream:
                text.append(chunk)

    with pytest.raises(anthropic.APIStatusError) as raised:
        await read()
    assert text  # the first delta reached the client before the failure
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["error"]["type"] == "api_error"
    assert body["error"]["message"].startswith("Bedrock: internalServerException: ")


@pytest.mark.parametrize(
    ("exception", "status"),
    [("InternalServerException", "500"), ("ModelStreamErrorException", "502")],
)
async def test_a_bedrock_exception_mid_stream_is_charged_to_its_account(
    rig: Rig, client: Any, otel_metrics: Metrics, exception: str, status: str
) -> None:
    """As the forwarding app charges it: the attempt ends with its stream, a fault of the
    status the exception stands for (counted in `switchyard.account.faults`), not the success
    its headers said."""
    fault = Behaviour(
        fail="error_mid_stream",
        stall_after_chunks=1,
        body_stall_secs=0.3,
        bedrock_exception=exception,
    )
    rig.mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, fault)
    faults = {tm.ACCOUNT: "aws", "status": status}
    before = otel_metrics.value("switchyard.account.faults", **faults)
    text: list[str] = []

    async def read() -> None:
        async with client.messages.stream(**REQUEST) as events:
            async for chunk in events.text_stream:
                text.append(chunk)

    with pytest.raises(anthropic.APIStatusError) as raised:
        await read()
    assert text  # the stream had started at the client
    assert exception.lower() in str(raised.value.body).lower()
    pool = rig.policies.pool  # `aws` serves three models: a 5xx is its pair's fault
    await until(lambda: pool.status_of("aws", model="claude-opus-5").consecutive_faults == 1)
    assert otel_metrics.value("switchyard.account.faults", **faults) == before + 1
    assert [r.key for r in rig.mock.requests] == [MOCK_AWS_ACCESS_KEY_ID]


async def test_a_bedrock_exception_before_the_first_content_fails_over(
    rig: Rig, client: Any
) -> None:
    """Nothing of the stream reached the client yet (its headers are held to its first
    content): the next Bedrock account serves it, as through the forwarding app, and the
    first is charged its fault."""
    fault = Behaviour(
        fail="error_mid_stream", stall_after_chunks=0, bedrock_exception="InternalServerException"
    )
    rig.mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, fault)
    message, headers = await anthropic_message(client, REQUEST, True)
    assert message.content[0].text
    assert message.stop_reason == "end_turn"
    assert headers["x-switchyard-account"] == "aws-second"
    assert [r.key for r in rig.mock.requests] == [MOCK_AWS_ACCESS_KEY_ID, SECOND_KEY_ID]
    assert rig.policies.pool.status_of("aws", model="claude-opus-5").consecutive_faults == 1


async def test_a_bedrock_exception_before_content_on_every_account_ends_the_stream(
    rig: Rig, client: Any
) -> None:
    """Every Bedrock account's stream carries the exception before any content: the first
    fails over, the last one's error event ends the SDK's stream (nothing can follow it), and
    each account is charged its fault, as through the forwarding app."""
    fault = Behaviour(
        fail="error_mid_stream", stall_after_chunks=0, bedrock_exception="InternalServerException"
    )
    for key in (MOCK_AWS_ACCESS_KEY_ID, SECOND_KEY_ID):
        rig.mock.set_behaviour(key, fault)
    with pytest.raises(anthropic.APIStatusError) as raised:
        await anthropic_message(client, REQUEST, True)
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["error"]["type"] == "api_error"
    assert body["error"]["message"].startswith("Bedrock: internalServerException: ")
    assert [r.key for r in rig.mock.requests] == [MOCK_AWS_ACCESS_KEY_ID, SECOND_KEY_ID]
    pool = rig.policies.pool
    await until(
        lambda: (
            [
                pool.status_of(name, model="claude-opus-5").consecutive_faults
                for name in ("aws", "aws-second")
            ]
            == [1, 1]
        )
    )


async def test_another_wire_on_a_bedrock_account_is_refused_in_that_wire(rig: Rig) -> None:
    """Bedrock serves Claude on the Messages API only: an OpenAI Chat request routed to a
    Bedrock account is answered 404 in OpenAI's error shape, as the forwarding app answers
    it, and never reaches Bedrock."""
    rig.mock.reset()
    async with httpx.AsyncClient(base_url=rig.envoy_url, timeout=10) as http:
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": "claude-opus-5", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert answer.status_code == 404
    assert "Anthropic Messages API" in answer.json()["error"]["message"]
    assert rig.mock.requests == []


async def test_a_count_skips_bedrock_for_the_api_account_that_counts(rig: Rig, client: Any) -> None:
    """Bedrock has no token count: `claude-sonnet-5`'s first account is Bedrock's, so the
    processor routes the count to its API account's cluster, never to AWS."""
    messages: Any = [{"role": "user", "content": "hi"}]
    raw = await client.messages.with_raw_response.count_tokens(
        model="claude-sonnet-5", messages=messages
    )
    counted = await raw.parse()
    (record,) = rig.mock.requests
    assert (record.path, record.key) == ("/v1/messages/count_tokens", "key-api")
    assert counted.input_tokens == max(1, len(record.body) // 4)  # the mock's count
    assert raw.headers["x-switchyard-account"] == "api"


async def test_a_count_only_bedrock_serves_is_the_wires_404(rig: Rig, client: Any) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as info:
        await client.messages.count_tokens(model="claude-opus-5", messages=messages)
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert "bedrock account" in info.value.message
    assert rig.mock.requests == []


SLOW = {
    "json": lambda secs: Behaviour(headers_delay_secs=secs),
    "stream": lambda secs: Behaviour(stall_after_chunks=0, body_stall_secs=secs),
}
"""A Bedrock answer whose content comes `secs` late: a JSON answer's headers (it comes when
ready), a stream's first content event after its headers and opening events."""


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_slow_bedrock_answer_is_hedged_on_the_next_account_signed_as_it(
    rig: Rig, client: Any, otel_metrics: Metrics, stream: bool
) -> None:
    """Envoy's `hedge_policy` on the cloud cluster: the hedge's try is enveloped and signed
    by the cloud filter as the hedge's account (its key, its own model id), not as the first
    try's, and its event stream translated; it answers first."""
    policies = rig.configure(hedge=True)
    won = otel_metrics.value(tm.HEDGES, result="won")
    rig.mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, SLOW["stream" if stream else "json"](LATE_SECS))
    started = time.monotonic()
    message, headers = await anthropic_message(
        client, {**REQUEST, "model": "claude-haiku-5"}, stream
    )
    elapsed = time.monotonic() - started
    assert message.content[0].text
    assert message.model == "claude-haiku-5"
    assert headers["x-switchyard-account"] == "aws-second"
    assert headers["x-switchyard-attempts"] == "2"
    assert elapsed < LATE_SECS  # the hedge's answer, not the first try's
    assert [(r.key, r.path.split("/")[2]) for r in rig.mock.requests] == [
        (MOCK_AWS_ACCESS_KEY_ID, HAIKU_US_ID),
        (SECOND_KEY_ID, HAIKU_EU_ID),
    ]
    assert otel_metrics.value(tm.HEDGES, result="won") == won + 1
    assert policies.pool.status_of("aws", model="claude-haiku-5").consecutive_faults == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_with_no_hedge_budget_the_void_try_goes_out_unsigned(
    rig: Rig, client: Any, otel_metrics: Metrics, stream: bool
) -> None:
    """No budget: Envoy's second try still goes out, void (no key, no prompt), and the cloud
    filter passes it as it is, neither enveloped nor signed, rather than answering it itself
    (an upstream filter's answer would go straight to the client). Bedrock refuses it
    unsigned before reading it (the mock's face records no such request: measured, its 403
    `MissingAuthenticationTokenException`), the refusal is held, and the first try's answer
    is waited for."""
    rig.configure(hedge=True, ratio=0.0)
    refused = otel_metrics.value(tm.HEDGES, result="refused")
    rig.mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, SLOW["stream" if stream else "json"](1.2))
    message, headers = await anthropic_message(client, REQUEST, stream)
    assert message.content[0].text
    assert headers["x-switchyard-account"] == "aws"
    assert headers["x-switchyard-attempts"] == "1"
    assert otel_metrics.value(tm.HEDGES, result="refused") == refused + 1  # Envoy's second try
    verb = "invoke-with-response-stream" if stream else "invoke"
    [first] = rig.mock.requests
    assert (first.key, first.path) == (MOCK_AWS_ACCESS_KEY_ID, f"/model/{OPUS_ID}/{verb}")


RACES = {
    "the hedge's InternalServerException": ("hedge", "InternalServerException", "500", 1),
    "the hedge's ThrottlingException": ("hedge", "ThrottlingException", "429", 0),
    "the first's ModelStreamErrorException": ("first", "ModelStreamErrorException", "502", 1),
}
"""Which try's stream carries which exception before its content while the two race, the
status it stands for and the faults it charges its account."""
TRIES = {"first": (MOCK_AWS_ACCESS_KEY_ID, "aws"), "hedge": (SECOND_KEY_ID, "aws-second")}
"""Each try's key and account."""


@pytest.mark.parametrize(
    ("erring", "exception", "status", "fault"), RACES.values(), ids=RACES.keys()
)
async def test_a_bedrock_exception_in_a_racing_try_before_content_loses_it_the_race(
    rig: Rig,
    client: Any,
    otel_metrics: Metrics,
    erring: str,
    exception: str,
    status: str,
    fault: int,
) -> None:
    """One try's event stream carries Bedrock's exception before any content while the other
    (its content 1.2 s after its headers) still races: that try loses, charged to its own
    account (the status the exception stands for: a 5xx a fault, a 429 a throttle), and the
    other's answer reaches the SDK, as through the forwarding app's race."""
    policies = rig.configure(hedge=True)
    other = "first" if erring == "hedge" else "hedge"
    (key, account), (other_key, served) = TRIES[erring], TRIES[other]
    result = "lost" if erring == "hedge" else "won"
    hedges = otel_metrics.value(tm.HEDGES, result=result)
    faults = {tm.ACCOUNT: account, "status": status}
    charged = otel_metrics.value("switchyard.account.faults", **faults)
    after = HEDGE_SECS * 2 if erring == "first" else 0.0  # the first's, once the hedge races
    rig.mock.set_behaviour(
        key,
        Behaviour(
            fail="error_mid_stream",
            stall_after_chunks=0,
            body_stall_secs=after,
            bedrock_exception=exception,
        ),
    )
    rig.mock.set_behaviour(other_key, SLOW["stream"](1.2))
    message, headers = await anthropic_message(client, REQUEST, True)
    assert message.content[0].text
    assert message.stop_reason == "end_turn"
    assert headers["x-switchyard-account"] == served
    assert headers["x-switchyard-attempts"] == "2"
    assert [r.key for r in rig.mock.requests] == [MOCK_AWS_ACCESS_KEY_ID, SECOND_KEY_ID]
    assert otel_metrics.value(tm.HEDGES, result=result) == hedges + 1
    pool = policies.pool
    assert pool.status_of(account, model="claude-opus-5").consecutive_faults == fault
    assert otel_metrics.value("switchyard.account.faults", **faults) == charged + fault
    assert pool.status_of(served, model="claude-opus-5").consecutive_faults == 0
