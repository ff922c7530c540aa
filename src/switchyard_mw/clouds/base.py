"""What every account kind provides: the envelope of a request, the mapping of its answer,
and the credential headers of one call."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

Headers = list[tuple[str, str]]

SECRET_HEADERS = frozenset({"authorization", "x-api-key", "api-key", "x-amz-security-token"})
"""Headers whose values are credentials: never shown (repr, logs, spans, errors)."""


@dataclass(frozen=True, slots=True)
class Envelope:
    """A request re-enveloped for a cloud, before its credential: POST `body` to `url`."""

    url: str
    body: bytes = field(repr=False)
    stream: bool
    """Whether the answer is a stream (the cloud's streaming endpoint was chosen)."""
    model: str
    """The provider's model name, as it went into the path."""


@dataclass(frozen=True, slots=True)
class Outbound:
    """What goes on the wire for one request to an account: POST `body` to `url` with
    `headers` (the credential included). Its repr never shows a credential's value."""

    url: str
    headers: Headers
    body: bytes

    def __repr__(self) -> str:
        shown = [(k, "<redacted>" if k.lower() in SECRET_HEADERS else v) for k, v in self.headers]
        return f"Outbound(url={self.url!r}, headers={shown!r}, body=<{len(self.body)} bytes>)"


class StreamTranslator(Protocol):
    """Turns a cloud's streamed answer into the Anthropic SSE events, chunk by chunk."""

    content_type: bytes
    """The content type of the translated stream (`text/event-stream`)."""
    failure: int | None
    """The status the cloud's own error inside the stream stands for (Bedrock's `exception`
    message: 429 a throttle, 5xx a fault), once one came; None: none did."""

    def feed(self, chunk: bytes) -> bytes:
        """The SSE bytes for what `chunk` completes (possibly none: a frame may be cut)."""
        ...

    def end(self) -> bytes:
        """What is left once the cloud's stream ended; raises `errors.RemoteProtocolError`
        if it ended mid-frame (the client's stream then ends with the wire's error event)."""
        ...


class Cloud(Protocol):
    """The sans-IO part of an account kind: nothing here reads a file or opens a socket."""

    @property
    def kind(self) -> str:
        """The config's `kind`: `vertex` or `bedrock`."""
        ...

    @property
    def base_url(self) -> str:
        """Scheme and host the account is called on (derived from the region unless set)."""
        ...

    @property
    def counts_tokens(self) -> bool:
        """Whether the kind takes a token count (`/v1/messages/count_tokens`): a count is
        never sent to an account of a kind that cannot (`Account.counts_tokens`)."""
        ...

    def envelope(
        self,
        path: str,
        body: bytes,
        *,
        model: str | None = None,
        headers: Iterable[tuple[str, str]] = (),
    ) -> Envelope:
        """The request for the client's `path` and Anthropic Messages `body` (whose `model`
        is the provider's name; `model` stands in when the body names none). `headers`: the
        client's, for what a cloud takes in the body where the API takes a header (Bedrock's
        `anthropic_beta`). Raises `WireError` for what the cloud cannot take (another wire, a
        body that is not JSON)."""
        ...

    def error_answer(
        self, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()
    ) -> tuple[int, bytes]:
        """An error answer of the cloud as the Anthropic API would send it: the status the
        client and the cooling policy see, and the Anthropic error body. `headers` (names
        lowercased) may name the error where the body does not (Bedrock's
        `x-amzn-errortype`)."""
        ...

    def stream_translator(self, content_type: str) -> StreamTranslator | None:
        """A translator for a 2xx stream of `content_type`; None: it is Anthropic SSE."""
        ...


class Credentials(Protocol):
    """The IO part of an account kind: authenticates one request."""

    async def headers(self, envelope: Envelope, headers: Headers) -> Headers:
        """`headers` with the credential added (a bearer token, a signature), for a call of
        `envelope`. Raises `CloudCredentialError` (naming the account) within a bound when
        no credential can be had; never hangs."""
        ...

    def check(self) -> list[str]:
        """What can be checked offline (a key file readable and well-formed), as problems."""
        ...


@dataclass(frozen=True, slots=True)
class CloudAccess:
    """An account's kind, ready to call: its envelope and its credentials."""

    cloud: Cloud
    credentials: Credentials = field(repr=False)

    async def outbound(
        self, path: str, body: bytes, headers: Headers, *, model: str | None
    ) -> Outbound:
        """The whole request: enveloped, then authenticated."""
        envelope = self.cloud.envelope(path, body, model=model, headers=headers)
        signed = await self.credentials.headers(envelope, headers)
        return Outbound(envelope.url, signed, envelope.body)
