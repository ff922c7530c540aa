"""Amazon Bedrock's errors, in the Anthropic API's shapes and with the statuses that make the
cooling policy treat each as what it is.

Bedrock names an error by its exception type: an HTTP error answer in the `x-amzn-errortype`
header (`ThrottlingException:http://internal.amazon.com/...`; botocore also reads `__type`
or `code` from the body), an error inside a stream in the `:exception-type` header of an
event-stream message (`throttlingException`). The status alone does not tell them apart (a
`ModelNotReadyException` is a 429 too, and is not a throttle), so the type decides:

- a throttle (429, held and failed over, never counted): `ThrottlingException`,
  `ServiceQuotaExceededException` (a 400 on the wire: the account's quota, not the request);
- a credential fault (401/403, the account cooled for every model): `AccessDeniedException`,
  `UnrecognizedClientException`, `InvalidSignatureException`, `ExpiredTokenException`, ...;
- a fault of the account and model (5xx): `ModelNotReadyException`,
  `ServiceUnavailableException`, `InternalServerException`, `ModelErrorException`,
  `ModelTimeoutException`, and `ResourceNotFoundException` (the model is not offered to this
  account in this region: a 502 naming the account, so the request fails over);
- the request's own fault (400): `ValidationException`, passed on with its message (a prompt
  that is too long reads as the Anthropic API's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import msgspec


class Mapped(NamedTuple):
    """An error as the client and the cooling policy see it: status and Anthropic type."""

    status: int
    error_type: str


_BY_TYPE: dict[str, Mapped] = {
    "throttlingexception": Mapped(429, "rate_limit_error"),
    "servicequotaexceededexception": Mapped(429, "rate_limit_error"),
    "accessdeniedexception": Mapped(403, "permission_error"),
    "unrecognizedclientexception": Mapped(401, "authentication_error"),
    "invalidsignatureexception": Mapped(401, "authentication_error"),
    "incompletesignatureexception": Mapped(401, "authentication_error"),
    "missingauthenticationtokenexception": Mapped(401, "authentication_error"),
    "expiredtokenexception": Mapped(401, "authentication_error"),
    "modelnotreadyexception": Mapped(503, "overloaded_error"),
    "serviceunavailableexception": Mapped(503, "overloaded_error"),
    "internalserverexception": Mapped(500, "api_error"),
    "modelerrorexception": Mapped(502, "api_error"),
    "modelstreamerrorexception": Mapped(502, "api_error"),
    "modeltimeoutexception": Mapped(504, "timeout_error"),
    "resourcenotfoundexception": Mapped(502, "not_found_error"),
    "validationexception": Mapped(400, "invalid_request_error"),
}
"""Exception type (lowercased: HTTP answers say `ThrottlingException`, streams
`throttlingException`) -> what it stands for."""

_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def mapped(exception_type: str | None, status: int) -> Mapped:
    """What an error of `exception_type` (None: not named) answered with `status` stands for."""
    if exception_type:
        known = _BY_TYPE.get(exception_type.lower())
        if known is not None:
            return known
    if status >= 500:
        return Mapped(status, _BY_STATUS.get(status, "api_error"))
    return Mapped(status, _BY_STATUS.get(status, "invalid_request_error"))


def exception_type(headers: Iterable[tuple[bytes, bytes]], body: bytes) -> str | None:
    """The exception type of an HTTP error answer, as botocore reads it: the
    `x-amzn-errortype` header up to its `:`, else the body's `__type` (after its `#`) or
    `code`."""
    for name, raw in headers:
        if name.lower() == b"x-amzn-errortype":
            return raw.decode("latin-1").split(":", 1)[0].strip() or None
    fields = _object(body)
    for key in ("__type", "code"):
        value = fields.get(key)
        if isinstance(value, str) and value:
            return value.rsplit("#", 1)[-1]
    return None


def message_of(body: bytes) -> str | None:
    """The `message` (or `Message`) of an AWS error body."""
    fields = _object(body)
    for key in ("message", "Message"):
        value = fields.get(key)
        if isinstance(value, str):
            return value
    return None


def _object(body: bytes) -> dict[str, Any]:
    try:
        fields = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return {}
    return fields if isinstance(fields, dict) else {}
