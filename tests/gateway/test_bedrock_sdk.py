"""Claude through Amazon Bedrock in the example gateway (uvicorn), the official Anthropic SDK
as the client, the mock provider's Anthropic and Bedrock faces as the upstreams.

An api account and a bedrock account give the client the same answers (JSON and streams, text
and tool use, usage); a request fails over from the API to Bedrock under a 5xx, a 429, a
credential refusal and a stream cut before its first token, and from Bedrock to the API under
Bedrock's own throttle, ModelNotReady and a refused signature.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from servers import example_gateway, metric_value, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider
from switchyard_mw.testing._bedrock_face import (
    MOCK_AWS_ACCESS_KEY_ID,
    MOCK_AWS_SECRET_ACCESS_KEY,
)

pytestmark = pytest.mark.integration
pytest.importorskip("botocore")

OPUS_ID = "us.anthropic.claude-opus-5-v1:0"
SONNET_ID = "anthropic.claude-sonnet-5-v1:0"
SECOND_KEY_ID = "AKIAMOCKBEDROCK00002"
SECOND_SECRET = "second/mock/secret"
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]


def config(mock_url: str, *, with_bedrock: bool = True) -> str:
    """`claude-opus-5`: the API first, Bedrock second; `claude-sonnet-5`: the other way round
    (a second Bedrock account, on its own profile's key, so each has its own behaviour)."""
    text = f"""
[llm_clients.api]
base_url = "{mock_url}"
api_key_env = "KEY_API"
auth = "x-api-key"
models = ["claude-opus-5"]
failure_threshold = 100
timeout_secs = 1.0

[llm_clients.api-second]
base_url = "{mock_url}"
api_key_env = "KEY_API_SECOND"
auth = "x-api-key"
models = ["claude-sonnet-5"]
priority = 1
"""
    if with_bedrock:
        text += f"""
[llm_clients.aws]
kind = "bedrock"
base_url = "{mock_url}"
bedrock = {{ region = "us-east-1" }}
models = {{ "claude-opus-5" = "{OPUS_ID}" }}
priority = 1

[llm_clients.aws-first]
kind = "bedrock"
base_url = "{mock_url}"
bedrock = {{ region = "us-west-2", profile = "second" }}
models = {{ "claude-sonnet-5" = "{SONNET_ID}" }}
failure_threshold = 100
timeout_secs = 1.0
"""
    return text


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProvider]:
    provider = MockProvider(
        aws_credentials={
            MOCK_AWS_ACCESS_KEY_ID: MOCK_AWS_SECRET_ACCESS_KEY,
            SECOND_KEY_ID: SECOND_SECRET,
        }
    )
    with serve_in_thread(provider) as url:
        provider.url = url  # type: ignore[attr-defined]
        yield provider


def _aws_env(tmp: Path) -> dict[str, str]:
    """The AWS chain of the gateway's process: the test key in its environment, the second
    in a shared credentials file; nothing of this machine's."""
    (tmp / "credentials").write_text(
        f"[second]\naws_access_key_id = {SECOND_KEY_ID}\naws_secret_access_key = {SECOND_SECRET}\n"
    )
    return {
        "KEY_API": "key-api",
        "KEY_API_SECOND": "key-api-second",
        "AWS_ACCESS_KEY_ID": MOCK_AWS_ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": MOCK_AWS_SECRET_ACCESS_KEY,
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "credentials"),
        "AWS_CONFIG_FILE": str(tmp / "config"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@pytest.fixture(scope="module")
def gateway(mock: MockProvider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("gw")
    with example_gateway(config(mock.url), tmp, _aws_env(tmp)) as url:  # type: ignore[attr-defined]
        yield url


@pytest.fixture
def fresh_gateway(mock: MockProvider, tmp_path: Path) -> Iterator[str]:
    """A gateway of its own, for a fault that leaves an account cooled or held after it (a
    credential refusal cools the account for every model; a 429's retry time holds it)."""
    with example_gateway(config(mock.url), tmp_path, _aws_env(tmp_path)) as url:  # type: ignore[attr-defined]
        yield url


@pytest.fixture(scope="module")
def api_only(mock: MockProvider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("gw-api")
    env = _aws_env(tmp)
    with example_gateway(config(mock.url, with_bedrock=False), tmp, env) as url:  # type: ignore[attr-defined]
        yield url


@pytest.fixture(autouse=True)
def clean_mock(mock: MockProvider) -> None:
    mock.reset()


def _request(tools: bool) -> dict[str, Any]:
    request: dict[str, Any] = {
        "model": "claude-opus-5",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    }
    if tools:
        request["tools"] = TOOLS
    return request


def _same(dumped: Any) -> Any:
    """Random ids set aside, and input token counts: the mock counts request bytes / 4, and
    Bedrock's envelope is not the API's (`anthropic_version` for `model`)."""
    text = re.sub(r"'(msg|toolu)_[0-9A-Za-z]+'", r"'\1_X'", repr(dumped))
    return re.sub(r"'input_tokens': \d+", "'input_tokens': N", text)


async def _ask(url: str, request: dict[str, Any], stream: bool) -> tuple[Any, dict[str, str]]:
    client = anthropic.AsyncAnthropic(base_url=url, api_key="caller", max_retries=0)
    try:
        if stream:
            async with client.messages.stream(**request) as events:
                seen = [event.model_dump() async for event in events]
                final = (await events.get_final_message()).model_dump()
                return (seen, final), dict(events.response.headers)
        raw = await client.messages.with_raw_response.create(**request)
        return (await raw.parse()).model_dump(), dict(raw.headers)
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tools", [False, True])
async def test_the_sdk_gets_the_same_answer_from_the_api_and_from_bedrock(
    gateway: str, api_only: str, mock: MockProvider, stream: bool, tools: bool
) -> None:
    request = _request(tools)
    from_api, api_headers = await _ask(api_only, request, stream)
    mock.set_behaviour("key-api", Behaviour(status=503))
    from_bedrock, headers = await _ask(gateway, request, stream)
    assert api_headers["x-switchyard-account"] == "api"
    assert headers["x-switchyard-account"] == "aws"
    assert headers["x-switchyard-model"] == "claude-opus-5"
    assert _same(from_bedrock) == _same(from_api)
    answer = from_bedrock[1] if stream else from_bedrock
    assert answer["model"] == "claude-opus-5"  # as Bedrock names it, as the API does
    assert answer["stop_reason"] == ("tool_use" if tools else "end_turn")
    assert answer["usage"]["output_tokens"] > 0
    assert answer["usage"]["input_tokens"] > 0
    bedrock_call = mock.requests[-1]
    assert (bedrock_call.key, bedrock_call.model, bedrock_call.stream) == (
        MOCK_AWS_ACCESS_KEY_ID,
        OPUS_ID,
        stream,
    )
    assert bedrock_call.path.startswith(f"/model/{OPUS_ID}/invoke")


async def test_bedrocks_usage_reaches_the_request_metrics(gateway: str, mock: MockProvider) -> None:
    mock.set_behaviour("key-api", Behaviour(status=503))
    labels = {"switchyard_account": "aws", "gen_ai_token_type": "output"}
    before = metric_value(gateway, "gen_ai_client_token_usage_sum", **labels)
    (_, final), _ = await _ask(gateway, _request(tools=False), stream=True)
    answer, _ = await _ask(gateway, _request(tools=False), stream=False)
    after = metric_value(gateway, "gen_ai_client_token_usage_sum", **labels)
    assert after - before == final["usage"]["output_tokens"] + answer["usage"]["output_tokens"]


API_FAULTS = [
    *(
        pytest.param(fault, lasting, stream, id=f"{name}-{'stream' if stream else 'json'}")
        for name, fault, lasting in [
            ("5xx", Behaviour(status=503), False),
            ("429", Behaviour(status=429), True),
            ("credential-refusal", Behaviour(status=401), True),
            ("cut-before-headers", Behaviour(fail="reset_before_headers"), False),
        ]
        for stream in (False, True)
    ),
    # Cut after the headers (and a stream's opening events) but before the first token: held
    # back until then, nothing has reached the client.
    *(
        pytest.param(
            Behaviour(fail="reset_mid_stream", stall_after_chunks=0),
            False,
            stream,
            id=f"cut-after-headers-{'stream' if stream else 'json'}",
        )
        for stream in (False, True)
    ),
]


@pytest.mark.parametrize(("fault", "lasting", "stream"), API_FAULTS)
async def test_api_to_bedrock_failover(
    request: pytest.FixtureRequest,
    mock: MockProvider,
    fault: Behaviour,
    lasting: bool,
    stream: bool,
) -> None:
    gateway = request.getfixturevalue("fresh_gateway" if lasting else "gateway")
    mock.set_behaviour("key-api", fault)
    answer, headers = await _ask(gateway, _request(tools=False), stream)
    final = answer[1] if stream else answer
    assert final["content"][0]["text"] == "Hello from the mock provider."
    assert headers["x-switchyard-account"] == "aws"
    assert headers["x-switchyard-attempts"] == "2"
    assert [r.key for r in mock.requests] == ["key-api", MOCK_AWS_ACCESS_KEY_ID]


BEDROCK_FAULTS = [
    # Bedrock sends no retry time with its throttle: nothing is held after it.
    pytest.param(Behaviour(status=429), False, id="ThrottlingException"),
    pytest.param(
        Behaviour(status=429, bedrock_exception="ModelNotReadyException"),
        False,
        id="ModelNotReady",
    ),
    pytest.param(Behaviour(status=503), False, id="ServiceUnavailable"),
    pytest.param(Behaviour(status=403), True, id="AccessDenied"),
]


@pytest.mark.parametrize(("fault", "lasting"), BEDROCK_FAULTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_bedrock_to_api_failover(
    request: pytest.FixtureRequest,
    mock: MockProvider,
    fault: Behaviour,
    lasting: bool,
    stream: bool,
) -> None:
    gateway = request.getfixturevalue("fresh_gateway" if lasting else "gateway")
    mock.set_behaviour(SECOND_KEY_ID, fault)
    sonnet = {**_request(tools=False), "model": "claude-sonnet-5"}
    answer, headers = await _ask(gateway, sonnet, stream)
    final = answer[1] if stream else answer
    assert final["model"] == "claude-sonnet-5"
    assert headers["x-switchyard-account"] == "api-second"
    assert [r.key for r in mock.requests] == [SECOND_KEY_ID, "key-api-second"]


@pytest.mark.parametrize(
    ("behaviour", "status", "error_type"),
    [
        (Behaviour(status=429), 429, "rate_limit_error"),
        (
            Behaviour(status=429, bedrock_exception="ModelNotReadyException"),
            503,
            "overloaded_error",
        ),
        # A refusal of Bedrock's credentials is never the client's: the api account's 500,
        # the last answer that is no key's, goes on (with none, the credential 503).
        (Behaviour(status=403), 500, "api_error"),
    ],
)
async def test_bedrocks_last_answer_reaches_the_client_in_the_api_shape(
    fresh_gateway: str, mock: MockProvider, behaviour: Behaviour, status: int, error_type: str
) -> None:
    """With no account left, the client gets Bedrock's answer as the API would give it (a
    throttle that no one can absorb stays a 429; a fault is a 5xx; a refusal of its
    credentials is never passed on), or the gateway's own 503 when it already knows nothing
    can serve."""
    mock.set_behaviour("key-api", Behaviour(status=500))
    mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, behaviour)
    client = anthropic.AsyncAnthropic(base_url=fresh_gateway, api_key="caller", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as raised:
        await client.messages.create(**_request(tools=False))
    await client.close()
    assert [r.key for r in mock.requests] == ["key-api", MOCK_AWS_ACCESS_KEY_ID]
    assert raised.value.status_code in (status, 503)
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    if raised.value.status_code == status:
        assert body["error"]["type"] == error_type


@pytest.mark.parametrize(
    ("fault", "error_type", "status"),
    [
        (
            Behaviour(
                fail="error_mid_stream",
                stall_after_chunks=1,
                body_stall_secs=0.3,
                bedrock_exception="InternalServerException",
            ),
            "api_error",
            "500",
        ),
        (
            Behaviour(fail="reset_mid_stream", stall_after_chunks=1, body_stall_secs=0.3),
            "upstream_error",
            "502",
        ),
    ],
    ids=["exception-message", "connection-cut"],
)
async def test_a_bedrock_stream_that_fails_after_its_first_token_ends_with_the_error_event(
    gateway: str, mock: MockProvider, fault: Behaviour, error_type: str, status: str
) -> None:
    # The first delta goes out 0.3 s before the failure, so it reaches the client first (one
    # that came in the same read as the failure would be held back with it, and the request
    # would fail over instead: nothing would have reached the client).
    mock.set_behaviour(SECOND_KEY_ID, fault)
    labels = {"switchyard_account": "aws-first", "status": status}
    before = metric_value(gateway, "switchyard_account_faults_total", **labels)
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0)
    text: list[str] = []
    request = {**_request(tools=False), "model": "claude-sonnet-5"}

    async def read() -> None:
        async with client.messages.stream(**request) as events:
            async for chunk in events.text_stream:
                text.append(chunk)

    with pytest.raises(anthropic.APIStatusError) as raised:
        await read()
    await client.close()
    assert text  # the first delta reached the client before the failure
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["error"]["type"] == error_type
    after = metric_value(gateway, "switchyard_account_faults_total", **labels)
    assert after - before == 1


async def test_a_refused_aws_secret_fails_over_and_never_reaches_the_log(
    mock: MockProvider, tmp_path: Path
) -> None:
    """A Bedrock account whose secret is wrong: Bedrock refuses the signature (a credential
    fault), the request fails over to the API, and neither the secret nor a signature appears
    in the gateway's output."""
    wrong = "wrong/secret/that/must/not/be/logged"
    env = _aws_env(tmp_path)
    (tmp_path / "credentials").write_text(
        f"[second]\naws_access_key_id = {SECOND_KEY_ID}\naws_secret_access_key = {wrong}\n"
    )
    text = config(mock.url)  # type: ignore[attr-defined]
    with example_gateway(text, tmp_path, env) as gateway:
        request = {**_request(tools=False), "model": "claude-sonnet-5"}
        _, headers = await _ask(gateway, request, stream=False)
    assert headers["x-switchyard-account"] == "api-second"
    assert headers["x-switchyard-attempts"] == "2"
    # Refused at the signature: only the API's request reached a model.
    assert [r.key for r in mock.requests] == ["key-api-second"]
    log = (tmp_path / "gateway.log").read_text()
    assert wrong not in log
    assert "Signature=" not in log


async def test_the_clients_betas_reach_bedrock_in_the_body(
    gateway: str, mock: MockProvider
) -> None:
    mock.set_behaviour("key-api", Behaviour(status=503))
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0)
    betas = "context-1m-2025-08-07,fine-grained-tool-streaming-2025-05-14"
    raw = await client.messages.with_raw_response.create(
        **_request(tools=False), extra_headers={"anthropic-beta": betas}
    )
    await client.close()
    assert raw.headers["x-switchyard-account"] == "aws"
    api_call, bedrock_call = mock.requests
    assert api_call.headers["anthropic-beta"] == betas  # the API takes them as a header
    assert json.loads(bedrock_call.body)["anthropic_beta"] == betas.split(",")


@pytest.mark.parametrize(
    ("model", "slow_key", "answered_by"),
    [
        ("claude-opus-5", "key-api", "aws"),
        ("claude-sonnet-5", SECOND_KEY_ID, "api-second"),
    ],
    ids=["api-to-bedrock", "bedrock-to-api"],
)
async def test_a_stream_that_does_not_start_in_time_fails_over(
    gateway: str, mock: MockProvider, model: str, slow_key: str, answered_by: str
) -> None:
    """A stream whose response has not started within the account's `timeout_secs` (1 s
    here; the provider waits 3 s) goes to the next provider."""
    mock.set_behaviour(slow_key, Behaviour(headers_delay_secs=3.0))
    (_, final), headers = await _ask(gateway, {**_request(tools=False), "model": model}, True)
    assert final["content"][0]["text"] == "Hello from the mock provider."
    assert headers["x-switchyard-account"] == answered_by
    assert headers["x-switchyard-attempts"] == "2"


@pytest.mark.parametrize(
    "exception", ["ServiceUnavailableException", "ThrottlingException", "InternalServerException"]
)
async def test_a_bedrock_stream_that_fails_before_its_first_token_fails_over(
    gateway: str, mock: MockProvider, exception: str
) -> None:
    """Bedrock's exception message before any content: nothing reached the client yet, so the
    request goes on to the API."""
    mock.set_behaviour(
        SECOND_KEY_ID,
        Behaviour(fail="error_mid_stream", stall_after_chunks=0, bedrock_exception=exception),
    )
    request = {**_request(tools=False), "model": "claude-sonnet-5"}
    (_, final), headers = await _ask(gateway, request, True)
    assert final["content"][0]["text"] == "Hello from the mock provider."
    assert headers["x-switchyard-account"] == "api-second"
    assert [r.key for r in mock.requests] == [SECOND_KEY_ID, "key-api-second"]


async def test_count_tokens_on_a_bedrock_account_is_the_wires_404(
    gateway: str, mock: MockProvider
) -> None:
    # The gateway maps no token count onto Bedrock (the Anthropic SDK's own Bedrock client
    # refuses count_tokens too): the account kind answers 404 in the wire's shape, without
    # calling AWS.
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0)
    messages: Any = [{"role": "user", "content": "hi"}]
    try:
        with pytest.raises(anthropic.NotFoundError) as info:
            await client.messages.count_tokens(model="claude-sonnet-5", messages=messages)
    finally:
        await client.close()
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert "bedrock account" in info.value.message
    assert mock.requests == []
