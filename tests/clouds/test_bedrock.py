"""A `kind = "bedrock"` account against the mock provider's Bedrock face, in process: the
envelope, the SigV4 signature (the mock re-signs with botocore and compares), the answer turned
back into the Anthropic API's (JSON, SSE from the event stream, errors by exception type), and
the credential chain resolved once and refreshed when it nears its end."""

from __future__ import annotations

import json
import re
import stat
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from switchyard_mw import errors
from switchyard_mw.accounts import Account, build_accounts
from switchyard_mw.clouds.bedrock_stream import BedrockStream
from switchyard_mw.config import parse_config
from switchyard_mw.core.eventstream import encode
from switchyard_mw.testing import Behaviour, MockProvider
from switchyard_mw.testing._bedrock_face import (
    MOCK_AWS_ACCESS_KEY_ID,
    MOCK_AWS_SECRET_ACCESS_KEY,
)

pytest.importorskip("botocore")

MOCK = "http://mock.test"
BEDROCK_ID = "us.anthropic.claude-opus-5-v1:0"
CONFIG = f"""
[llm_clients.api]
base_url = "{MOCK}"
api_key_env = "KEY"
auth = "x-api-key"
models = ["claude-opus-5"]
[llm_clients.aws]
kind = "bedrock"
base_url = "{MOCK}"
bedrock = {{ region = "us-east-1" }}
models = {{ "claude-opus-5" = "{BEDROCK_ID}" }}
"""
REQUEST = {
    "model": "claude-opus-5",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "hi"}],
}
TOOLS = [{"name": "lookup", "description": "d", "input_schema": {"type": "object"}}]


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The AWS chain sees only what a test gives it: never this machine's files or roles."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MOCK_AWS_ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", MOCK_AWS_SECRET_ACCESS_KEY)
    return tmp_path


@pytest.fixture
def mock() -> MockProvider:
    return MockProvider()


def _accounts(config: str = CONFIG) -> dict[str, Account]:
    return {
        name: account.for_model("claude-opus-5")
        for name, account in build_accounts(parse_config(config), {"KEY": "key-a"}).items()
    }


async def _call(mock: MockProvider, account: Account, request: dict[str, Any]) -> httpx.Response:
    # As the stack hands it on (`ctx.body_for_app()`): the provider's name in the body.
    body = json.dumps({**request, "model": account.provider_model or request["model"]}).encode()
    outbound = await account.outbound("/v1/messages", body, [("content-type", "application/json")])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mock)) as http:
        return await http.post(outbound.url, headers=outbound.headers, content=outbound.body)


def _answer(account: Account, response: httpx.Response) -> tuple[int, bytes]:
    """The answer as the forwarding app turns it back: errors mapped, streams translated."""
    assert account.cloud is not None
    cloud = account.cloud.cloud
    if response.status_code >= 300:
        raw = [(k.lower(), v) for k, v in response.headers.raw]
        return cloud.error_answer(response.status_code, response.content, raw)
    translator = cloud.stream_translator(response.headers["content-type"])
    if translator is None:
        return response.status_code, response.content
    # The event stream fed one byte at a time: the framing may be cut anywhere.
    data = b"".join(
        translator.feed(response.content[i : i + 1]) for i in range(len(response.content))
    )
    return response.status_code, data + translator.end()


def _same_ids(data: bytes) -> bytes:
    """Ids are random, and the mock counts input tokens as request bytes / 4, which differ
    with the envelope (Bedrock's body has `anthropic_version` for `model`): both set aside."""
    data = re.sub(rb'"(msg|toolu)_[0-9A-Za-z]+"', rb'"\1_X"', data)
    return re.sub(rb'"input_tokens":\d+', b'"input_tokens":N', data)


async def test_the_envelope_is_bedrocks(aws_env: Path, mock: MockProvider) -> None:
    aws = _accounts()["aws"]
    assert aws.base_url == MOCK
    request = {**REQUEST, "model": BEDROCK_ID, "stream": True}
    outbound = await aws.outbound("/v1/messages", json.dumps(request).encode())
    # The model in the path as HTTP clients send it (`:` as it is); the stream's endpoint.
    assert (
        outbound.url == f"{MOCK}/model/us.anthropic.claude-opus-5-v1:0/invoke-with-response-stream"
    )
    body = json.loads(outbound.body)
    assert body == {
        "max_tokens": 64,
        "messages": REQUEST["messages"],
        "anthropic_version": "bedrock-2023-05-31",
    }
    betas = [("anthropic-beta", "context-1m-2025-08-07, fine-grained"), ("Anthropic-Beta", "x")]
    with_betas = await aws.outbound("/v1/messages", json.dumps(request).encode(), betas)
    assert json.loads(with_betas.body)["anthropic_beta"] == [
        "context-1m-2025-08-07",
        "fine-grained",
        "x",
    ]
    own = json.dumps({**request, "anthropic_beta": ["mine"]}).encode()
    assert json.loads((await aws.outbound("/v1/messages", own, betas)).body)["anthropic_beta"] == [
        "mine"
    ]
    names = {k for k, _ in outbound.headers}
    assert {"authorization", "x-amz-date", "accept", "content-type"} <= names
    assert MOCK_AWS_SECRET_ACCESS_KEY not in repr(outbound)
    assert dict(outbound.headers)["accept"] == "application/vnd.amazon.eventstream"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tools", [False, True])
async def test_bedrock_answers_as_the_api_does(
    aws_env: Path, mock: MockProvider, stream: bool, tools: bool
) -> None:
    accounts = _accounts()
    request = {**REQUEST, "stream": stream, **({"tools": TOOLS} if tools else {})}
    api_status, api = _answer_api(await _call(mock, accounts["api"], request))
    status, bedrock = _answer(accounts["aws"], await _call(mock, accounts["aws"], request))
    assert (status, api_status) == (200, 200)
    assert _same_ids(bedrock) == _same_ids(api)
    assert (b'"type":"tool_use"' in api) is tools
    recorded = mock.requests[-1]
    assert (recorded.key, recorded.model, recorded.stream) == (
        MOCK_AWS_ACCESS_KEY_ID,
        BEDROCK_ID,
        stream,
    )
    if stream:  # what the usage reader needs is there; Bedrock's own metrics are not
        assert b'"input_tokens"' in bedrock
        assert b'"output_tokens"' in bedrock
        assert b"invocationMetrics" not in bedrock
        assert b"event: message_stop" in bedrock


def _answer_api(response: httpx.Response) -> tuple[int, bytes]:
    return response.status_code, response.content


async def test_a_wrong_secret_is_refused_as_bedrock_refuses_it(
    aws_env: Path, mock: MockProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    aws = _accounts()["aws"]
    response = await _call(mock, aws, REQUEST)
    assert response.status_code == 403
    assert response.headers["x-amzn-errortype"].startswith("InvalidSignatureException:")
    status, body = _answer(aws, response)
    assert status == 401
    assert json.loads(body)["error"]["type"] == "authentication_error"
    assert "not-the-secret" not in body.decode()


async def test_the_mock_refuses_a_body_changed_after_signing(
    aws_env: Path, mock: MockProvider
) -> None:
    aws = _accounts()["aws"]
    outbound = await aws.outbound("/v1/messages", json.dumps(REQUEST).encode())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mock)) as http:
        response = await http.post(
            outbound.url, headers=outbound.headers, content=outbound.body.replace(b"64", b"65")
        )
        assert response.status_code == 403
        assert "signature we calculated does not match" in response.json()["message"]
        unsigned = [(k, v) for k, v in outbound.headers if k != "authorization"]
        response = await http.post(outbound.url, headers=unsigned, content=outbound.body)
        assert response.headers["x-amzn-errortype"].startswith("MissingAuthenticationToken")


@pytest.mark.parametrize(
    ("behaviour", "wire", "answered"),
    [
        (Behaviour(status=429), (429, "ThrottlingException"), (429, "rate_limit_error")),
        (
            Behaviour(status=429, bedrock_exception="ModelNotReadyException"),
            (429, "ModelNotReadyException"),
            (503, "overloaded_error"),
        ),
        (Behaviour(status=403), (403, "AccessDeniedException"), (403, "permission_error")),
        (
            Behaviour(status=401),
            (403, "UnrecognizedClientException"),
            (401, "authentication_error"),
        ),
        (Behaviour(status=503), (503, "ServiceUnavailableException"), (503, "overloaded_error")),
        (Behaviour(status=500), (500, "InternalServerException"), (500, "api_error")),
        (Behaviour(status=424), (424, "ModelErrorException"), (502, "api_error")),
        (Behaviour(status=408), (408, "ModelTimeoutException"), (504, "timeout_error")),
        (Behaviour(status=404), (404, "ResourceNotFoundException"), (502, "not_found_error")),
        (Behaviour(status=400), (400, "ValidationException"), (400, "invalid_request_error")),
    ],
)
async def test_bedrocks_errors_are_answered_as_what_they_are(
    aws_env: Path,
    mock: MockProvider,
    behaviour: Behaviour,
    wire: tuple[int, str],
    answered: tuple[int, str],
) -> None:
    mock.set_behaviour(MOCK_AWS_ACCESS_KEY_ID, behaviour)
    aws = _accounts()["aws"]
    response = await _call(mock, aws, REQUEST)
    assert (response.status_code, response.headers["x-amzn-errortype"].split(":")[0]) == wire
    status, body = _answer(aws, response)
    error = json.loads(body)
    assert (status, error["error"]["type"]) == answered
    assert error["type"] == "error"
    if wire[1] == "ResourceNotFoundException":
        assert "account 'aws'" in error["error"]["message"]
        assert "us-east-1" in error["error"]["message"]


async def test_an_exception_mid_stream_ends_the_stream_with_the_error_event(
    aws_env: Path, mock: MockProvider
) -> None:
    mock.set_behaviour(
        MOCK_AWS_ACCESS_KEY_ID,
        Behaviour(
            fail="error_mid_stream", stall_after_chunks=1, bedrock_exception="ThrottlingException"
        ),
    )
    aws = _accounts()["aws"]
    response = await _call(mock, aws, {**REQUEST, "stream": True})
    assert aws.cloud is not None
    translator = aws.cloud.cloud.stream_translator(response.headers["content-type"])
    assert isinstance(translator, BedrockStream)
    data = translator.feed(response.content) + translator.end()
    events = data.split(b"\n\n")
    assert events[-1] == b""
    assert events[-2].startswith(b"event: error\ndata: ")
    error = json.loads(events[-2].split(b"data: ", 1)[1])
    assert error["error"]["type"] == "rate_limit_error"
    assert translator.failure == 429
    assert b"text_delta" in data  # the one delta before it got through
    assert b"message_stop" not in data


def test_a_stream_cut_inside_a_message_or_not_an_event_stream_is_a_protocol_error() -> None:
    frame = encode({":message-type": "event", ":event-type": "chunk"}, b'{"bytes":"e30="}')
    cut = BedrockStream()
    assert cut.feed(frame[:-3]) == b""
    with pytest.raises(errors.RemoteProtocolError, match="inside a message"):
        cut.end()
    garbage = BedrockStream()
    with pytest.raises(errors.RemoteProtocolError, match="checksum"):
        garbage.feed(b"data: this is SSE, not an event stream\n\n")
    oversized = BedrockStream(max_frame_bytes=64)
    with pytest.raises(errors.RemoteProtocolError, match="over the 64-byte limit"):
        oversized.feed(encode({}, b"x" * 100))


async def test_no_credentials_is_a_clear_error_naming_the_account(
    aws_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    aws = _accounts()["aws"]
    with pytest.raises(errors.CloudCredentialError, match="account 'aws': no AWS credentials") as e:
        await aws.outbound("/v1/messages", json.dumps(REQUEST).encode())
    assert e.value.refused


def test_a_region_from_nowhere_is_a_startup_error(
    aws_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = CONFIG.replace('bedrock = { region = "us-east-1" }', "bedrock = {}")
    with pytest.raises(errors.StartupError, match=r"llm_clients\.aws\.bedrock\.region"):
        _accounts(config)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    aws = build_accounts(
        parse_config(config.replace(f'base_url = "{MOCK}"\nbedrock', "bedrock")), {"KEY": "k"}
    )["aws"]
    assert aws.base_url == "https://bedrock-runtime.eu-west-3.amazonaws.com"


def _credential_process(tmp: Path, expires_in_secs: int) -> Path:
    """A profile whose credentials come from a process (as SSO's or a vault's do), each with
    an expiry; the process counts its runs."""
    counter = tmp / "runs"
    script = tmp / "creds.py"
    script.write_text(
        "import datetime, json, pathlib\n"
        f"runs = pathlib.Path({str(counter)!r})\n"
        "runs.write_text(str(int(runs.read_text() or 0) + 1) if runs.exists() else '1')\n"
        "end = datetime.datetime.now(datetime.UTC) + "
        f"datetime.timedelta(seconds={expires_in_secs})\n"
        f"print(json.dumps({{'Version': 1, 'AccessKeyId': {MOCK_AWS_ACCESS_KEY_ID!r}, "
        f"'SecretAccessKey': {MOCK_AWS_SECRET_ACCESS_KEY!r}, "
        "'Expiration': end.strftime('%Y-%m-%dT%H:%M:%SZ')}))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    (tmp / "config").write_text(
        f"[profile rotating]\ncredential_process = {sys.executable} {script}\n"
    )
    return counter


@pytest.mark.parametrize(("expires_in_secs", "runs"), [(3600, 1), (300, 4)])
async def test_credentials_resolve_once_and_refresh_near_their_end(
    aws_env: Path,
    mock: MockProvider,
    monkeypatch: pytest.MonkeyPatch,
    expires_in_secs: int,
    runs: int,
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    counter = _credential_process(aws_env, expires_in_secs)
    config = CONFIG.replace('region = "us-east-1"', 'region = "us-east-1", profile = "rotating"')
    aws = _accounts(config)["aws"]
    for _ in range(3):
        assert (await _call(mock, aws, REQUEST)).status_code == 200
    # An hour left: resolved once for three requests. Five minutes left (inside botocore's
    # refresh window): resolved, then refreshed before each of the three signatures, never
    # signed with what is about to expire.
    assert int(counter.read_text()) == runs


def test_check_config_names_a_missing_profile_and_a_region_from_nowhere(
    aws_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from switchyard_mw.clouds.checks import cloud_problems

    (aws_env / "config").write_text("[profile prod]\nregion = eu-central-1\n")
    config = (
        CONFIG
        + """
[llm_clients.aws-missing]
kind = "bedrock"
bedrock = { profile = "staging" }
models = ["claude-opus-5"]
[llm_clients.aws-nowhere]
kind = "bedrock"
bedrock = {}
models = ["claude-opus-5"]
[llm_clients.aws-prod]
kind = "bedrock"
bedrock = { profile = "prod" }
models = ["claude-opus-5"]
"""
    )
    assert cloud_problems(parse_config(config)) == [
        "llm_clients.aws-missing.bedrock.profile: no profile 'staging' in the shared AWS files",
        "llm_clients.aws-nowhere.bedrock.region: not set, and neither AWS_REGION, "
        "AWS_DEFAULT_REGION nor the profile names one",
    ]
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    assert len(cloud_problems(parse_config(config))) == 1


async def test_a_credential_chain_that_does_not_answer_is_an_error_in_time_not_a_hang(
    aws_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from switchyard_mw.clouds.aws_sigv4 import AwsSigV4
    from switchyard_mw.clouds.base import Envelope
    from switchyard_mw.config import BedrockSettings

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    (aws_env / "config").write_text(
        "[profile stuck]\n"
        f"credential_process = {sys.executable} -c 'import time; time.sleep(1.5)'\n"
    )
    signer = AwsSigV4(
        "aws", BedrockSettings(region="us-east-1", profile="stuck"), resolve_timeout_secs=0.3
    )
    envelope = Envelope(url=f"{MOCK}/model/m/invoke", body=b"{}", stream=False, model="m")
    started = time.monotonic()
    with pytest.raises(
        errors.CloudCredentialError, match=r"account 'aws': no AWS credentials within 0\.3 s"
    ) as e:
        await signer.headers(envelope, [])
    assert time.monotonic() - started < 2
    assert not e.value.refused  # no answer is not a refusal: the request fails over (a 502)


def test_bedrocks_prompt_too_long_reads_as_the_apis_context_length_refusal(aws_env: Path) -> None:
    """Bedrock refuses an over-long prompt with a ValidationException carrying the model's
    message: answered as the API's 400 `invalid_request_error`, so a fallback chain's
    `context_length` takes it as it takes the API's."""
    from switchyard_mw.engine.fallbacks import context_refusal

    aws = _accounts()["aws"]
    assert aws.cloud is not None
    wire = b'{"message":"prompt is too long: 250000 tokens > 200000 maximum"}'
    headers = [(b"x-amzn-errortype", b"ValidationException:http://internal.amazon.com/")]
    status, body = aws.cloud.cloud.error_answer(400, wire, headers)
    assert context_refusal(status, body)
    assert not context_refusal(*aws.cloud.cloud.error_answer(429, wire, []))
