"""Claude through the clouds: what an account of each kind puts on the wire, and how its
answer comes back in the Anthropic API's shapes.

A `vertex` or `bedrock` account takes the Anthropic Messages body in another envelope (the
model in the path, `anthropic_version` in the body, no `model` key) and another credential
(a Google OAuth token, an AWS Signature V4). Each kind is two parts:

- a `Cloud` (sans-IO): the URL, the body and the answer's mapping back (error bodies in the
  Anthropic shape, a stream translator where the cloud's stream is not Anthropic SSE);
- its `Credentials`: the headers that authenticate one request (a cached token, a signature),
  the only part that may do IO, through the cloud's own library behind its extra.

`accounts.Account.outbound()` puts the two together for the forwarding app and for a team's
own forwarding code (`await ctx.account.outbound(path, body)`).
"""

from __future__ import annotations

from .base import Cloud, CloudAccess, Credentials, Envelope, Outbound, StreamTranslator
from .kinds import cloud_access

__all__ = [
    "Cloud",
    "CloudAccess",
    "Credentials",
    "Envelope",
    "Outbound",
    "StreamTranslator",
    "cloud_access",
]
