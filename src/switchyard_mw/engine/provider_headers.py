"""The provider's own headers on an answer: which never reach the client, and its request id.

A provider names itself in headers (AWS's `x-amzn-*`, Google's `x-goog-*`, the organization an
OpenAI or Anthropic key belongs to): the client asked switchyard, not a provider, and must not
learn which account served it, or whose. The provider's request id is what its support asks
for: `request-id` (Anthropic) and `x-request-id` (OpenAI) pass as they are, since the official
SDKs read them (`_request_id`); whichever the provider sent (Bedrock's `x-amzn-requestid`
included) also comes back as `x-switchyard-upstream-request-id` when `expose_headers` is on.
Names are lowercase bytes, as both fronts carry them.
"""

from __future__ import annotations

from collections.abc import Iterable

WITHHELD_PREFIXES = (b"x-amzn-", b"x-goog-")
WITHHELD_NAMES = frozenset({b"openai-organization", b"anthropic-organization-id"})
REQUEST_ID_NAMES = (b"request-id", b"x-request-id", b"x-amzn-requestid")
"""The providers' request id headers, the one read first where an answer has several."""
UPSTREAM_REQUEST_ID = b"x-switchyard-upstream-request-id"


def withheld(name: bytes) -> bool:
    """Whether the (lowercase) header `name` names the provider and stays from the client."""
    return name in WITHHELD_NAMES or name.startswith(WITHHELD_PREFIXES)


WITHHELD_KEYS = frozenset(name.decode() for name in WITHHELD_NAMES)
WITHHELD_KEY_PREFIXES = tuple(prefix.decode() for prefix in WITHHELD_PREFIXES)
"""`withheld`'s names as text, for a front that reads header names as text (Envoy's)."""
REQUEST_ID_KEYS = {name.decode(): name for name in REQUEST_ID_NAMES}
"""`REQUEST_ID_NAMES` by their text."""


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The provider's request id among `headers` (lowercase names); None: it sent none."""
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        if name in REQUEST_ID_NAMES and name not in found:
            found[name] = value
    for name in REQUEST_ID_NAMES:
        if name in found:
            return found[name]
    return None
