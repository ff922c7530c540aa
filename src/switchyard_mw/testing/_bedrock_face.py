"""The mock provider's Amazon Bedrock face: InvokeModel and InvokeModelWithResponseStream.

`POST /model/{modelId}/invoke` answers the Anthropic message JSON; `.../invoke-with-response-
stream` the same events as the Messages API's stream, each in a binary event-stream `chunk`
message (`{"bytes": base64(event), "p": padding}`), the last with Bedrock's
`amazon-bedrock-invocationMetrics`. The body must be Bedrock's: `anthropic_version`
`bedrock-2023-05-31` (or an API date, as the Anthropic SDK's own Bedrock client sends), no
`model`, no `stream` (each is a `ValidationException`, as there).

Every request must carry a valid AWS Signature V4 for service `bedrock`: the mock re-signs it
with botocore, with the secret it holds for the request's access key id, at the request's own
`x-amz-date` (at most 5 minutes off), and compares. Errors come as Bedrock sends them: a JSON
`{"message": ...}` with the exception named in `x-amzn-errortype`; one mid-stream as an
event-stream `exception` message.
"""

from __future__ import annotations

import base64
import datetime
import hmac
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from switchyard_mw.core.eventstream import encode as encode_message
from switchyard_mw.testing._asgi import JSON_TYPE, Send, send_whole

MOCK_AWS_ACCESS_KEY_ID = "AKIAMOCKBEDROCK00001"
MOCK_AWS_SECRET_ACCESS_KEY = "mock/bedrock/secret/access/key/0000000001"
"""The test credentials the mock knows unless it is given others (`aws_credentials`)."""
EVENTSTREAM_TYPE = b"application/vnd.amazon.eventstream"
BEDROCK_VERSION = "bedrock-2023-05-31"
MAX_SKEW = datetime.timedelta(minutes=5)

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}\Z")
ROUTE = re.compile(r"/model/(?P<model>[^/]+)/(?P<verb>invoke|invoke-with-response-stream)\Z")
_AUTH = re.compile(
    r"AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/"
    r"(?P<service>[^/]+)/aws4_request, ?SignedHeaders=(?P<signed>[^,]+), ?"
    r"Signature=(?P<sig>[0-9a-f]+)"
)

_BY_STATUS = {
    400: ("ValidationException", 400),
    401: ("UnrecognizedClientException", 403),
    403: ("AccessDeniedException", 403),
    404: ("ResourceNotFoundException", 404),
    408: ("ModelTimeoutException", 408),
    424: ("ModelErrorException", 424),
    429: ("ThrottlingException", 429),
    500: ("InternalServerException", 500),
    503: ("ServiceUnavailableException", 503),
}
"""A behaviour's status -> the exception Bedrock answers it with, and that one's status
(Bedrock says 403 for an unknown key, where the Anthropic API says 401)."""
_STREAM_TYPES = {"ServiceUnavailableException", "ThrottlingException", "InternalServerException"}


@dataclass(frozen=True, slots=True)
class BedrockCall:
    """A request on the Bedrock face: its model id, its endpoint, its access key id."""

    model: str
    stream: bool
    key: str = ""


def route(path: str) -> BedrockCall | None:
    match = ROUTE.match(path)
    if match is None:
        return None
    return BedrockCall(match["model"], match["verb"] == "invoke-with-response-stream")


def anthropic_name(model_id: str) -> str:
    """The name Bedrock's answers give a model, as the Anthropic API's do: its id without a
    cross-region prefix, the `anthropic.` vendor and the `-v1:0` version."""
    name = re.sub(r"\A(?:[a-z]{2,6}\.)?anthropic\.", "", model_id)
    return re.sub(r"-v\d+(?::\d+)?\Z", "", name)


class Refusal(NamedTuple):
    """A request whose signature the mock refuses: Bedrock's exception and message."""

    exception: str
    message: str


def verify(
    scope: Mapping[str, Any],
    headers: Mapping[str, str],
    body: bytes,
    secrets: Mapping[str, str],
    *,
    now: datetime.datetime | None = None,
) -> str | Refusal:
    """The access key id of a request whose SigV4 signature botocore agrees with, else
    Bedrock's refusal."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    found = _AUTH.fullmatch(headers.get("authorization", "").strip())
    if found is None:
        return Refusal("MissingAuthenticationTokenException", "Missing Authentication Token")
    secret = secrets.get(found["key"])
    if secret is None:
        return Refusal(
            "UnrecognizedClientException", "The security token included in the request is invalid."
        )
    stamp = headers.get("x-amz-date", "")
    try:
        signed_at = datetime.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.UTC)
    except ValueError:
        return Refusal("IncompleteSignatureException", "X-Amz-Date is missing")
    now = now or datetime.datetime.now(datetime.UTC)
    if abs(now - signed_at) > MAX_SKEW:
        return Refusal("InvalidSignatureException", "Signature expired: " + stamp)
    names = found["signed"].split(";")
    raw_path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string", b"")
    url = f"{scope.get('scheme', 'http')}://{headers.get('host', '')}{raw_path.decode('latin-1')}"
    request = AWSRequest(
        method=scope["method"],
        url=url + (f"?{query.decode('latin-1')}" if query else ""),
        data=body,
        headers={name: headers.get(name, "") for name in names},
    )
    request.context["timestamp"] = stamp
    signer = SigV4Auth(
        Credentials(found["key"], secret, headers.get("x-amz-security-token")),
        found["service"],
        found["region"],
    )
    canonical = signer.canonical_request(request)
    expected = signer.signature(signer.string_to_sign(request, canonical), request)
    if found["service"] != "bedrock" or not hmac.compare_digest(expected, found["sig"]):
        return Refusal(
            "InvalidSignatureException",
            "The request signature we calculated does not match the signature you provided. "
            "Check your AWS Secret Access Key and signing method.",
        )
    return found["key"]


def body_problem(fields: Mapping[str, Any]) -> str | None:
    """What Bedrock's validation says of an Anthropic body it would refuse (None: fine)."""
    version = fields.get("anthropic_version")
    # The documented version, or an API date as the Anthropic SDK's own Bedrock client sends.
    if version != BEDROCK_VERSION and not (isinstance(version, str) and _DATE.match(version)):
        return f"anthropic_version: expected {BEDROCK_VERSION!r}, got {version!r}"
    for key in ("model", "stream"):
        if key in fields:
            return f"#: extraneous key [{key}] is not permitted"
    return None


async def send_error(
    send: Send,
    status: int,
    message: str,
    *,
    exception: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """An error answer as Bedrock sends it."""
    named, wire_status = _BY_STATUS.get(status, ("InternalServerException", status))
    if exception is not None:
        named, wire_status = exception, status
    extra = [
        (
            b"x-amzn-errortype",
            f"{named}:http://internal.amazon.com/coral/com.amazon.bedrock/".encode(),
        ),
        request_id(),
    ]
    if headers is not None:
        extra += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    body = msgspec.json.encode({"message": message})
    await send_whole(send, wire_status, JSON_TYPE, body, extra)


def request_id() -> tuple[bytes, bytes]:
    return b"x-amzn-requestid", str(uuid.uuid4()).encode()


@dataclass(slots=True)
class EventStreamSend:
    """Wraps the mock's `send` for one streamed answer: the Messages API's SSE events it is
    given go out as Bedrock's event-stream messages; its `error` event as an `exception`."""

    send: Send
    exception: str = "ServiceUnavailableException"
    _pending: bytes = b""
    _usage: dict[str, int] = field(default_factory=dict)
    _started_at: float = 0.0

    async def __call__(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = [
                (b"content-type", EVENTSTREAM_TYPE),
                (b"x-amzn-bedrock-content-type", b"application/json"),
                request_id(),
            ]
            await self.send({**message, "headers": headers})
            return
        data = self._pending + message.get("body", b"")
        cut = data.rfind(b"\n\n") + 2 if b"\n\n" in data else 0
        self._pending = data[cut:]
        frames = b"".join(self._frame(event) for event in data[:cut].split(b"\n\n") if event)
        await self.send({**message, "body": frames})

    def _frame(self, sse: bytes) -> bytes:
        name, payload = b"", b""
        for line in sse.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:]
            elif line.startswith(b"data: "):
                payload += line[6:]
        fields = msgspec.json.decode(payload)
        if name == b"error":
            error = fields.get("error", {})
            return self._exception(str(error.get("message", "")))
        self._count(fields)
        if name == b"message_stop":
            fields["amazon-bedrock-invocationMetrics"] = {
                "inputTokenCount": self._usage.get("input_tokens", 0),
                "outputTokenCount": self._usage.get("output_tokens", 0),
                "invocationLatency": 1,
                "firstByteLatency": 1,
            }
            payload = msgspec.json.encode(fields)
        chunk = {
            "bytes": base64.b64encode(payload).decode(),
            "p": "abcdefghij"[: len(payload) % 10],
        }
        headers = {
            ":event-type": "chunk",
            ":content-type": "application/json",
            ":message-type": "event",
        }
        return encode_message(headers, msgspec.json.encode(chunk))

    def _count(self, fields: dict[str, Any]) -> None:
        usage = fields.get("usage") or (fields.get("message") or {}).get("usage") or {}
        for key in ("input_tokens", "output_tokens"):
            if isinstance(usage.get(key), int):
                self._usage[key] = usage[key]

    def _exception(self, message: str) -> bytes:
        kind = self.exception[0].lower() + self.exception[1:]
        headers = {
            ":exception-type": kind,
            ":content-type": "application/json",
            ":message-type": "exception",
        }
        return encode_message(headers, msgspec.json.encode({"message": message}))
