"""The mock provider's Bedrock face, checked against the Anthropic SDK's own Bedrock client
(`AnthropicBedrock`: botocore's signer, botocore's event-stream parser): what the mock accepts
and sends is what that client sends and reads, JSON and streams, text and tool use, errors."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from servers import serve_in_thread
from switchyard_mw.testing import (
    MOCK_AWS_ACCESS_KEY_ID,
    MOCK_AWS_SECRET_ACCESS_KEY,
    Behaviour,
    MockProvider,
)

pytestmark = pytest.mark.integration
pytest.importorskip("boto3")  # AnthropicBedrock's own dependency

MODEL_ID = "us.anthropic.claude-opus-5-v1:0"
TOOLS = [{"name": "lookup", "description": "d", "input_schema": {"type": "object"}}]


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture
def client(mock: tuple[MockProvider, str]) -> Iterator[anthropic.AnthropicBedrock]:
    mock[0].reset()
    bedrock = anthropic.AnthropicBedrock(
        aws_access_key=MOCK_AWS_ACCESS_KEY_ID,
        aws_secret_key=MOCK_AWS_SECRET_ACCESS_KEY,
        aws_region="us-east-1",
        base_url=mock[1],
        max_retries=0,
    )
    yield bedrock
    bedrock.close()


def _ask(tools: bool = False) -> dict[str, object]:
    request: dict[str, object] = {
        "model": MODEL_ID,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if tools:
        request["tools"] = TOOLS
    return request


@pytest.mark.parametrize("tools", [False, True])
def test_the_sdks_bedrock_client_reads_the_mocks_answers(
    client: anthropic.AnthropicBedrock, mock: tuple[MockProvider, str], tools: bool
) -> None:
    message = client.messages.create(**_ask(tools))  # type: ignore[call-overload]
    assert message.model == "claude-opus-5"
    assert message.stop_reason == ("tool_use" if tools else "end_turn")
    assert message.usage.output_tokens > 0
    (record,) = mock[0].requests
    assert (record.key, record.model, record.stream) == (MOCK_AWS_ACCESS_KEY_ID, MODEL_ID, False)


@pytest.mark.parametrize("tools", [False, True])
def test_the_sdks_bedrock_client_reads_the_mocks_event_stream(
    client: anthropic.AnthropicBedrock, mock: tuple[MockProvider, str], tools: bool
) -> None:
    with client.messages.stream(**_ask(tools)) as events:  # type: ignore[arg-type]
        kinds = [event.type for event in events]
        final = events.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert final.stop_reason == ("tool_use" if tools else "end_turn")
    assert final.usage.output_tokens > 0
    if tools:
        assert final.content[-1].type == "tool_use"
    else:
        assert final.content[0].type == "text"
        assert final.content[0].text == "Hello from the mock provider."
    assert mock[0].requests[-1].stream


@pytest.mark.parametrize(
    ("behaviour", "error"),
    [
        (Behaviour(status=429), anthropic.RateLimitError),
        (Behaviour(status=403), anthropic.PermissionDeniedError),
        (Behaviour(status=503), anthropic.InternalServerError),
        (Behaviour(status=400), anthropic.BadRequestError),
    ],
)
def test_the_sdks_bedrock_client_sees_the_mocks_errors(
    client: anthropic.AnthropicBedrock,
    mock: tuple[MockProvider, str],
    behaviour: Behaviour,
    error: type[anthropic.APIStatusError],
) -> None:
    mock[0].set_behaviour(MOCK_AWS_ACCESS_KEY_ID, behaviour)
    with pytest.raises(error):
        client.messages.create(**_ask())  # type: ignore[call-overload]


def test_a_wrong_secret_is_refused_to_the_sdks_bedrock_client(
    mock: tuple[MockProvider, str],
) -> None:
    wrong = anthropic.AnthropicBedrock(
        aws_access_key=MOCK_AWS_ACCESS_KEY_ID,
        aws_secret_key="wrong",
        aws_region="us-east-1",
        base_url=mock[1],
        max_retries=0,
    )
    with pytest.raises(anthropic.PermissionDeniedError, match="signature"):
        wrong.messages.create(**_ask())  # type: ignore[call-overload]
    wrong.close()
