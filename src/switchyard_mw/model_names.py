"""Provider model names: the path an account's `path` template gives for a model.

The name a provider knows a model by is the account's (`LLMClient.provider_model`); this fills
it into a path template, escaped as one path segment so that a name with `/` or `?` cannot
reach another endpoint.
"""

from __future__ import annotations

from urllib.parse import quote

PLACEHOLDER = "{model}"
_PCHAR = "-._~!$&'()*+,;=:@"
"""What RFC 3986 allows unescaped in a path segment (a Bedrock-style `...-v1:0` stays as is)."""


def fill_path(template: str, provider_model: str) -> str:
    """`template` with each `{model}` replaced by `provider_model`, escaped as a segment."""
    if PLACEHOLDER not in template:
        return template
    return template.replace(PLACEHOLDER, quote(provider_model, safe=_PCHAR))


def with_query(url: str, query: str) -> str:
    """`url` with the client's query string added (after the template's own, if any)."""
    if not query:
        return url
    return f"{url}{'&' if '?' in url else '?'}{query}"
