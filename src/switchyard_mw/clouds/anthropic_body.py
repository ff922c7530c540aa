"""The Anthropic Messages body in a cloud's envelope, and cloud errors in Anthropic's shape.

Both clouds take the Messages body with the model moved to the path and the API version in
the body (`anthropic_version`), and answer it as the Anthropic API would, except for their
own errors (the platform's, before the model runs), which come in the cloud's shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ..errors import WireError
from ..wire import on_fresh_stack

MESSAGES_PATH = "/v1/messages"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def reenvelope(
    body: bytes,
    version: str,
    *,
    model: str | None,
    drop: tuple[str, ...] = (),
    add: Mapping[str, Any] | None = None,
) -> tuple[str, bool, bytes]:
    """(the model, whether it streams, the body without `model` and with
    `anthropic_version`), for a Messages `body`; `model` stands in if the body has none.
    The keys in `drop` leave the body too (Bedrock refuses a `stream` key: its endpoint says);
    those of `add` join it unless the body has them (Bedrock's `anthropic_beta`).

    A version the client set in the body is kept (a team may pin a newer one).
    """
    try:
        fields = _decode(body)
    except msgspec.DecodeError:
        raise WireError(400, "invalid_request_error", "the body is not valid JSON") from None
    if not isinstance(fields, dict):
        raise WireError(400, "invalid_request_error", "the body is not a JSON object")
    named = fields.pop("model", None)
    chosen = named if isinstance(named, str) and named else model
    if not chosen:
        raise WireError(400, "invalid_request_error", "model: required")
    fields.setdefault("anthropic_version", version)
    for key, value in (add or {}).items():
        fields.setdefault(key, value)
    stream = fields.get("stream") is True
    for key in drop:
        fields.pop(key, None)
    return chosen, stream, _encode(fields)


def counting_body(body: bytes, version: str, *, model: str | None) -> tuple[str, bytes]:
    """(the model, the body) of a token count (`/v1/messages/count_tokens`) for a cloud that
    takes it with its `model` in the body and `anthropic_version` set (Vertex AI): `model`
    stands in if the body has none."""
    name, _, data = reenvelope(body, version, model=model)
    fields = _decode(data)
    return name, _encode({"model": name, **fields})


def messages_only(path: str, kind: str) -> None:
    """Refuse any path but the Messages API's: the clouds serve Claude on that wire only."""
    if path != MESSAGES_PATH:
        raise WireError(
            404,
            "not_found_error",
            f"a {kind} account serves the Anthropic Messages API ({MESSAGES_PATH}) only",
        )


def is_anthropic_error(body: bytes) -> bool:
    """Whether `body` is already an Anthropic error (the model's own, passed on by the cloud)."""
    try:
        fields = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return False
    return isinstance(fields, dict) and fields.get("type") == "error"


def anthropic_error(status: int, message: str) -> bytes:
    """An Anthropic error body for `status` (`api_error` for any 5xx or status not listed)."""
    kind = _ERROR_TYPES.get(status, "api_error")
    return msgspec.json.encode({"type": "error", "error": {"type": kind, "message": message}})


def _decode(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except RecursionError:
        return on_fresh_stack(msgspec.json.decode, body)


def _encode(fields: dict[str, Any]) -> bytes:
    try:
        return msgspec.json.encode(fields)
    except RecursionError:
        return on_fresh_stack(msgspec.json.encode, fields)
