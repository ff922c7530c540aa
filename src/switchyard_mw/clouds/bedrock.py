"""Claude on Amazon Bedrock: InvokeModel and InvokeModelWithResponseStream (sans-IO).

The request is the Messages body without `model` and `stream` (the model goes in the path,
the choice of endpoint says whether it streams) and with `anthropic_version:
"bedrock-2023-05-31"`, posted to `/model/{modelId}/invoke` or
`/model/{modelId}/invoke-with-response-stream`. A JSON answer is the API's message itself; a
stream is Anthropic's events in AWS's binary event-stream framing (`bedrock_stream`). Bedrock's
errors come as `{"message": ...}` named by their exception type (`bedrock_errors`) and are
answered in Anthropic's shape. The signature is `aws_sigv4`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from ..model_names import PLACEHOLDER, fill_path
from .anthropic_body import is_anthropic_error, messages_only, reenvelope
from .base import Envelope, StreamTranslator
from .bedrock_errors import exception_type, mapped, message_of
from .bedrock_stream import EVENTSTREAM_TYPE, BedrockStream

BEDROCK_VERSION = "bedrock-2023-05-31"
"""The `anthropic_version` Bedrock takes for Claude (set unless the body sets its own)."""


def bedrock_base_url(region: str) -> str:
    """The Bedrock runtime endpoint of `region`."""
    return f"https://bedrock-runtime.{region}.amazonaws.com"


@dataclass(frozen=True, slots=True)
class BedrockCloud:
    """One `kind = "bedrock"` account's envelope and answer mapping."""

    account: str
    region: str
    base_url: str
    kind: str = field(default="bedrock", init=False)
    # Bedrock has no token count (the Anthropic SDK's Bedrock client refuses it too).
    counts_tokens: bool = field(default=False, init=False)

    def envelope(
        self,
        path: str,
        body: bytes,
        *,
        model: str | None = None,
        headers: Iterable[tuple[str, str]] = (),
    ) -> Envelope:
        """The InvokeModel (or InvokeModelWithResponseStream) call for a Messages request.

        Bedrock takes the API's betas in the body: the client's `anthropic-beta` headers
        become `anthropic_beta` (as the Anthropic SDK's own Bedrock client sends them), unless
        the body has one already."""
        messages_only(path, self.kind)
        betas = _betas(headers)
        add = {"anthropic_beta": betas} if betas else None
        name, stream, data = reenvelope(
            body, BEDROCK_VERSION, model=model, drop=("stream",), add=add
        )
        verb = "invoke-with-response-stream" if stream else "invoke"
        # The signature covers the path exactly as it goes out, so it is written as every HTTP
        # client sends it: a path segment's own characters (a model id's `:`) left as they
        # are. botocore escapes `:` as `%3A`, but aiohttp's URLs turn `%3A` back into `:`
        # before sending, and a signature of the one would not match the other.
        url = f"{self.base_url}{fill_path(f'/model/{PLACEHOLDER}/{verb}', name)}"
        return Envelope(url=url, body=data, stream=stream, model=name)

    def error_answer(
        self, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()
    ) -> tuple[int, bytes]:
        """Bedrock's error in Anthropic's shape, with the status its exception type stands
        for (see `bedrock_errors`): the model's own errors pass through as they are."""
        if is_anthropic_error(body):
            return status, body
        named = exception_type(headers, body)
        error = mapped(named, status)
        text = message_of(body) or f"HTTP {status}"
        if named is not None and named.lower() == "resourcenotfoundexception":
            text = f"account {self.account!r}: Bedrock has no such model in {self.region}: {text}"
        elif error.status != 400:  # a request's own fault reads as the API's message
            text = f"Bedrock: {named or f'HTTP {status}'}: {text}"
        return error.status, anthropic_error_of(error.error_type, text)

    def stream_translator(self, content_type: str) -> StreamTranslator | None:
        """The event-stream's translator; None for any other answer (an error's JSON)."""
        if content_type.split(";", 1)[0].strip().lower() != EVENTSTREAM_TYPE:
            return None
        return BedrockStream()


def _betas(headers: Iterable[tuple[str, str]]) -> list[str]:
    """Every beta the client's `anthropic-beta` headers name (comma-separated, repeatable)."""
    return [
        beta.strip()
        for name, value in headers
        if name.lower() == "anthropic-beta"
        for beta in value.split(",")
        if beta.strip()
    ]


def anthropic_error_of(error_type: str, message: str) -> bytes:
    """An Anthropic error body."""
    return msgspec.json.encode({"type": "error", "error": {"type": error_type, "message": message}})
