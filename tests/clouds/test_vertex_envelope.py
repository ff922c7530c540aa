"""The Vertex envelope, sans IO: the Messages body with the model in the path and
`anthropic_version` in the body, Vertex's errors in Anthropic's shape."""

from __future__ import annotations

import json

import pytest

from switchyard_mw.clouds.vertex import VERTEX_VERSION, VertexCloud, vertex_base_url
from switchyard_mw.config import VertexSettings
from switchyard_mw.errors import WireError

SETTINGS = VertexSettings(project="my-project", region="us-east5")
CLOUD = VertexCloud("gcp", SETTINGS, vertex_base_url("us-east5"))
MODEL_PATH = "/publishers/anthropic/models/claude-opus-5@20260101"
BASE = "https://us-east5-aiplatform.googleapis.com/v1/projects/my-project/locations/us-east5"


def body(**fields: object) -> bytes:
    return json.dumps(
        {"model": "claude-opus-5@20260101", "max_tokens": 8, "messages": [], **fields}
    ).encode()


def test_a_json_request_goes_to_raw_predict_without_its_model_key() -> None:
    envelope = CLOUD.envelope("/v1/messages", body(temperature=0.5))
    assert envelope.url == f"{BASE}{MODEL_PATH}:rawPredict"
    assert envelope.stream is False
    assert envelope.model == "claude-opus-5@20260101"
    sent = json.loads(envelope.body)
    assert sent == {
        "max_tokens": 8,
        "messages": [],
        "temperature": 0.5,
        "anthropic_version": VERTEX_VERSION,
    }


def test_a_stream_goes_to_stream_raw_predict_and_keeps_stream_true() -> None:
    envelope = CLOUD.envelope("/v1/messages", body(stream=True))
    assert envelope.url == f"{BASE}{MODEL_PATH}:streamRawPredict"
    assert envelope.stream is True
    assert json.loads(envelope.body)["stream"] is True


def test_stream_false_is_not_a_stream() -> None:
    assert CLOUD.envelope("/v1/messages", body(stream=False)).url.endswith(":rawPredict")


def test_a_version_the_client_set_is_kept() -> None:
    envelope = CLOUD.envelope("/v1/messages", body(anthropic_version="vertex-2099-01-01"))
    assert json.loads(envelope.body)["anthropic_version"] == "vertex-2099-01-01"


def test_the_global_region_has_no_regional_host() -> None:
    assert vertex_base_url("global") == "https://aiplatform.googleapis.com"
    assert vertex_base_url("europe-west1") == "https://europe-west1-aiplatform.googleapis.com"


def test_a_name_that_could_leave_its_path_segment_is_escaped() -> None:
    envelope = CLOUD.envelope("/v1/messages", body(model="../x?y#z"))
    assert envelope.url == f"{BASE}/publishers/anthropic/models/..%2Fx%3Fy%23z:rawPredict"


def test_the_bound_model_stands_in_for_a_body_without_one() -> None:
    envelope = CLOUD.envelope("/v1/messages", b'{"max_tokens": 1}', model="claude-x@1")
    assert envelope.url.endswith("/models/claude-x@1:rawPredict")


def test_a_token_count_goes_to_count_tokens_with_its_model_in_the_body() -> None:
    count = json.dumps({"model": "claude-opus-5@20260101", "messages": [], "stream": False})
    envelope = CLOUD.envelope("/v1/messages/count_tokens", count.encode())
    assert envelope.url == f"{BASE}/publishers/anthropic/models/count-tokens:rawPredict"
    assert (envelope.stream, envelope.model) == (False, "claude-opus-5@20260101")
    assert json.loads(envelope.body) == {
        "model": "claude-opus-5@20260101",
        "messages": [],
        "stream": False,
        "anthropic_version": VERTEX_VERSION,
    }
    # The bound model stands in for a body without one, as for a Messages call.
    bound = CLOUD.envelope("/v1/messages/count_tokens", b'{"messages": []}', model="claude-x@1")
    assert json.loads(bound.body)["model"] == "claude-x@1"


@pytest.mark.parametrize(
    ("path", "data", "status"),
    [
        ("/v1/chat/completions", body(), 404),
        ("/v1/responses", body(), 404),
        ("/v1/messages", b"not json", 400),
        ("/v1/messages", b"[1, 2]", 400),
        ("/v1/messages", b'{"max_tokens": 1}', 400),
        ("/v1/messages/count_tokens", b'{"messages": []}', 400),
        ("/v1/messages/batches", body(), 404),
    ],
)
def test_what_vertex_cannot_take_is_a_wire_error(path: str, data: bytes, status: int) -> None:
    with pytest.raises(WireError) as info:
        CLOUD.envelope(path, data)
    assert info.value.status == status


def google_error(code: int, status: str, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message, "status": status}}).encode()


def test_resource_exhausted_is_an_anthropic_rate_limit_error() -> None:
    status, data = CLOUD.error_answer(429, google_error(429, "RESOURCE_EXHAUSTED", "Quota"))
    assert status == 429
    assert json.loads(data) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "Vertex AI: RESOURCE_EXHAUSTED: Quota"},
    }


@pytest.mark.parametrize(
    ("code", "kind"), [(401, "authentication_error"), (403, "permission_error")]
)
def test_credential_refusals_keep_their_status(code: int, kind: str) -> None:
    status, data = CLOUD.error_answer(code, google_error(code, "PERMISSION_DENIED", "no"))
    assert status == code
    assert json.loads(data)["error"]["type"] == kind


def test_a_list_wrapped_error_is_read_too() -> None:
    wrapped = b"[" + google_error(503, "UNAVAILABLE", "try later") + b"]"
    status, data = CLOUD.error_answer(503, wrapped)
    assert (status, json.loads(data)["error"]["message"]) == (
        503,
        "Vertex AI: UNAVAILABLE: try later",
    )


def test_a_model_missing_in_the_region_is_the_accounts_fault_naming_it() -> None:
    status, data = CLOUD.error_answer(404, google_error(404, "NOT_FOUND", "Publisher model"))
    assert status == 502
    message = json.loads(data)["error"]["message"]
    assert message.startswith("account 'gcp': Vertex AI has no such model in project")
    assert "'us-east5'" in message


def test_the_models_own_errors_pass_through_unchanged() -> None:
    own = b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}'
    assert CLOUD.error_answer(529, own) == (529, own)


def test_a_body_that_is_not_json_is_quoted_short() -> None:
    status, data = CLOUD.error_answer(500, b"<html>oops</html>" + b"x" * 500)
    message = json.loads(data)["error"]["message"]
    assert status == 500
    assert message.startswith("Vertex AI: <html>oops</html>")
    assert len(message) < 240
