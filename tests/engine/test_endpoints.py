"""The endpoints both fronts answer from the config: the models list in each wire's shape (with
Anthropic's cursors), one model, and the wire's 404 for any other `/v1/` path."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from switchyard_mw.config import parse_config
from switchyard_mw.engine.endpoints import Endpoints, LocalAnswer, public_models

CONFIG = """
[server]
generic_paths = ["/v1/embeddings"]

[llm_clients.a]
base_url = "http://a.test"
models = ["m1", "m2", "*"]

[llm_clients.b]
base_url = "http://b.test"
models = { "m2" = "vendor.m2", "m3" = "vendor.m3" }

[llm_clients.judge]
base_url = "http://j.test"
models = ["judge-model"]

[routes.auto]
classifier = "llm"
judge = "judge"
judge_model = "judge-model"
choices = { simple = "m1", complex = "m3" }
fallback = "m1"
"""
MODELS = ("m1", "m2", "m3", "judge-model", "auto")
ENDPOINTS = Endpoints(parse_config(CONFIG))


def anthropic(path: str, query: str = "") -> LocalAnswer:
    return ENDPOINTS.answer("GET", path, query, anthropic_version=True)


def openai(path: str, query: str = "") -> LocalAnswer:
    return ENDPOINTS.answer("GET", path, query, anthropic_version=False)


def body(answer: LocalAnswer) -> Any:
    return msgspec.json.decode(answer.body)


def test_the_public_models_are_the_names_clients_may_send_in_config_order() -> None:
    # A table's public names (not the provider's), no "*", no repeats, the routes last.
    assert public_models(parse_config(CONFIG)) == MODELS
    assert ENDPOINTS.models == MODELS


def test_openais_list_shape() -> None:
    answer = openai("/v1/models")
    assert answer.status == 200
    assert body(answer) == {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "switchyard"} for m in MODELS
        ],
    }


def anthropic_model(model: str) -> dict[str, Any]:
    return {
        "type": "model",
        "id": model,
        "display_name": model,
        "created_at": "1970-01-01T00:00:00Z",
        "lifecycle": "active",
    }


def test_anthropics_list_shape_with_its_page_fields() -> None:
    answer = anthropic("/v1/models")
    assert answer.status == 200
    assert body(answer) == {
        "data": [anthropic_model(m) for m in MODELS],
        "has_more": False,
        "first_id": "m1",
        "last_id": "auto",
    }


def page(query: str) -> tuple[list[str], bool, str | None, str | None]:
    answer = anthropic("/v1/models", query)
    assert answer.status == 200, answer.body
    fields = body(answer)
    ids = [m["id"] for m in fields["data"]]
    return ids, fields["has_more"], fields["first_id"], fields["last_id"]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("limit=2", (["m1", "m2"], True, "m1", "m2")),
        ("limit=2&after_id=m2", (["m3", "judge-model"], True, "m3", "judge-model")),
        ("limit=2&after_id=judge-model", (["auto"], False, "auto", "auto")),
        ("after_id=auto", ([], False, None, None)),
        ("limit=5", (list(MODELS), False, "m1", "auto")),
        ("limit=4", (list(MODELS[:4]), True, "m1", "judge-model")),
        ("limit=2&before_id=auto", (["m3", "judge-model"], True, "m3", "judge-model")),
        ("limit=2&before_id=m3", (["m1", "m2"], False, "m1", "m2")),
        ("limit=9&before_id=m2", (["m1"], False, "m1", "m1")),
        ("before_id=m1", ([], False, None, None)),
        ("limit=1000", (list(MODELS), False, "m1", "auto")),
    ],
)
def test_anthropics_cursors(query: str, expected: tuple[list[str], bool, str, str]) -> None:
    assert page(query) == expected


def test_walking_the_pages_as_the_sdk_does_lists_every_model_once() -> None:
    seen: list[str] = []
    query = "limit=2"
    while True:
        ids, more, _, last = page(query)
        seen += ids
        if not more:
            break
        query = f"limit=2&after_id={last}"
    assert seen == list(MODELS)


@pytest.mark.parametrize(
    ("query", "problem"),
    [
        ("limit=0", "limit: must be an integer from 1 to 1000"),
        ("limit=1001", "limit: must be an integer from 1 to 1000"),
        ("limit=two", "limit: must be an integer from 1 to 1000"),
        ("limit=-1", "limit: must be an integer from 1 to 1000"),
        ("after_id=nope", "after_id: no model `nope`"),
        ("before_id=nope", "before_id: no model `nope`"),
        ("after_id=m1&before_id=m3", "after_id and before_id: set at most one"),
    ],
)
def test_a_bad_page_request_is_a_400_in_anthropics_shape(query: str, problem: str) -> None:
    answer = anthropic("/v1/models", query)
    assert answer.status == 400
    assert body(answer) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": problem},
    }


def test_openais_list_ignores_anthropics_page_parameters() -> None:
    assert openai("/v1/models", "limit=1").body == openai("/v1/models").body


def test_one_model_in_each_shape() -> None:
    assert body(anthropic("/v1/models/m3")) == anthropic_model("m3")
    assert body(openai("/v1/models/auto")) == {
        "id": "auto",
        "object": "model",
        "created": 0,
        "owned_by": "switchyard",
    }
    # A model id with a reserved character comes percent-encoded in the path.
    assert anthropic("/v1/models/judge%2Dmodel").status == 200


def test_a_model_the_config_does_not_list_is_the_wires_404() -> None:
    # The provider's own name is not a public one.
    answer = anthropic("/v1/models/vendor.m2")
    assert answer.status == 404
    assert body(answer) == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "model `vendor.m2` is not served by any account",
        },
    }
    answer = openai("/v1/models/vendor.m2")
    assert answer.status == 404
    assert body(answer) == {
        "error": {
            "message": "model `vendor.m2` is not served by any account",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


ANTHROPIC_404 = {"type": "error", "error": {"type": "not_found_error", "message": ""}}
OPENAI_404 = {
    "error": {"message": "", "type": "invalid_request_error", "param": None, "code": "unknown_url"}
}


@pytest.mark.parametrize(
    ("method", "path", "versioned", "shape"),
    [
        ("GET", "/v1/nope", False, OPENAI_404),
        ("GET", "/v1/nope", True, ANTHROPIC_404),
        ("POST", "/v1/files", False, OPENAI_404),
        ("DELETE", "/v1/models/m1", False, OPENAI_404),  # only GET reads the list
        ("POST", "/v1/models", True, ANTHROPIC_404),
        ("GET", "/v1/models/", False, OPENAI_404),
        # Under a wire's path, the path says the wire whatever the headers.
        ("GET", "/v1/messages", False, ANTHROPIC_404),
        ("POST", "/v1/messages/batches", False, ANTHROPIC_404),
        ("GET", "/v1/messages/count_tokens", False, ANTHROPIC_404),
        ("GET", "/v1/chat/completions", True, OPENAI_404),
        ("GET", "/v1/responses/resp_1", True, OPENAI_404),
    ],
)
def test_any_other_v1_path_is_the_wires_404(
    method: str, path: str, versioned: bool, shape: dict[str, Any]
) -> None:
    answer = ENDPOINTS.answer(method, path, "", anthropic_version=versioned)
    assert answer.status == 404
    fields = body(answer)
    fields["error"]["message"] = ""
    assert fields == shape
    assert body(answer)["error"]["message"] == f"Invalid URL ({method} {path})"


@pytest.mark.parametrize(
    ("method", "path", "ours"),
    [
        ("GET", "/v1/models", True),
        ("GET", "/v1/anything", True),
        ("GET", "/v1/messages", True),
        ("POST", "/v1/nope", True),
        # An LLM call whose body is not JSON passes through unread (the design's rule).
        ("POST", "/v1/messages", False),
        ("POST", "/v1/messages/count_tokens", False),
        ("POST", "/v1/chat/completions", False),
        ("POST", "/v1/embeddings", False),  # a generic path
        # Outside /v1/: not an API path of ours.
        ("GET", "/healthz", False),
        ("GET", "/v1", False),
        ("GET", "/v2/models", False),
    ],
)
def test_which_requests_are_answered_here(method: str, path: str, ours: bool) -> None:
    assert ENDPOINTS.ours(method, path) is ours
