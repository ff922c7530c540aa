"""Claude on Google Vertex AI: rawPredict, streamRawPredict and count-tokens (sans-IO).

The request is the Messages body with the model in the path and `anthropic_version` in the
body; a stream (`"stream": true`) goes to `:streamRawPredict` and comes back as Anthropic SSE
already. A token count (`/v1/messages/count_tokens`) goes to `count-tokens:rawPredict` with the
model in the body. Vertex's own errors (before the model runs) come in Google's shape,
`{"error": {"code": 429, "message": ..., "status": "RESOURCE_EXHAUSTED"}}`, and are answered
in Anthropic's; the model's own errors pass through as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import msgspec

from ..config import VertexSettings
from ..wire import COUNT_TOKENS_PATH
from .anthropic_body import (
    anthropic_error,
    counting_body,
    is_anthropic_error,
    messages_only,
    reenvelope,
)
from .base import Envelope, StreamTranslator

VERTEX_VERSION = "vertex-2023-10-16"
"""The `anthropic_version` Vertex AI takes for Claude (set unless the body sets its own)."""

_PCHAR = "-._~!$&'()*+,;=:@"  # a path segment's own characters: `claude-x@20250101` stays


def vertex_base_url(region: str) -> str:
    """The regional endpoint (`global` has none of its own: the plain host)."""
    if region == "global":
        return "https://aiplatform.googleapis.com"
    return f"https://{region}-aiplatform.googleapis.com"


@dataclass(frozen=True, slots=True)
class VertexCloud:
    """One `kind = "vertex"` account's envelope and answer mapping."""

    account: str
    settings: VertexSettings
    base_url: str
    kind: str = field(default="vertex", init=False)

    def envelope(
        self,
        path: str,
        body: bytes,
        *,
        model: str | None = None,
        headers: Iterable[tuple[str, str]] = (),
    ) -> Envelope:
        """The rawPredict (or streamRawPredict) call for a Messages request (Vertex takes the
        client's `anthropic-beta` header as the API does: `headers` change nothing here).

        A token count goes to `count-tokens:rawPredict` with the model in the body, as the
        Anthropic SDK's Vertex client sends it; Vertex answers it as the API does."""
        if path == COUNT_TOKENS_PATH:
            name, data = counting_body(body, VERTEX_VERSION, model=model)
            return Envelope(
                url=self._url("count-tokens:rawPredict"), body=data, stream=False, model=name
            )
        messages_only(path, self.kind)
        name, stream, data = reenvelope(body, VERTEX_VERSION, model=model)
        verb = "streamRawPredict" if stream else "rawPredict"
        url = self._url(f"{quote(name, safe=_PCHAR)}:{verb}")
        return Envelope(url=url, body=data, stream=stream, model=name)

    def _url(self, method: str) -> str:
        """The URL of `method` (a model's verb, or `count-tokens:rawPredict`) in the account's
        project and region."""
        project = quote(self.settings.project, safe="")
        region = quote(self.settings.region, safe="")
        return (
            f"{self.base_url}/v1/projects/{project}/locations/{region}"
            f"/publishers/anthropic/models/{method}"
        )

    def error_answer(
        self, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()
    ) -> tuple[int, bytes]:
        """Vertex's error in Anthropic's shape. A 404 is the account's fault, not the
        client's (the model is not in this region or project, or not enabled there): a 502
        naming the account, so that the request fails over."""
        if is_anthropic_error(body):
            return status, body
        message = google_message(body) or f"HTTP {status}"
        if status == 404:
            where = f"project {self.settings.project!r}, region {self.settings.region!r}"
            text = f"account {self.account!r}: Vertex AI has no such model in {where}: {message}"
            return 502, anthropic_error(502, text)
        return status, anthropic_error(status, f"Vertex AI: {message}")

    def stream_translator(self, content_type: str) -> StreamTranslator | None:
        """None: streamRawPredict streams Anthropic's SSE events themselves."""
        return None


def google_message(body: bytes) -> str | None:
    """`error.message` (and its `status`) of a Google API error body, which Vertex sends
    alone or as the first item of a list."""
    try:
        fields: Any = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        text = body[:200].decode("utf-8", "replace").strip()
        return text or None
    if isinstance(fields, list) and fields:
        fields = fields[0]
    error = fields.get("error") if isinstance(fields, dict) else None
    if not isinstance(error, dict):
        return None
    message, status = error.get("message"), error.get("status")
    text = message if isinstance(message, str) else ""
    return f"{status}: {text}" if isinstance(status, str) else text or None
