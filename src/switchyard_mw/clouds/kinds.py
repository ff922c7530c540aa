"""Each account kind's builder: the `Cloud` and `Credentials` of a `vertex` or `bedrock`
account, the cloud's library imported only when such an account is configured."""

from __future__ import annotations

from collections.abc import Callable

from ..config import LLMClient
from ..errors import StartupError
from .base import CloudAccess
from .bedrock import BedrockCloud, bedrock_base_url
from .vertex import VertexCloud, vertex_base_url


def cloud_access(name: str, spec: LLMClient) -> CloudAccess | None:
    """What calling the account `name` takes, if it is a cloud account (None: `kind = "api"`).

    Raises `MissingExtraError` when the kind's extra is not installed.
    """
    if spec.kind == "api":
        return None
    build = BUILDERS.get(spec.kind)
    if build is None:
        raise StartupError(
            f'llm_clients.{name}.kind: "{spec.kind}" is not available in this version'
        )
    return build(name, spec)


def _vertex(name: str, spec: LLMClient) -> CloudAccess:
    from .google_token import GoogleToken  # google-auth: the `vertex` extra

    settings = spec.vertex
    assert settings is not None  # the config check requires it
    base = spec.base_url.rstrip("/") or vertex_base_url(settings.region)
    return CloudAccess(VertexCloud(name, settings, base), GoogleToken(name, settings))


def _bedrock(name: str, spec: LLMClient) -> CloudAccess:
    from .aws_sigv4 import AwsSigV4  # botocore: the `bedrock` extra

    settings = spec.bedrock
    assert settings is not None  # the config check requires it
    signer = AwsSigV4(name, settings)
    base = spec.base_url.rstrip("/") or bedrock_base_url(signer.region)
    return CloudAccess(BedrockCloud(name, signer.region, base), signer)


BUILDERS: dict[str, Callable[[str, LLMClient], CloudAccess]] = {
    "vertex": _vertex,
    "bedrock": _bedrock,
}
"""Account kind -> builder."""


def base_url_of(spec: LLMClient) -> str:
    """The scheme and host an account is called on: `base_url`, or its cloud's default."""
    if spec.base_url:
        return spec.base_url.rstrip("/")
    if spec.kind == "vertex" and spec.vertex is not None:
        return vertex_base_url(spec.vertex.region)
    if spec.kind == "bedrock" and spec.bedrock is not None and spec.bedrock.region:
        return bedrock_base_url(spec.bedrock.region)
    return ""
