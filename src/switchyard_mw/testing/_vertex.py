"""The mock provider's Vertex AI face: Google's token endpoint and the rawPredict paths.

`POST /token` is a service account's `token_uri`: it takes the JWT assertion google-auth
signs with the account's key, checks it (the signature against a key the test trusted with
`VertexFace.trust`, the audience Google requires, the expiry) and issues a bearer token. The
rawPredict and streamRawPredict paths take only a token it issued and not yet expired, and
only the Vertex envelope (no `model` key, `anthropic_version` set, `stream` as the verb says);
the answer is the Anthropic one, and Vertex's own errors come in Google's shape.
`.../models/count-tokens:rawPredict` counts tokens (the model in the body, as the API takes it).

Requests are answered by the behaviour of the token's service account (its `client_email`),
as the other faces answer by API key.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from switchyard_mw.testing._asgi import JSON_TYPE, Send, send_json, send_whole

TOKEN_PATH = "/token"
COUNT_TOKENS_MODEL = "count-tokens"
"""Where a model's name stands in the rawPredict path, the token count's method
(`.../models/count-tokens:rawPredict`), which takes the model in the body."""
GOOGLE_TOKEN_AUDIENCE = "https://oauth2.googleapis.com/token"
"""The audience google-auth puts in every assertion, whatever the key file's `token_uri`."""
VERTEX_VERSION = "vertex-2023-10-16"
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}\Z")
_JWT_GRANT = "urn:ietf:params:oauth:grant-type:jwt-bearer"
_PREDICT = re.compile(
    r"/v1/projects/(?P<project>[^/]+)/locations/(?P<region>[^/]+)"
    r"/publishers/anthropic/models/(?P<model>[^/:]+):(?P<verb>rawPredict|streamRawPredict)\Z"
)
_GOOGLE_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


@dataclass(frozen=True, slots=True)
class VertexCall:
    """A request on a rawPredict path: its project, region, model and whether it streams."""

    project: str
    region: str
    model: str
    stream: bool


def vertex_call(path: str) -> VertexCall | None:
    """The Vertex call a path names, or None for any other path."""
    match = _PREDICT.match(path)
    if match is None:
        return None
    stream = match.group("verb") == "streamRawPredict"
    return VertexCall(match.group("project"), match.group("region"), match.group("model"), stream)


class VertexFace:
    """The token endpoint's state: trusted keys, issued tokens, and how it answers."""

    def __init__(self) -> None:
        self._trusted: dict[str, bytes] = {}
        self._tokens: dict[str, tuple[str, float]] = {}
        self.token_lifetime_secs = 3600
        """`expires_in` of each token issued (the mock honours it: an expired token is a 401)."""
        self.token_delay_secs = 0.0
        """How long the token endpoint waits before it answers (a slow or dead endpoint)."""
        self.token_requests = 0
        """Token requests received (answered or not)."""

    def trust(self, client_email: str, public_key_pem: bytes) -> None:
        """Accept assertions of `client_email` signed by the key of `public_key_pem`."""
        self._trusted[client_email] = public_key_pem

    def distrust(self, client_email: str) -> None:
        """Refuse `client_email`'s assertions from now on (a revoked key); its tokens live on."""
        self._trusted.pop(client_email, None)

    def holder(self, token: str) -> str | None:
        """The service account a live token was issued to; None if unknown or expired."""
        held = self._tokens.get(token)
        if held is None or held[1] <= time.monotonic():
            return None
        return held[0]

    def reset(self) -> None:
        """Forget issued tokens and trusted keys; default timings."""
        self._trusted.clear()
        self._tokens.clear()
        self.token_lifetime_secs = 3600
        self.token_delay_secs = 0.0
        self.token_requests = 0

    async def answer_token(self, body: bytes, send: Send) -> None:
        """Answer a token request as Google's OAuth endpoint does."""
        self.token_requests += 1
        if self.token_delay_secs > 0:
            await asyncio.sleep(self.token_delay_secs)
        form = parse_qs(body.decode("latin-1"))
        if form.get("grant_type") != [_JWT_GRANT] or len(form.get("assertion", [])) != 1:
            await _oauth_error(send, "unsupported_grant_type", "Invalid grant_type.")
            return
        email, problem = self._check(form["assertion"][0])
        if email is None:
            await _oauth_error(send, "invalid_grant", problem)
            return
        token = f"ya29.mock-{uuid.uuid4().hex}"
        self._tokens[token] = (email, time.monotonic() + self.token_lifetime_secs)
        answer = {"access_token": token, "expires_in": self.token_lifetime_secs}
        await send_json(send, 200, {**answer, "token_type": "Bearer"})

    def _check(self, assertion: str) -> tuple[str | None, str]:
        try:
            header_b64, claims_b64, signature_b64 = assertion.split(".")
            header, claims = _json_part(header_b64), _json_part(claims_b64)
            signature = _b64(signature_b64)
        except (ValueError, UnicodeDecodeError):
            return None, "Invalid JWT."
        email = claims.get("iss")
        key = self._trusted.get(email) if isinstance(email, str) else None
        if header.get("alg") != "RS256" or key is None:
            return None, "Invalid JWT Signature."
        if not _verified(key, f"{header_b64}.{claims_b64}".encode(), signature):
            return None, "Invalid JWT Signature."
        if claims.get("aud") != GOOGLE_TOKEN_AUDIENCE:
            return None, "Invalid JWT: audience is not Google's token endpoint."
        expiry = claims.get("exp")
        if not isinstance(expiry, int) or expiry <= time.time():
            return None, "Invalid JWT: Token must be a short-lived token."
        assert isinstance(email, str)
        return email, ""


def envelope_problem(payload: Any, call: VertexCall) -> str | None:
    """Why a rawPredict body is not the Vertex envelope of a Messages request or of a token
    count (None: it is)."""
    if not isinstance(payload, dict):
        return "The request body is not a JSON object."
    if call.model == COUNT_TOKENS_MODEL:
        if call.stream:
            return "count-tokens: rawPredict only."
        if not isinstance(payload.get("model"), str):
            return "model: required in the body."
    elif "model" in payload:
        return 'Unknown name "model": the model is named in the URL.'
    version = payload.get("anthropic_version")
    # Anthropic's Vertex page names `vertex-2023-10-16`; the SDK's own Vertex client sends
    # its API version (a date) instead: either is an envelope, no version is not.
    if not (isinstance(version, str) and (version == VERTEX_VERSION or _DATE.match(version))):
        return f"anthropic_version: required ({VERTEX_VERSION})."
    if (payload.get("stream") is True) != call.stream:
        return "stream: streamRawPredict streams, rawPredict does not."
    return None


def google_error_body(status: int, message: str) -> bytes:
    """An error of the Google API platform, as Vertex sends one before the model runs."""
    error = {"code": status, "message": message, "status": _GOOGLE_STATUS.get(status, "UNKNOWN")}
    return json.dumps({"error": error}).encode()


async def send_google_error(
    send: Send, status: int, message: str, headers: dict[str, str] | None = None
) -> None:
    """Send a Google-shaped error (with `headers`, if given, as they are)."""
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send_whole(send, status, JSON_TYPE, google_error_body(status, message), extra)


async def _oauth_error(send: Send, error: str, description: str) -> None:
    await send_json(send, 400, {"error": error, "error_description": description})


def _b64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _json_part(part: str) -> dict[str, Any]:
    value = json.loads(_b64(part))
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _verified(public_key_pem: bytes, signed: bytes, signature: bytes) -> bool:
    """Whether `signature` is the RS256 signature of `signed` by the key's holder."""
    # cryptography comes with google-auth (the `vertex` extra): only a test that trusts a key
    # needs it.
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    key = serialization.load_pem_public_key(public_key_pem)
    assert isinstance(key, rsa.RSAPublicKey)
    try:
        key.verify(signature, signed, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        return False
    return True
