"""Token counting read as an Anthropic call that writes no output, and the wire an answer to a
path of no wire speaks."""

from __future__ import annotations

import msgspec
import pytest

from switchyard_mw.config import LLMClient
from switchyard_mw.engine.attempts import deadline_secs
from switchyard_mw.wire import COUNT_TOKENS_PATH, Wire, answer_wire, read_request, unknown_url

COUNT = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def test_count_tokens_is_an_anthropic_call_with_an_output_cap_of_zero() -> None:
    view = read_request(Wire.ANTHROPIC, COUNT, COUNT_TOKENS_PATH)
    assert (view.wire, view.model, view.max_tokens, view.stream) == (Wire.ANTHROPIC, "m", 0, False)
    # Whatever the body says: token counting writes nothing.
    capped = msgspec.json.encode({"model": "m", "max_tokens": 64000, "messages": []})
    assert read_request(Wire.ANTHROPIC, capped, COUNT_TOKENS_PATH).max_tokens == 0
    # The same body on /v1/messages keeps what it says (none).
    assert read_request(Wire.ANTHROPIC, COUNT, "/v1/messages").max_tokens is None
    assert read_request(Wire.ANTHROPIC, COUNT).max_tokens is None


@pytest.mark.parametrize("default_max_tokens", [None, 1, 128_000])
def test_count_tokens_never_grows_the_deadline(default_max_tokens: int | None) -> None:
    account = LLMClient(
        base_url="http://a.test",
        models=["m"],
        timeout_secs=7,
        default_max_tokens=default_max_tokens,
    )
    counting = read_request(Wire.ANTHROPIC, COUNT, COUNT_TOKENS_PATH)
    assert deadline_secs(counting, account) == 7
    # The same body as a Messages call takes the account's default cap: 128000 tokens -> 600 s.
    messages = read_request(Wire.ANTHROPIC, COUNT, "/v1/messages")
    grown = 600 if default_max_tokens == 128_000 else 7
    assert deadline_secs(messages, account) == grown


@pytest.mark.parametrize(
    ("path", "versioned", "wire"),
    [
        ("/v1/models", False, Wire.OPENAI_CHAT),
        ("/v1/models", True, Wire.ANTHROPIC),
        ("/v1/messages", False, Wire.ANTHROPIC),
        ("/v1/messages/batches", False, Wire.ANTHROPIC),
        ("/v1/messages/count_tokens/x", False, Wire.ANTHROPIC),
        ("/v1/messagesx", False, Wire.OPENAI_CHAT),  # not under /v1/messages
        ("/v1/chat/completions", True, Wire.OPENAI_CHAT),
        ("/v1/chat/completions/abc", True, Wire.OPENAI_CHAT),
        ("/v1/responses", True, Wire.OPENAI_RESPONSES),
        ("/v1/responses/resp_1/input_items", True, Wire.OPENAI_RESPONSES),
        ("/v1/files", True, Wire.ANTHROPIC),
    ],
)
def test_the_wire_of_an_answer_by_path_then_anthropic_version(
    path: str, versioned: bool, wire: Wire
) -> None:
    assert answer_wire(path, versioned) is wire


def test_unknown_url_in_each_providers_words() -> None:
    assert msgspec.json.decode(unknown_url(Wire.ANTHROPIC, "GET", "/v1/x")) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "Invalid URL (GET /v1/x)"},
    }
    for wire in (Wire.OPENAI_CHAT, Wire.OPENAI_RESPONSES, Wire.GENERIC):
        assert msgspec.json.decode(unknown_url(wire, "POST", "/v1/x")) == {
            "error": {
                "message": "Invalid URL (POST /v1/x)",
                "type": "invalid_request_error",
                "param": None,
                "code": "unknown_url",
            }
        }
